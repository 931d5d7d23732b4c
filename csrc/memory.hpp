// Page-aligned host memory, optionally locked (mlock) so the kernel never pages
// it out while a DMA or an O_DIRECT transfer targets it, and optionally backed by
// transparent huge pages.
//
// Huge pages (hugepage=true): the mapping is placed on a 2 MiB boundary and advised
// MADV_HUGEPAGE before anything touches it, so each 2 MiB is one physically contiguous
// page (THP "madvise" mode honours the advice; "never" ignores it, "always" needs none).
// Measured for the staging pool of reads (issue 17, bench/results/io-read-staging-thp-*.md):
// a 4 KiB-page pool's staged read speed depends on where the pool's pages landed (1.2-2.0
// GB/s across pools of one process, the same pool steady), a huge-page pool runs at the
// direct path's speed.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dsio {

constexpr size_t kHugePage = size_t{2} << 20;

class AlignedBuffer {
 public:
  // Throws std::system_error when mmap fails; a refused mlock only leaves locked() false, a
  // refused MADV_HUGEPAGE only leaves hugepage() false.
  AlignedBuffer(size_t nbytes, bool lock, bool hugepage = false);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t size() const { return nbytes_; }
  bool locked() const { return locked_; }
  int lock_errno() const { return lock_errno_; }
  // Whether the kernel accepted MADV_HUGEPAGE for the region (asked for and THP built in).
  bool hugepage() const { return huge_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
  bool huge_ = false;
  int lock_errno_ = 0;
};

}  // namespace dsio
