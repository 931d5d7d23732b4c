// CUDA driver and cuFile, loaded at run time with dlopen: dsio builds and imports with no CUDA
// installed. Only the handful of entry points dsio calls are declared here, with the ABI of the
// public headers (cuda.h, cufile.h); gpu-check compares these layouts with the real headers.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace dsio {

struct CudaDriver {
  bool ok = false;
  std::string error;
  int (*cuInit)(unsigned) = nullptr;
  int (*cuLaunchHostFunc)(void* stream, void (*fn)(void*), void* user) = nullptr;
  int (*cuPointerGetAttribute)(void* data, int attribute, uint64_t ptr) = nullptr;
  int (*cuCtxSetCurrent)(void* ctx) = nullptr;
};
// libcuda.so.1, loaded once. ok=false with the reason when there is no driver.
const CudaDriver& cuda_driver();

// Makes the context owning device pointer `ptr` current on this thread. 0 or a CUresult.
int cuda_bind_context(uint64_t ptr);

// cuFile (GPUDirect Storage).
struct CuFileError {
  int err;     // CUfileOpError, 0 = success
  int cu_err;  // CUresult
};
struct CuFileDescr {
  int type;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};
struct CuFileLib {
  bool ok = false;
  std::string error;
  CuFileError (*cuFileDriverOpen)() = nullptr;
  CuFileError (*cuFileHandleRegister)(void** fh, CuFileDescr* descr) = nullptr;
  void (*cuFileHandleDeregister)(void* fh) = nullptr;
  CuFileError (*cuFileBufRegister)(const void* base, size_t length, int flags) = nullptr;
  CuFileError (*cuFileBufDeregister)(const void* base) = nullptr;
  ssize_t (*cuFileRead)(void* fh, void* base, size_t size, off_t file_offset, off_t buf_offset) = nullptr;
  ssize_t (*cuFileWrite)(void* fh, const void* base, size_t size, off_t file_offset, off_t buf_offset) = nullptr;
};
// libcufile.so.0 loaded and cuFileDriverOpen'ed once; ok=false with the reason otherwise.
const CuFileLib& cufile();

// fd -> registered cuFile handle (process-wide). 0 or -errno / -(1000 + CUfileOpError).
int cufile_register(int fd);
void cufile_deregister(int fd);
void* cufile_handle(int fd);
int cufile_buf_register(uint64_t ptr, size_t length);
int cufile_buf_deregister(uint64_t ptr);
bool nvidia_fs_loaded();

}  // namespace dsio
