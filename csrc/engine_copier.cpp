// The copier: staged read pieces, staging slot -> caller memory, off the workers' loop.
//
// A worker that reaps a staged read piece read in full hands it to the copier threads
// (defer_copy) and goes straight back to reaping and submitting; a copier copies the piece out
// (copy_out: streaming stores or memcpy, timed and traced) and then completes it, which returns
// its staging slot to the next piece (piece_done). Copier threads start on first use, one per
// worker by default (set_copy_threads; 0 = the reaping worker copies, the A/B baseline).
#include "clock.hpp"
#include "copy.hpp"
#include "crc32c.hpp"
#include "engine.hpp"

#include <algorithm>
#include <cstring>

namespace dsio {

void Engine::defer_copy(const Slot& s, int64_t res) {
  size_t backlog;
  {
    std::lock_guard<std::mutex> g(kmu_);
    if (copiers_.size() < copy_threads_.load() && !copier_stop_) {
      unsigned idx = static_cast<unsigned>(copiers_.size());
      copiers_.emplace_back([this, idx] { run_copier(idx); });
    }
    copyq_.push_back(CopyJob{s, res});
    backlog = copyq_.size();
  }
  // All, not one: a parked copier (index >= copy_threads) would swallow a lone notification.
  kcv_.notify_all();
  uint64_t seen = copy_backlog_max_.load(std::memory_order_relaxed);
  while (backlog > seen && !copy_backlog_max_.compare_exchange_weak(seen, backlog)) {
  }
}

// The copier thread: copies each staged read piece from its staging buffer to the caller's
// memory (GIL-free), then completes the piece (returning a ring slot to the next piece). The
// workers never wait for it: they keep every free slot in flight while it copies.
void Engine::run_copier(unsigned idx) {
  for (;;) {
    CopyJob j;
    {
      std::unique_lock<std::mutex> lk(kmu_);
      // Copier idx works while idx < copy_threads (copier 0 always drains what was queued).
      kcv_.wait(lk, [&] { return copier_stop_ || (!copyq_.empty() && (idx == 0 || idx < copy_threads_.load())); });
      if (copyq_.empty()) return;  // stopping and drained
      j = copyq_.front();
      copyq_.pop_front();
    }
    // Every piece read in full is copied, even when another piece of its request failed: the
    // caller gets the bytes that did arrive (a short read's prefix), as before the copier.
    copy_out(j.slot, kCopierThread);
    piece_done(j.slot.req, j.res, j.slot);
  }
}

void Engine::set_copy_threads(unsigned n) {
  {
    std::lock_guard<std::mutex> g(kmu_);
    copy_threads_.store(n);
  }
  kcv_.notify_all();
}

void Engine::copy_out(const Slot& s, int thread) {
  const Request& r = *s.req;
  char* dst = r.copy_dst != nullptr ? r.copy_dst + s.pos : nullptr;
  trace(kTraceCopyStart, thread, s.pos);
  uint64_t t0 = now_ns();
  if (r.sum_cuts != nullptr) {
    sum_piece(r, s.start, dst, static_cast<uint64_t>(r.offset) + s.pos, s.full);
  } else if (copy_streaming_.load(std::memory_order_relaxed)) {
    copy_stream(dst, s.start, s.full);
  } else {
    std::memcpy(dst, s.start, s.full);
  }
  if (dst != nullptr) {
    copies_.fetch_add(1, std::memory_order_relaxed);
    copy_bytes_.fetch_add(s.full, std::memory_order_relaxed);
  }
  copy_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  trace(kTraceCopyEnd, thread, s.pos);
}

// One piece (file bytes [off, off + n) at src) checksummed fragment by fragment and, with dst,
// copied out; a fragment only partly inside the piece is copied but not checksummed.
void Engine::sum_piece(const Request& r, const char* src, char* dst, uint64_t off, uint64_t n) {
  const uint64_t* cuts = r.sum_cuts;
  const uint64_t m = r.sum_ncuts;
  const bool streaming = copy_streaming_.load(std::memory_order_relaxed);
  auto copy = [&](uint64_t at, uint64_t len) {
    if (dst == nullptr || len == 0) return;
    if (streaming)
      copy_stream(dst + at, src + at, len);
    else
      std::memcpy(dst + at, src + at, len);
  };
  // A whole fragment: checksummed and copied in one pass (copy_crc32c's steps).
  const uint64_t end = off + n;
  uint64_t j = static_cast<uint64_t>(std::upper_bound(cuts, cuts + m, off) - cuts);  // cuts[j] > off
  uint64_t p = off;
  uint64_t bytes = 0, frags = 0;
  while (p < end) {
    uint64_t q = j < m ? std::min(end, cuts[j]) : end;
    if (j > 0 && j < m && cuts[j - 1] == p && cuts[j] <= end) {  // fragment j - 1, whole, here
      uint32_t crc = copy_crc32c(dst == nullptr ? nullptr : dst + (p - off), src + (p - off), q - p, 0, streaming);
      r.sum_out[j - 1] = (uint64_t{1} << 32) | crc;
      bytes += q - p;
      ++frags;
    } else {
      copy(p - off, q - p);
    }
    p = q;
    if (j < m && q == cuts[j]) ++j;
  }
  summed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  summed_fragments_.fetch_add(frags, std::memory_order_relaxed);
}

}  // namespace dsio
