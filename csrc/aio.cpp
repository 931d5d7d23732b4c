// Linux native AIO through io_setup / io_submit / io_getevents (no libaio).
//
// ext4 and xfs do not implement IOCB_CMD_FSYNC, so an fsync piece is run
// synchronously by the worker and reported as an ordinary completion.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <system_error>

#include "backend.hpp"

namespace dsio {
namespace {

class Aio final : public Backend {
 public:
  explicit Aio(unsigned depth) : depth_(depth), iocbs_(depth), events_(depth) {
    if (syscall(__NR_io_setup, depth, &ctx_) < 0)
      throw std::system_error(errno, std::generic_category(), "io_setup");
    free_.reserve(depth);
    for (unsigned i = 0; i < depth; ++i) free_.push_back(depth - 1 - i);
  }
  ~Aio() override { syscall(__NR_io_destroy, ctx_); }

  void prepare(uint32_t slot, Op op, int fd, void* buf, uint64_t len, int64_t off) override {
    if (op == Op::Fsync) {
      int r = fsync(fd);
      backlog_.push_back(Completion{slot, r < 0 ? -static_cast<int64_t>(errno) : 0});
      return;
    }
    unsigned i = free_.back();
    free_.pop_back();
    iocb& cb = iocbs_[i];
    std::memset(&cb, 0, sizeof(cb));
    cb.aio_data = (static_cast<uint64_t>(i) << 32) | slot;
    cb.aio_lio_opcode = op == Op::Read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    cb.aio_fildes = static_cast<uint32_t>(fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(buf);
    cb.aio_nbytes = len;
    cb.aio_offset = off;
    pending_.push_back(&cb);
  }

  int submit(bool single, std::vector<uint32_t>& rejected) override {
    size_t done = 0;
    int rc = 0;
    while (done < pending_.size()) {
      long want = single ? 1 : static_cast<long>(pending_.size() - done);
      long r = syscall(__NR_io_submit, ctx_, want, pending_.data() + done);
      ++submit_syscalls;
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        rc = -errno;
        break;
      }
      done += static_cast<size_t>(r);
    }
    for (size_t i = done; i < pending_.size(); ++i) {
      uint64_t data = pending_[i]->aio_data;
      free_.push_back(static_cast<unsigned>(data >> 32));
      rejected.push_back(static_cast<uint32_t>(data & 0xffffffffu));
    }
    pending_.clear();
    return rc;
  }

  int reap(unsigned min, std::vector<Completion>& out) override {
    size_t got = backlog_.size();
    out.insert(out.end(), backlog_.begin(), backlog_.end());
    backlog_.clear();
    long want_min = got >= min ? 0 : static_cast<long>(min - got);
    for (;;) {
      timespec zero{0, 0};
      long r = syscall(__NR_io_getevents, ctx_, want_min, static_cast<long>(depth_), events_.data(),
                       want_min == 0 ? &zero : nullptr);
      ++wait_syscalls;
      if (r < 0) {
        if (errno == EINTR) continue;
        return -errno;
      }
      for (long k = 0; k < r; ++k) {
        const io_event& ev = events_[k];
        free_.push_back(static_cast<unsigned>(ev.data >> 32));
        out.push_back(Completion{static_cast<uint32_t>(ev.data & 0xffffffffu), static_cast<int64_t>(ev.res)});
      }
      got += static_cast<size_t>(r);
      if (got >= min) return 0;
      want_min = static_cast<long>(min - got);
    }
  }

  const char* name() const override { return "aio"; }

 private:
  aio_context_t ctx_ = 0;
  unsigned depth_;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> pending_;
  std::vector<unsigned> free_;
  std::vector<io_event> events_;
  std::vector<Completion> backlog_;
};

// Synchronous pread/pwrite in the worker thread: for filesystems or kernels where neither
// io_uring nor AIO is usable.
class Posix final : public SyncBackend {
 public:
  const char* name() const override { return "posix"; }

 protected:
  int64_t run(const Piece& p) override {
    ssize_t r;
    do {
      switch (p.op) {
        case Op::Read: r = pread(p.fd, p.buf, p.len, p.off); break;
        case Op::Write: r = pwrite(p.fd, p.buf, p.len, p.off); break;
        default: r = fsync(p.fd); break;
      }
    } while (r < 0 && errno == EINTR);
    return r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r);
  }
};

}  // namespace

Backend* make_aio(unsigned depth) { return new Aio(depth); }
Backend* make_posix() { return new Posix(); }

int probe_aio() {
  try {
    Aio a(1);
    return 0;
  } catch (const std::system_error& e) {
    return -e.code().value();
  }
}

}  // namespace dsio
