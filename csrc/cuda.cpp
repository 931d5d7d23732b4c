#include "cuda.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <unordered_map>

namespace dsio {
namespace {

template <typename F>
bool sym(void* lib, const char* name, F& out, std::string& error) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (out == nullptr) error = std::string("missing symbol ") + name;
  return out != nullptr;
}

constexpr int kPointerAttributeContext = 1;  // CU_POINTER_ATTRIBUTE_CONTEXT

std::mutex g_reg_mu;
std::unordered_map<int, void*> g_handles;

}  // namespace

const CudaDriver& cuda_driver() {
  static CudaDriver d = [] {
    CudaDriver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      r.error = std::string("libcuda.so.1: ") + dlerror();
      return r;
    }
    bool ok = sym(lib, "cuInit", r.cuInit, r.error) && sym(lib, "cuLaunchHostFunc", r.cuLaunchHostFunc, r.error) &&
              sym(lib, "cuPointerGetAttribute", r.cuPointerGetAttribute, r.error) &&
              sym(lib, "cuCtxSetCurrent", r.cuCtxSetCurrent, r.error);
    if (ok) {
      int rc = r.cuInit(0);
      if (rc != 0) {
        r.error = "cuInit failed with CUresult " + std::to_string(rc);
        ok = false;
      }
    }
    r.ok = ok;
    return r;
  }();
  return d;
}

int cuda_bind_context(uint64_t ptr) {
  const CudaDriver& d = cuda_driver();
  if (!d.ok) return -1;
  void* ctx = nullptr;
  int rc = d.cuPointerGetAttribute(&ctx, kPointerAttributeContext, ptr);
  if (rc != 0) return rc;
  return d.cuCtxSetCurrent(ctx);
}

const CuFileLib& cufile() {
  static CuFileLib c = [] {
    CuFileLib r;
    if (!cuda_driver().ok) {
      r.error = "no CUDA driver: " + cuda_driver().error;
      return r;
    }
    void* lib = dlopen("libcufile.so.0", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libcufile.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      r.error = std::string("libcufile: ") + dlerror();
      return r;
    }
    bool ok = sym(lib, "cuFileDriverOpen", r.cuFileDriverOpen, r.error) &&
              sym(lib, "cuFileHandleRegister", r.cuFileHandleRegister, r.error) &&
              sym(lib, "cuFileHandleDeregister", r.cuFileHandleDeregister, r.error) &&
              sym(lib, "cuFileBufRegister", r.cuFileBufRegister, r.error) &&
              sym(lib, "cuFileBufDeregister", r.cuFileBufDeregister, r.error) &&
              sym(lib, "cuFileRead", r.cuFileRead, r.error) && sym(lib, "cuFileWrite", r.cuFileWrite, r.error);
    if (ok) {
      CuFileError e = r.cuFileDriverOpen();
      if (e.err != 0) {
        r.error = "cuFileDriverOpen failed: CUfileOpError " + std::to_string(e.err) + ", CUresult " +
                  std::to_string(e.cu_err);
        ok = false;
      }
    }
    r.ok = ok;
    return r;
  }();
  return c;
}

int cufile_register(int fd) {
  const CuFileLib& c = cufile();
  if (!c.ok) return -ENOSYS;
  std::lock_guard<std::mutex> g(g_reg_mu);
  if (g_handles.count(fd)) return 0;
  CuFileDescr d{};
  d.type = 1;
  d.handle.fd = fd;
  void* fh = nullptr;
  CuFileError e = c.cuFileHandleRegister(&fh, &d);
  if (e.err != 0) return -(1000 + e.err);
  g_handles[fd] = fh;
  return 0;
}

void cufile_deregister(int fd) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  auto it = g_handles.find(fd);
  if (it == g_handles.end()) return;
  cufile().cuFileHandleDeregister(it->second);
  g_handles.erase(it);
}

void* cufile_handle(int fd) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  auto it = g_handles.find(fd);
  return it == g_handles.end() ? nullptr : it->second;
}

int cufile_buf_register(uint64_t ptr, size_t length) {
  const CuFileLib& c = cufile();
  if (!c.ok) return -ENOSYS;
  CuFileError e = c.cuFileBufRegister(reinterpret_cast<const void*>(ptr), length, 0);
  return e.err == 0 ? 0 : -(1000 + e.err);
}

int cufile_buf_deregister(uint64_t ptr) {
  const CuFileLib& c = cufile();
  if (!c.ok) return -ENOSYS;
  CuFileError e = c.cuFileBufDeregister(reinterpret_cast<const void*>(ptr));
  return e.err == 0 ? 0 : -(1000 + e.err);
}

bool nvidia_fs_loaded() { return access("/sys/module/nvidia_fs", F_OK) == 0; }

}  // namespace dsio
