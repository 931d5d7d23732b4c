#include "engine.hpp"

#include "clock.hpp"
#include "crc32c.hpp"
#include "cuda.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace dsio {
namespace {

int bucket_for(uint64_t ns) {
  uint64_t us = ns / 1000;
  int b = 0;
  while (b < kHistBuckets - 1 && (uint64_t{1} << b) <= us) ++b;
  return b;
}

int size_bucket(uint64_t n) {
  int b = 0;
  while (b < kSizeBuckets - 1 && (uint64_t{4096} << b) < n) ++b;
  return b;
}

}  // namespace

Engine::Engine(const std::string& backend, uint64_t block_size, unsigned queue_depth, unsigned parallelism,
               bool single_submit, bool overlap_events)
    : backend_name_(backend),
      block_size_(block_size),
      queue_depth_(queue_depth),
      parallelism_(parallelism),
      single_submit_(single_submit),
      overlap_events_(overlap_events) {
  if (block_size == 0 || queue_depth == 0 || parallelism == 0)
    throw std::invalid_argument("block_size, queue_depth and parallelism must be positive");
  // Backends are created here, in the caller's thread, so a refusal surfaces as an exception.
  for (unsigned i = 0; i < parallelism; ++i) {
    auto w = std::make_unique<Worker>();
    w->id = i;
    if (backend == "io_uring")
      w->backend.reset(make_io_uring(queue_depth));
    else if (backend == "aio")
      w->backend.reset(make_aio(queue_depth));
    else if (backend == "posix")
      w->backend.reset(make_posix());
    else if (backend == "cufile")
      w->backend.reset(make_cufile());
    else
      throw std::invalid_argument("unknown backend: " + backend);
    w->slots.resize(queue_depth);
    for (unsigned s = 0; s < queue_depth; ++s) w->free.push_back(queue_depth - 1 - s);
    workers_.push_back(std::move(w));
  }
  copy_threads_.store(parallelism);
  efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  for (auto& w : workers_) {
    Worker* wp = w.get();
    wp->thread = std::thread([this, wp] { run(*wp); });
  }
}

Engine::~Engine() { close(); }

void Engine::close() {
  shutdown();
  if (efd_ >= 0) ::close(efd_);
  efd_ = -1;
}

void Engine::set_sums(Request* r, uintptr_t cuts, uint64_t ncuts, uintptr_t out) {
  if (cuts == 0 || ncuts < 2) return;
  if (out == 0) throw std::invalid_argument("sum_cuts needs sum_out");
  if (r->op != Op::Read) throw std::invalid_argument("checksums (sum_cuts) are for reads only");
  if (!crc32c_hw_supported()) return;  // the caller checksums every fragment left unmarked
  r->sum_cuts = reinterpret_cast<const uint64_t*>(cuts);
  r->sum_ncuts = ncuts;
  r->sum_out = reinterpret_cast<uint64_t*>(out);
}

void Engine::submit(int op, int fd, uintptr_t buf, uint64_t nbytes, int64_t offset, uint64_t tag,
                    uintptr_t copy_dst, uintptr_t copy_src, uintptr_t sum_cuts, uint64_t sum_ncuts,
                    uintptr_t sum_out) {
  if (op < 0 || op > 2) throw std::invalid_argument("op must be 0 (read), 1 (write) or 2 (fsync)");
  if (copy_dst != 0 && op != static_cast<int>(Op::Read))
    throw std::invalid_argument("copy_dst is for reads only");
  if (copy_src != 0 && op != static_cast<int>(Op::Write))
    throw std::invalid_argument("copy_src is for writes only");
  auto* r = new Request();
  r->tag = tag;
  r->op = static_cast<Op>(op);
  r->fd = fd;
  r->buf = reinterpret_cast<char*>(buf);
  r->nbytes = r->op == Op::Fsync ? 0 : nbytes;
  r->offset = offset;
  r->copy_dst = reinterpret_cast<char*>(copy_dst);
  r->copy_src = reinterpret_cast<char*>(copy_src);
  try {
    set_sums(r, sum_cuts, sum_ncuts, sum_out);
  } catch (...) {
    delete r;
    throw;
  }
  enqueue(r);
}

void Engine::submit_staged(int op, int fd, uintptr_t user, uint64_t nbytes, int64_t offset, uint64_t tag,
                           const std::vector<uintptr_t>& slots, uintptr_t sum_cuts, uint64_t sum_ncuts,
                           uintptr_t sum_out) {
  // Reads only: staged writes go one request per pool buffer (copy_src), measured faster.
  if (op != static_cast<int>(Op::Read)) throw std::invalid_argument("a staged (ring) transfer is a read (0)");
  if (slots.empty()) throw std::invalid_argument("a staged transfer needs at least one staging slot");
  if (user == 0 && nbytes != 0) throw std::invalid_argument("a staged transfer needs the caller's memory");
  auto* r = new Request();
  r->tag = tag;
  r->op = static_cast<Op>(op);
  r->fd = fd;
  r->buf = nullptr;
  r->nbytes = nbytes;
  r->offset = offset;
  r->copy_dst = reinterpret_cast<char*>(user);
  r->ring = true;
  r->stage_free.reserve(slots.size());
  for (auto it = slots.rbegin(); it != slots.rend(); ++it) r->stage_free.push_back(reinterpret_cast<char*>(*it));
  try {
    set_sums(r, sum_cuts, sum_ncuts, sum_out);
  } catch (...) {
    delete r;
    throw;
  }
  enqueue(r);
}

void Engine::enqueue(Request* r) {
  r->t_start_ns = now_ns();
  submitted_.fetch_add(1);
  {
    std::lock_guard<std::mutex> g(qmu_);
    if (stopping_) {
      submitted_.fetch_sub(1);
      delete r;
      throw std::runtime_error("engine is shut down");
    }
    queue_.push_back(r);
  }
  qcv_.notify_one();
}

bool Engine::carvable() const {
  if (queue_.empty()) return false;
  const Request* r = queue_.front();
  // A staged request with every slot in flight waits for one to come back (piece_done notifies),
  // unless it is over (failed or fully carved: carve() then just retires it).
  return !r->ring || !r->stage_free.empty() || r->cursor >= r->nbytes || r->err.load() != 0 ||
         r->short_io.load();
}

// Takes the next piece off the head request. Requests that already failed, or
// that are fully carved, leave the queue and drop their carving reference.
bool Engine::carve(Slot& s) {
  while (!queue_.empty()) {
    Request* r = queue_.front();
    bool failed = r->err.load(std::memory_order_relaxed) != 0 || r->short_io.load(std::memory_order_relaxed);
    if (r->op == Op::Fsync && !failed) {
      queue_.pop_front();
      s = Slot{r, nullptr, 0, r->offset};
      s.start = nullptr;
      s.full = 0;
      return true;  // the fsync piece inherits the carving reference
    }
    if (failed || r->cursor >= r->nbytes) {
      queue_.pop_front();
      if (r->outstanding.fetch_sub(1) == 1) finish(r);
      continue;
    }
    uint64_t len = std::min(block_size_, r->nbytes - r->cursor);
    char* mem;
    if (r->ring) {
      if (r->stage_free.empty()) return false;  // every slot in flight: wait for one
      mem = r->stage_free.back();
      r->stage_free.pop_back();
    } else {
      mem = r->buf + r->cursor;
    }
    s = Slot{r, mem, len, r->offset + static_cast<int64_t>(r->cursor)};
    s.start = s.buf;
    s.full = len;
    s.pos = r->cursor;
    r->cursor += len;
    r->outstanding.fetch_add(1);
    if (r->cursor >= r->nbytes) {
      queue_.pop_front();
      r->outstanding.fetch_sub(1);  // cannot reach zero: this piece is outstanding
    }
    return true;
  }
  return false;
}

void Engine::run(Worker& w) {
  Backend& be = *w.backend;
  unsigned inflight = 0;
  std::vector<Completion> done;
  std::vector<uint32_t> rejected;
  std::vector<uint32_t> resubmit;
  std::vector<uint32_t> taken;
  for (;;) {
    bool more = false;
    // 1. Take new pieces, sleeping only when nothing is in flight.
    {
      std::unique_lock<std::mutex> lk(qmu_);
      if (inflight == 0 && resubmit.empty()) {
        qcv_.wait(lk, [&] { return (stopping_ && queue_.empty()) || carvable(); });
        if (queue_.empty()) break;  // stopping and drained
      }
      bool may_take = overlap_events_ || inflight == 0;
      while (may_take && !w.free.empty() && inflight < queue_depth_) {
        uint32_t slot = w.free.back();
        if (!carve(w.slots[slot])) break;
        w.free.pop_back();
        taken.push_back(slot);
        ++inflight;
        pieces_.fetch_add(1, std::memory_order_relaxed);
      }
      more = carvable();
    }
    if (more) qcv_.notify_one();  // more work than this worker can hold: wake a sibling
    rejected.clear();
    auto flush = [&] {
      int rc = be.submit(single_submit_, rejected);
      for (uint32_t slot : rejected) done.push_back(Completion{slot, rc < 0 ? rc : -EIO});
      rejected.clear();
    };
    // Outside the queue lock: a staged write's piece is first copied into its staging buffer
    // (here, GIL-free, in parallel across workers), then every new piece is prepared. A copied
    // piece is submitted at once, so the disk starts on the first piece instead of waiting for
    // the copies of everything this worker just took (up to queue_depth pieces).
    for (uint32_t slot : taken) {
      Slot& s = w.slots[slot];
      Request* r = s.req;
      if (r->copy_src != nullptr && s.full != 0) {
        uint64_t t0 = now_ns();
        std::memcpy(s.start, r->copy_src + s.pos, s.full);
        copies_.fetch_add(1, std::memory_order_relaxed);
        copy_bytes_.fetch_add(s.full, std::memory_order_relaxed);
        copy_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      }
      s.t_submit_ns = now_ns();
      trace(kTraceSubmit, static_cast<int>(w.id), s.pos);
      be.prepare(slot, r->op, r->fd, s.buf, s.len, s.off);
      if (r->copy_src != nullptr && s.full != 0) flush();
    }
    taken.clear();
    for (uint32_t slot : resubmit) {
      const Slot& s = w.slots[slot];
      be.prepare(slot, s.req->op, s.req->fd, s.buf, s.len, s.off);
    }
    resubmit.clear();
    // 2. Submit.
    flush();
    // 3. Reap: one completion is enough with overlap, all of them in lock-step mode.
    if (inflight > done.size()) {
      unsigned need = overlap_events_ ? (done.empty() ? 1u : 0u) : inflight - static_cast<unsigned>(done.size());
      int r = be.reap(need, done);
      if (r < 0 && done.empty()) {
        // The backend itself failed: fail everything this worker holds.
        for (uint32_t s = 0; s < w.slots.size(); ++s) {
          bool is_free = false;
          for (uint32_t f : w.free) is_free |= (f == s);
          if (!is_free) done.push_back(Completion{s, r});
        }
      }
    } else {
      be.reap(0, done);
    }
    // 4. Account completions; short transfers continue where they stopped.
    for (const Completion& c : done) {
      Slot& s = w.slots[c.slot];
      if (c.result > 0 && static_cast<uint64_t>(c.result) < s.len && !s.req->err.load()) {
        s.buf += c.result;
        s.off += c.result;
        s.len -= static_cast<uint64_t>(c.result);
        s.req->done.fetch_add(static_cast<uint64_t>(c.result), std::memory_order_relaxed);
        resubmit.push_back(c.slot);
        continue;
      }
      stats[static_cast<int>(s.req->op)].piece_hist[bucket_for(now_ns() - s.t_submit_ns)].fetch_add(
          1, std::memory_order_relaxed);
      trace(kTraceComplete, static_cast<int>(w.id), s.pos);
      bool handed = s.req->copy_dst != nullptr || s.req->sum_cuts != nullptr;  // a copy or checksums
      if (handed && s.full != 0 && c.result >= 0 && static_cast<uint64_t>(c.result) == s.len) {
        if (copy_threads_.load(std::memory_order_relaxed) != 0) {
          defer_copy(s, c.result);  // read in full: the copier copies it out and completes it
        } else {
          copy_out(s, static_cast<int>(w.id));  // A/B baseline: the reaping worker copies
          piece_done(s.req, c.result, s);
        }
      } else {
        piece_done(s.req, c.result, s);
      }
      w.free.push_back(c.slot);
      --inflight;
    }
    done.clear();
  }
}

void Engine::piece_done(Request* r, int64_t res, const Slot& s) {
  if (res < 0) {
    int expected = 0;
    if (r->err.compare_exchange_strong(expected, static_cast<int>(-res))) r->err_offset.store(s.off);
  } else if (r->op != Op::Fsync && static_cast<uint64_t>(res) < s.len) {
    // Zero bytes: end of file on a read, or a write the kernel refused to extend.
    // Pieces end short in any order across workers: report the lowest offset where data stopped
    // (unless an errno already claimed err_offset).
    r->short_io.store(true);
    int64_t at = s.off + res;
    int64_t cur = r->err_offset.load();
    while (r->err.load() == 0 && (cur < 0 || at < cur) && !r->err_offset.compare_exchange_weak(cur, at)) {
    }
    r->done.fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
  } else {
    // (A staged read's piece reaches here from the copier, already copied out.)
    r->done.fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
  }
  if (r->ring) {
    // The piece is done with its staging slot (copied out, or written): hand it to the next piece.
    {
      std::lock_guard<std::mutex> g(qmu_);
      r->stage_free.push_back(s.start);
    }
    qcv_.notify_all();
  }
  if (r->outstanding.fetch_sub(1) == 1) finish(r);
}

void Engine::trace(int kind, int thread, uint64_t pos) {
  TraceEvent* buf = trace_buf_.load(std::memory_order_acquire);
  if (buf == nullptr) return;
  uint64_t i = trace_n_.fetch_add(1, std::memory_order_relaxed);
  if (i < trace_cap_.load(std::memory_order_relaxed)) buf[i] = TraceEvent{now_ns(), kind, thread, pos};
}

void Engine::trace_start(uint64_t capacity) {
  std::lock_guard<std::mutex> g(tmu_);
  trace_buf_.store(nullptr, std::memory_order_release);
  if (capacity == 0) return;
  trace_bufs_.emplace_back(new TraceEvent[capacity]);
  trace_n_.store(0);
  trace_cap_.store(capacity);
  trace_buf_.store(trace_bufs_.back().get(), std::memory_order_release);
}

std::vector<std::tuple<uint64_t, int, int, uint64_t>> Engine::trace_take() {
  std::lock_guard<std::mutex> g(tmu_);
  std::vector<std::tuple<uint64_t, int, int, uint64_t>> out;
  TraceEvent* buf = trace_buf_.exchange(nullptr, std::memory_order_acq_rel);
  if (buf == nullptr) return out;
  uint64_t n = std::min(trace_n_.load(), trace_cap_.load());
  out.reserve(n);
  for (uint64_t i = 0; i < n; ++i) out.emplace_back(buf[i].t_ns, buf[i].kind, buf[i].thread, buf[i].pos);
  return out;
}

void Engine::finish(Request* r) {
  int err = r->err.load();
  int idx = static_cast<int>(r->op);
  OpStats& st = stats[idx];
  uint64_t lat = now_ns() - r->t_start_ns;
  int64_t result;
  if (err != 0) {
    result = -err;
    st.errors.fetch_add(1, std::memory_order_relaxed);
  } else {
    result = static_cast<int64_t>(r->done.load());
    if (r->short_io.load()) {
      short_.fetch_add(1, std::memory_order_relaxed);
      st.errors.fetch_add(1, std::memory_order_relaxed);
    }
  }
  st.ops.fetch_add(1, std::memory_order_relaxed);
  st.bytes.fetch_add(r->done.load(), std::memory_order_relaxed);
  st.latency_ns.fetch_add(lat, std::memory_order_relaxed);
  st.hist[bucket_for(lat)].fetch_add(1, std::memory_order_relaxed);
  st.size_hist[size_bucket(r->nbytes)].fetch_add(1, std::memory_order_relaxed);
  if (err != 0) st.errno_counts[err < kErrnoSlots ? err : 0].fetch_add(1, std::memory_order_relaxed);
  bool was_empty;
  {
    std::lock_guard<std::mutex> g(cmu_);
    was_empty = completed_.empty();
    completed_.emplace_back(r->tag, result, err != 0 || r->short_io.load() ? r->err_offset.load() : -1);
  }
  delete r;
  finished_.fetch_add(1);
  if (was_empty) {
    uint64_t one = 1;
    ssize_t w;
    do w = ::write(efd_, &one, sizeof(one));
    while (w < 0 && errno == EINTR);
  }
}

namespace {
struct HostCallback {
  Engine* engine;
  uint64_t tag;
};
void host_callback(void* p) {
  auto* cb = static_cast<HostCallback*>(p);
  cb->engine->post_external(cb->tag);
  delete cb;
}
}  // namespace

int Engine::notify_stream(uintptr_t stream, uint64_t tag) {
  const CudaDriver& d = cuda_driver();
  if (!d.ok) return -ENOSYS;
  {
    std::lock_guard<std::mutex> g(xmu_);
    ++external_pending_;
  }
  auto* cb = new HostCallback{this, tag};
  int rc = d.cuLaunchHostFunc(reinterpret_cast<void*>(stream), host_callback, cb);
  if (rc != 0) {
    delete cb;
    std::lock_guard<std::mutex> g(xmu_);
    --external_pending_;
    return -rc;
  }
  return 0;
}

// Runs on a CUDA driver thread once the stream reaches the callback.
void Engine::post_external(uint64_t tag) {
  bool was_empty;
  {
    std::lock_guard<std::mutex> g(cmu_);
    was_empty = completed_.empty();
    completed_.emplace_back(tag, 0, -1);
  }
  if (was_empty) {
    uint64_t one = 1;
    ssize_t w;
    do w = ::write(efd_, &one, sizeof(one));
    while (w < 0 && errno == EINTR);
  }
  std::lock_guard<std::mutex> g(xmu_);
  if (--external_pending_ == 0) xcv_.notify_all();
}

std::vector<Result> Engine::reap() {
  uint64_t count;
  ssize_t r;
  do r = ::read(efd_, &count, sizeof(count));
  while (r < 0 && errno == EINTR);
  std::vector<Result> out;
  std::lock_guard<std::mutex> g(cmu_);
  out.swap(completed_);
  return out;
}

void Engine::shutdown() {
  {
    // Stream callbacks already queued must run before the eventfd goes away.
    std::unique_lock<std::mutex> lk(xmu_);
    xcv_.wait(lk, [&] { return external_pending_ == 0; });
  }
  {
    std::lock_guard<std::mutex> g(qmu_);
    if (joined_) return;
    stopping_ = true;
  }
  qcv_.notify_all();
  prefaulter.stop();
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
  {
    // Workers are gone and every piece is reaped; the copier finishes what it holds, then exits.
    std::lock_guard<std::mutex> g(kmu_);
    copier_stop_ = true;
  }
  kcv_.notify_all();
  for (auto& t : copiers_)
    if (t.joinable()) t.join();
  std::lock_guard<std::mutex> g(qmu_);
  joined_ = true;
  for (auto& w : workers_) {
    retired_submit_ += w->backend->submit_syscalls.load();
    retired_wait_ += w->backend->wait_syscalls.load();
  }
  workers_.clear();  // releases rings and AIO contexts
}

uint64_t Engine::submit_syscalls() const {
  std::lock_guard<std::mutex> g(qmu_);
  uint64_t n = retired_submit_;
  for (auto& w : workers_) n += w->backend->submit_syscalls;
  return n;
}
uint64_t Engine::wait_syscalls() const {
  std::lock_guard<std::mutex> g(qmu_);
  uint64_t n = retired_wait_;
  for (auto& w : workers_) n += w->backend->wait_syscalls;
  return n;
}

}  // namespace dsio
