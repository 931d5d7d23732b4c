// The copier: staged read pieces, staging slot -> caller memory, off the workers' loop.
//
// A worker that reaps a staged read piece read in full hands it to the copier threads
// (defer_copy) and goes straight back to reaping and submitting; a copier copies the piece out
// (copy_out: streaming stores or memcpy, timed and traced) and then completes it, which returns
// its staging slot to the next piece (piece_done). Copier threads start on first use, one per
// worker by default (set_copy_threads; 0 = the reaping worker copies, the A/B baseline).
#include "clock.hpp"
#include "copy.hpp"
#include "engine.hpp"

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
  trace(kTraceCopyStart, thread, s.pos);
  uint64_t t0 = now_ns();
  if (copy_streaming_.load(std::memory_order_relaxed))
    copy_stream(s.req->copy_dst + s.pos, s.start, s.full);
  else
    std::memcpy(s.req->copy_dst + s.pos, s.start, s.full);
  copies_.fetch_add(1, std::memory_order_relaxed);
  copy_bytes_.fetch_add(s.full, std::memory_order_relaxed);
  copy_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  trace(kTraceCopyEnd, thread, s.pos);
}

}  // namespace dsio
