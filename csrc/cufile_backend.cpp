// The "cufile" backend: pieces run synchronously through cuFileRead / cuFileWrite in the
// worker thread (cuFile's own API is blocking), on fds registered with cufile_register().
// Like the posix backend, parallelism comes from intra_op_parallelism workers.
#include <cerrno>
#include <stdexcept>

#include "backend.hpp"
#include "cuda.hpp"

namespace dsio {
namespace {

class CuFileBackend final : public SyncBackend {
 public:
  const char* name() const override { return "cufile"; }

 protected:
  int64_t run(const Piece& p) override {
    if (p.op == Op::Fsync) return 0;  // cuFile writes reach the file like pwrite; fsync goes via the fd
    const CuFileLib& c = cufile();
    void* fh = cufile_handle(p.fd);
    if (!c.ok || fh == nullptr) return -EBADF;
    if (cuda_bind_context(reinterpret_cast<uint64_t>(p.buf)) != 0) return -EFAULT;  // not a device pointer
    ssize_t r = p.op == Op::Read ? c.cuFileRead(fh, p.buf, p.len, p.off, 0) : c.cuFileWrite(fh, p.buf, p.len, p.off, 0);
    if (r == -1) return -static_cast<int64_t>(errno);
    return r < 0 ? -EIO : r;  // below -1: a CUfileOpError
  }
};

}  // namespace

Backend* make_cufile() {
  if (!cufile().ok) throw std::runtime_error("cufile unavailable: " + cufile().error);
  return new CuFileBackend();
}

}  // namespace dsio
