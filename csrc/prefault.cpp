#include "prefault.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace dsio {
namespace {

constexpr uint64_t kStep = 2ull << 20;

uintptr_t page_size() {
  static const uintptr_t p = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return p;
}

bool page_resident(uintptr_t addr) {
  unsigned char v = 0;
  uintptr_t p = addr & ~(page_size() - 1);
  if (mincore(reinterpret_cast<void*>(p), page_size(), &v) != 0) return false;
  return (v & 1) != 0;
}

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

bool populate_write_supported() {
  static const bool ok = [] {
    void* p = mmap(nullptr, page_size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    bool r = madvise(p, page_size(), MADV_POPULATE_WRITE) == 0;
    munmap(p, page_size());
    return r;
  }();
  return ok;
}

bool probably_resident(uintptr_t ptr, uint64_t nbytes) {
  if (nbytes == 0) return true;
  uintptr_t end = ptr + nbytes;
  for (uintptr_t a = ptr; a < end; a += kStep) {
    uintptr_t last = std::min(a + kStep, end) - 1;
    if (!page_resident(a) || !page_resident(last)) return false;
  }
  return true;
}

Prefaulter::~Prefaulter() { stop(); }

uint64_t Prefaulter::add(uintptr_t ptr, uint64_t nbytes, bool hugepage) {
  // Only whole pages inside the range: populating a partial page outside it is harmless, but
  // the range's edges may belong to memory the caller does not own.
  uintptr_t pg = page_size();
  uintptr_t start = (ptr + pg - 1) & ~(pg - 1);
  uintptr_t end = (ptr + nbytes) & ~(pg - 1);
  if (end <= start || !populate_write_supported()) return 0;
  auto st = std::make_shared<RangeState>();
  st->pos.store(start);
  st->end = end;
  st->hugepage = hugepage;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_) return 0;
    st->token = next_token_++;
    queue_.push_back(st);
    if (threads_.empty()) {
      unsigned n = std::max(1u, std::min(kMaxThreads, std::thread::hardware_concurrency()));
      for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
    }
  }
  ranges.fetch_add(1, std::memory_order_relaxed);
  cv_.notify_all();
  return st->token;
}

void Prefaulter::cancel(uint64_t token) {
  if (token == 0) return;
  std::lock_guard<std::mutex> g(mu_);
  for (auto& st : queue_) {
    if (st->token == token) st->cancelled.store(true);
  }
}

void Prefaulter::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
    for (auto& st : queue_) st->cancelled.store(true);
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
  std::lock_guard<std::mutex> g(mu_);
  queue_.clear();
}

// Claims the next 2 MiB step of `st` (steps end on 2 MiB boundaries); false when none is left.
static bool claim(Prefaulter::RangeState& st, uintptr_t& from, uintptr_t& to) {
  uintptr_t cur = st.pos.load();
  for (;;) {
    if (cur >= st.end) return false;
    uintptr_t next = std::min<uintptr_t>((cur + kStep) & ~(kStep - 1), st.end);
    if (st.pos.compare_exchange_weak(cur, next)) {
      from = cur;
      to = next;
      return true;
    }
  }
}

void Prefaulter::run() {
  for (;;) {
    std::shared_ptr<RangeState> st;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      // Ranges whose every step is claimed leave the queue; the threads share the head range.
      while (!queue_.empty() && queue_.front()->pos.load() >= queue_.front()->end) queue_.pop_front();
      if (queue_.empty()) continue;
      st = queue_.front();
    }
    if (st->cancelled.load(std::memory_order_relaxed)) {
      uintptr_t left = st->pos.exchange(st->end);  // whoever swaps first accounts the rest
      if (left < st->end) cancelled_bytes.fetch_add(st->end - left, std::memory_order_relaxed);
      continue;
    }
    uintptr_t from, to;
    if (!claim(*st, from, to)) continue;
    uint64_t len = to - from;
    if (page_resident(from) && page_resident(to - 1)) {
      resident_bytes.fetch_add(len, std::memory_order_relaxed);
      continue;
    }
    uint64_t t0 = now_ns();
    if ((st->hugepage || hugepage.load(std::memory_order_relaxed)) && (from & (kStep - 1)) == 0 && len == kStep &&
        madvise(reinterpret_cast<void*>(from), len, MADV_HUGEPAGE) == 0)
      hugepage_bytes.fetch_add(len, std::memory_order_relaxed);
    int rc;
    do rc = madvise(reinterpret_cast<void*>(from), len, MADV_POPULATE_WRITE);
    while (rc != 0 && (errno == EINTR || errno == EAGAIN));
    busy_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    if (rc != 0) {
      // EFAULT/ENOMEM/EINVAL (unmapped, read-only, special mapping): not ours to populate.
      last_errno.store(errno);
      uintptr_t left = st->pos.exchange(st->end);
      cancelled_bytes.fetch_add(len + (left < st->end ? st->end - left : 0), std::memory_order_relaxed);
      continue;
    }
    populated_bytes.fetch_add(len, std::memory_order_relaxed);
  }
}

}  // namespace dsio
