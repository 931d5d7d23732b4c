// Page-aligned host memory, optionally locked (mlock) so the kernel never pages
// it out while a DMA or an O_DIRECT transfer targets it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dsio {

class AlignedBuffer {
 public:
  // Throws std::system_error when mmap fails; a refused mlock only leaves locked() false.
  AlignedBuffer(size_t nbytes, bool lock);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t size() const { return nbytes_; }
  bool locked() const { return locked_; }
  int lock_errno() const { return lock_errno_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
  int lock_errno_ = 0;
};

}  // namespace dsio
