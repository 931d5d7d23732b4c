#include "memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace dsio {
namespace {

// An anonymous mapping of `len` bytes starting on an `align` boundary (a power of two): map
// len + align, unmap the unaligned head and the tail.
void* map_aligned(size_t len, size_t align) {
  size_t over = len + align;
  void* p = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return MAP_FAILED;
  auto base = reinterpret_cast<uintptr_t>(p);
  uintptr_t start = (base + align - 1) & ~(uintptr_t{align} - 1);
  size_t head = start - base;
  size_t tail = over - head - len;
  if (head != 0) munmap(p, head);
  if (tail != 0) munmap(reinterpret_cast<void*>(start + len), tail);
  return reinterpret_cast<void*>(start);
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock, bool hugepage) : nbytes_(nbytes) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  mapped_ = nbytes == 0 ? page : (nbytes + page - 1) / page * page;
  if (hugepage && mapped_ >= kHugePage) {
    ptr_ = map_aligned(mapped_, kHugePage);
  } else {
    ptr_ = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (ptr_ == MAP_FAILED) {
    ptr_ = nullptr;
    throw std::system_error(errno, std::generic_category(), "mmap");
  }
#ifdef MADV_HUGEPAGE
  // Before the first touch (mlock populates): the pages are then allocated as huge pages.
  if (hugepage && mapped_ >= kHugePage) huge_ = madvise(ptr_, mapped_, MADV_HUGEPAGE) == 0;
#endif
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
