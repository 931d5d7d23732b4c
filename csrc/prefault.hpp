// Prefaulting: populate the page tables of a destination range on helper threads, ahead of
// the reads that will fill it, so first-touch faults (the kernel zeroing fresh pages) overlap
// the disk instead of stalling the submitter or the staging copy.
//
// Mechanism: madvise(MADV_POPULATE_WRITE) (Linux >= 5.14), which write-faults every page of a
// range without changing its contents. Ranges are taken in 2 MiB steps, in order; a step whose
// first and last pages are already resident (mincore) is skipped, so touched or locked memory
// costs two page-table probes per step. On kernels without MADV_POPULATE_WRITE the prefaulter
// disables itself (supported() == false) and reads simply fault as before.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dsio {

// Whether this kernel has MADV_POPULATE_WRITE (probed once on a scratch page).
bool populate_write_supported();

class Prefaulter {
 public:
  Prefaulter() = default;
  ~Prefaulter();
  Prefaulter(const Prefaulter&) = delete;
  Prefaulter& operator=(const Prefaulter&) = delete;

  // Queue [ptr, ptr+nbytes) for population; returns a token for cancel() (0: not queued,
  // because the range is empty, the prefaulter is stopped, or the kernel lacks
  // MADV_POPULATE_WRITE). The threads start on the first range.
  // hugepage: advise MADV_HUGEPAGE on the range's fresh 2 MiB steps before populating them.
  uint64_t add(uintptr_t ptr, uint64_t nbytes, bool hugepage = false);
  // Stop populating the range of `token` (its transfer finished or failed). Idempotent.
  void cancel(uint64_t token);
  // Joins the threads; pending ranges are dropped. Idempotent; add() returns 0 afterwards.
  void stop();

  std::atomic<uint64_t> ranges{0};           // ranges queued
  std::atomic<uint64_t> populated_bytes{0};  // bytes madvise(POPULATE_WRITE) ran over
  std::atomic<uint64_t> resident_bytes{0};   // bytes skipped because already resident
  std::atomic<uint64_t> cancelled_bytes{0};  // bytes left when their range was cancelled
  std::atomic<uint64_t> busy_ns{0};          // thread time spent populating (summed over threads)
  std::atomic<int> last_errno{0};
  // Before populating a whole 2 MiB step that is not resident, advise MADV_HUGEPAGE on it (THP
  // "madvise" mode): one huge-page fault instead of 512 small ones. Per range (add's hugepage:
  // dsio asks for it on direct reads) or for every range (this switch, the benchmarks' A/B).
  // With defrag=madvise the kernel may compact memory synchronously to find a huge page.
  std::atomic<bool> hugepage{false};
  std::atomic<uint64_t> hugepage_bytes{0};  // bytes advised MADV_HUGEPAGE

  // One queued range: the threads claim its 2 MiB steps through `pos`, in order, so every byte
  // is accounted exactly once (populated, resident or cancelled).
  struct RangeState {
    uint64_t token = 0;
    std::atomic<uintptr_t> pos{0};
    uintptr_t end = 0;
    std::atomic<bool> cancelled{false};
    bool hugepage = false;
  };

 private:
  // Up to this many threads share the head range: zeroing fresh pages is CPU work, and two
  // cores populate twice as fast as one while the disk works.
  static constexpr unsigned kMaxThreads = 2;
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<RangeState>> queue_;
  uint64_t next_token_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// Whether every page of [ptr, ptr+nbytes) probed at 2 MiB steps (first and last page of each)
// is resident: a cheap "already touched" test.
bool probably_resident(uintptr_t ptr, uint64_t nbytes);

}  // namespace dsio
