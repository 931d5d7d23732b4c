// Kernel I/O backends, driven only through raw syscalls and the UAPI headers
// (<linux/io_uring.h>, <linux/aio_abi.h>): no liburing, no libaio.
//
// Each backend follows liburing's shape: prepare pieces, submit them, reap
// completions. A completion is (slot, result) where result is a byte count or
// -errno. One backend instance belongs to one worker thread; nothing here is
// thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace dsio {

enum class Op : int { Read = 0, Write = 1, Fsync = 2 };

struct Completion {
  uint32_t slot;
  int64_t result;  // bytes transferred, or -errno
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Queue one piece for submission; nothing reaches the kernel until submit().
  virtual void prepare(uint32_t slot, Op op, int fd, void* buf, uint64_t len, int64_t off) = 0;
  // Hand prepared pieces to the kernel. single=true issues one syscall per piece.
  // Returns 0 or -errno. On error, pieces not accepted are reported through
  // `rejected` with their slots so the caller can fail them.
  virtual int submit(bool single, std::vector<uint32_t>& rejected) = 0;
  // Wait until at least `min` completions are available (0: don't wait), then
  // append every available completion to `out`. Returns 0 or -errno.
  virtual int reap(unsigned min, std::vector<Completion>& out) = 0;
  virtual const char* name() const = 0;
  std::atomic<uint64_t> submit_syscalls{0};  // read by statistics() from other threads
  std::atomic<uint64_t> wait_syscalls{0};
};

// Runs each piece to completion inside submit() with a blocking call (posix pread/pwrite,
// cuFileRead/Write): parallelism comes from the engine's workers, not from the kernel queue.
class SyncBackend : public Backend {
 public:
  void prepare(uint32_t slot, Op op, int fd, void* buf, uint64_t len, int64_t off) override {
    pending_.push_back(Piece{slot, op, fd, buf, len, off});
  }
  int submit(bool, std::vector<uint32_t>&) override {
    for (const Piece& p : pending_) {
      ++submit_syscalls;
      done_.push_back(Completion{p.slot, run(p)});
    }
    pending_.clear();
    return 0;
  }
  int reap(unsigned, std::vector<Completion>& out) override {
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
    return 0;
  }

 protected:
  struct Piece {
    uint32_t slot;
    Op op;
    int fd;
    void* buf;
    uint64_t len;
    int64_t off;
  };
  // Bytes transferred, or -errno.
  virtual int64_t run(const Piece& p) = 0;

 private:
  std::vector<Piece> pending_;
  std::vector<Completion> done_;
};

// Throws std::system_error when the kernel refuses (ENOSYS, EPERM under
// seccomp or io_uring_disabled, ENOMEM...).
Backend* make_io_uring(unsigned depth);
Backend* make_aio(unsigned depth);
Backend* make_posix();
Backend* make_cufile();  // throws std::runtime_error when libcufile is unusable

// Returns 0 when the backend can be set up here, else -errno.
int probe_io_uring();
int probe_aio();

}  // namespace dsio
