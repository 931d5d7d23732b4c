// io_uring through io_uring_setup / io_uring_enter and the mmap'ed rings.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "backend.hpp"

namespace dsio {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

template <typename T>
T load_acquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void store_release(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

class Uring final : public Backend {
 public:
  explicit Uring(unsigned depth) {
    unsigned entries = 1;
    while (entries < depth) entries <<= 1;
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = entries * 2;
    fd_ = sys_setup(entries, &p);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "io_uring_setup");
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    single_mmap_ = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap_) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ptr_ = mmap(nullptr, sq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    if (sq_ptr_ == MAP_FAILED) fail("mmap sq ring");
    cq_ptr_ = single_mmap_ ? sq_ptr_
                           : mmap(nullptr, cq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                                  IORING_OFF_CQ_RING);
    if (cq_ptr_ == MAP_FAILED) fail("mmap cq ring");
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(
        mmap(nullptr, sqes_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES));
    if (sqes_ == MAP_FAILED) fail("mmap sqes");
    auto* sq = static_cast<char*>(sq_ptr_);
    sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_entries_ = p.sq_entries;
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    auto* cq = static_cast<char*>(cq_ptr_);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
  }

  ~Uring() override { release(); }

  void prepare(uint32_t slot, Op op, int fd, void* buf, uint64_t len, int64_t off) override {
    unsigned tail = *sq_tail_;  // only this thread writes the tail
    unsigned idx = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[idx];
    std::memset(sqe, 0, sizeof(*sqe));
    switch (op) {
      case Op::Read: sqe->opcode = IORING_OP_READ; break;
      case Op::Write: sqe->opcode = IORING_OP_WRITE; break;
      case Op::Fsync: sqe->opcode = IORING_OP_FSYNC; break;
    }
    sqe->fd = fd;
    sqe->addr = reinterpret_cast<uint64_t>(buf);
    sqe->len = static_cast<uint32_t>(len);
    sqe->off = static_cast<uint64_t>(off);
    sqe->user_data = slot;
    sq_array_[idx] = idx;
    pending_slots_.push_back(slot);
    store_release(sq_tail_, tail + 1);
  }

  int submit(bool single, std::vector<uint32_t>& rejected) override {
    size_t done = 0;
    int rc = 0;
    while (done < pending_slots_.size()) {
      unsigned want = single ? 1u : static_cast<unsigned>(pending_slots_.size() - done);
      int r = sys_enter(fd_, want, 0, 0);
      ++submit_syscalls;
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EBUSY) {
          if (errno != EINTR) reap_into_backlog();  // make room in the CQ, then retry
          continue;
        }
        rc = -errno;
        break;
      }
      done += static_cast<size_t>(r);
    }
    if (rc < 0) {
      // The kernel refused the rest: roll the SQ tail back so they are never seen.
      size_t left = pending_slots_.size() - done;
      store_release(sq_tail_, *sq_tail_ - static_cast<unsigned>(left));
      for (size_t i = done; i < pending_slots_.size(); ++i) rejected.push_back(pending_slots_[i]);
    }
    pending_slots_.clear();
    return rc;
  }

  int reap(unsigned min, std::vector<Completion>& out) override {
    out.insert(out.end(), backlog_.begin(), backlog_.end());
    size_t got = backlog_.size();
    backlog_.clear();
    got += drain(out);
    while (got < min) {
      int r = sys_enter(fd_, 0, static_cast<unsigned>(min - got), IORING_ENTER_GETEVENTS);
      ++wait_syscalls;
      if (r < 0 && errno != EINTR && errno != EAGAIN) return -errno;
      got += drain(out);
    }
    return 0;
  }

  const char* name() const override { return "io_uring"; }

 private:
  size_t drain(std::vector<Completion>& out) {
    unsigned head = *cq_head_;
    unsigned tail = load_acquire(cq_tail_);
    size_t n = 0;
    while (head != tail) {
      const io_uring_cqe& c = cqes_[head & cq_mask_];
      out.push_back(Completion{static_cast<uint32_t>(c.user_data), c.res});
      ++head;
      ++n;
    }
    store_release(cq_head_, head);
    return n;
  }
  void reap_into_backlog() { drain(backlog_); }

  [[noreturn]] void fail(const char* what) {
    int e = errno;
    release();
    throw std::system_error(e, std::generic_category(), what);
  }
  void release() {
    if (sqes_ && sqes_ != MAP_FAILED) munmap(sqes_, sqes_len_);
    if (cq_ptr_ && cq_ptr_ != MAP_FAILED && !single_mmap_) munmap(cq_ptr_, cq_len_);
    if (sq_ptr_ && sq_ptr_ != MAP_FAILED) munmap(sq_ptr_, sq_len_);
    if (fd_ >= 0) close(fd_);
    sqes_ = nullptr;
    cq_ptr_ = sq_ptr_ = nullptr;
    fd_ = -1;
  }

  int fd_ = -1;
  bool single_mmap_ = false;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned sq_mask_ = 0, sq_entries_ = 0;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  std::vector<uint32_t> pending_slots_;
  std::vector<Completion> backlog_;
};

}  // namespace

Backend* make_io_uring(unsigned depth) { return new Uring(depth); }

int probe_io_uring() {
  try {
    Uring u(4);
    // A NOP round trip proves io_uring_enter works too (seccomp may allow setup only).
    std::vector<uint32_t> rejected;
    std::vector<Completion> out;
    u.prepare(0, Op::Fsync, -1, nullptr, 0, 0);  // fsync on fd -1: completes with -EBADF
    if (u.submit(false, rejected) < 0 || !rejected.empty()) return -EIO;
    if (u.reap(1, out) < 0 || out.size() != 1) return -EIO;
    return 0;
  } catch (const std::system_error& e) {
    return -e.code().value();
  }
}

}  // namespace dsio
