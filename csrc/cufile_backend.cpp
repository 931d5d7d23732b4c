// The "cufile" backend: pieces run synchronously through cuFileRead / cuFileWrite in the
// worker thread (cuFile's own API is blocking), on fds registered with cufile_register().
// Like the posix backend, parallelism comes from intra_op_parallelism workers.
#include <cerrno>
#include <stdexcept>
#include <vector>

#include "backend.hpp"
#include "cuda.hpp"

namespace dsio {
namespace {

class CuFileBackend final : public Backend {
 public:
  void prepare(uint32_t slot, Op op, int fd, void* buf, uint64_t len, int64_t off) override {
    pending_.push_back(P{slot, op, fd, buf, len, off});
  }
  int submit(bool, std::vector<uint32_t>&) override {
    const CuFileLib& c = cufile();
    for (const P& p : pending_) {
      int64_t res;
      void* fh = cufile_handle(p.fd);
      if (p.op == Op::Fsync) {
        res = 0;  // cuFile writes reach the file like pwrite; the caller fsyncs the fd itself
      } else if (!c.ok || fh == nullptr) {
        res = -EBADF;
      } else if (cuda_bind_context(reinterpret_cast<uint64_t>(p.buf)) != 0) {
        res = -EFAULT;  // not a device pointer this driver knows
      } else {
        ssize_t r = p.op == Op::Read ? c.cuFileRead(fh, p.buf, p.len, p.off, 0)
                                     : c.cuFileWrite(fh, p.buf, p.len, p.off, 0);
        if (r == -1)
          res = -static_cast<int64_t>(errno);
        else if (r < 0)
          res = -EIO;  // a CUfileOpError
        else
          res = r;
      }
      ++submit_syscalls;
      done_.push_back(Completion{p.slot, res});
    }
    pending_.clear();
    return 0;
  }
  int reap(unsigned, std::vector<Completion>& out) override {
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
    return 0;
  }
  const char* name() const override { return "cufile"; }

 private:
  struct P {
    uint32_t slot;
    Op op;
    int fd;
    void* buf;
    uint64_t len;
    int64_t off;
  };
  std::vector<P> pending_;
  std::vector<Completion> done_;
};

}  // namespace

Backend* make_cufile() {
  if (!cufile().ok) throw std::runtime_error("cufile unavailable: " + cufile().error);
  return new CuFileBackend();
}

}  // namespace dsio
