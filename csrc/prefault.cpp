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

uint64_t Prefaulter::add(uintptr_t ptr, uint64_t nbytes) {
  // Only whole pages inside the range: populating a partial page outside it is harmless, but
  // the range's edges may belong to memory the caller does not own.
  uintptr_t pg = page_size();
  uintptr_t start = (ptr + pg - 1) & ~(pg - 1);
  uintptr_t end = (ptr + nbytes) & ~(pg - 1);
  if (end <= start || !populate_write_supported()) return 0;
  auto flag = std::make_shared<std::atomic<bool>>(false);
  uint64_t token;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_) return 0;
    token = next_token_++;
    queue_.push_back(Range{token, start, end, flag});
    live_.emplace_back(token, flag);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  ranges.fetch_add(1, std::memory_order_relaxed);
  cv_.notify_one();
  return token;
}

void Prefaulter::cancel(uint64_t token) {
  if (token == 0) return;
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = live_.begin(); it != live_.end(); ++it) {
    if (it->first == token) {
      it->second->store(true);
      live_.erase(it);
      return;
    }
  }
}

void Prefaulter::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    for (auto& l : live_) l.second->store(true);
    live_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Prefaulter::run() {
  for (;;) {
    Range r;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) {
        queue_.clear();
        return;
      }
      r = queue_.front();
      queue_.pop_front();
    }
    while (r.pos < r.end) {
      if (r.cancelled->load(std::memory_order_relaxed)) {
        cancelled_bytes.fetch_add(r.end - r.pos, std::memory_order_relaxed);
        break;
      }
      uintptr_t next = std::min<uintptr_t>((r.pos + kStep) & ~(kStep - 1), r.end);
      uint64_t len = next - r.pos;
      if (page_resident(r.pos) && page_resident(next - 1)) {
        resident_bytes.fetch_add(len, std::memory_order_relaxed);
      } else {
        uint64_t t0 = now_ns();
        int rc = madvise(reinterpret_cast<void*>(r.pos), len, MADV_POPULATE_WRITE);
        busy_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
        if (rc != 0) {
          int e = errno;
          last_errno.store(e);
          if (e != EINTR && e != EAGAIN) {
            cancelled_bytes.fetch_add(r.end - r.pos, std::memory_order_relaxed);
            break;  // EFAULT/ENOMEM (unmapped, read-only): not ours to populate
          }
          continue;
        }
        populated_bytes.fetch_add(len, std::memory_order_relaxed);
      }
      r.pos = next;
    }
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = live_.begin(); it != live_.end(); ++it) {
      if (it->first == r.token) {
        live_.erase(it);
        break;
      }
    }
  }
}

}  // namespace dsio
