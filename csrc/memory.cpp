#include "memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace dsio {

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock) : nbytes_(nbytes) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  mapped_ = nbytes == 0 ? page : (nbytes + page - 1) / page * page;
  ptr_ = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr_ == MAP_FAILED) {
    ptr_ = nullptr;
    throw std::system_error(errno, std::generic_category(), "mmap");
  }
  if (lock) {
    if (mlock(ptr_, mapped_) == 0) {
      locked_ = true;
    } else {
      lock_errno_ = errno;
    }
  }
}

AlignedBuffer::~AlignedBuffer() {
  if (ptr_ == nullptr) return;
  if (locked_) munlock(ptr_, mapped_);
  munmap(ptr_, mapped_);
}

}  // namespace dsio
