// The I/O engine: requests in, completions out through one eventfd.
//
// A request (op, fd, buffer, nbytes, offset, tag) is carved into block_size
// pieces on demand by intra_op_parallelism worker threads. Each worker owns one
// Backend (an io_uring ring, an AIO context, or plain syscalls) and keeps up to
// queue_depth pieces in flight. When the last piece of a request completes the
// worker appends (tag, result, error_offset) to the completed list and writes
// the eventfd; the event loop's reader calls reap().
//
// single_submit:  true  -> one submit syscall per piece (io_uring_enter or io_submit of 1);
//                 false -> every piece a worker has ready goes in one syscall.
// overlap_events: true  -> sliding window: as soon as any piece completes, the
//                          worker refills its queue (submission overlaps completion);
//                 false -> lock-step batches: submit up to queue_depth pieces,
//                          wait for all of them, then submit the next batch
//                          (DeepSpeed's non-overlapped mode).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backend.hpp"
#include "prefault.hpp"

namespace dsio {

constexpr int kHistBuckets = 32;  // bucket i: latency < 2^i microseconds (last: everything above)
constexpr int kSizeBuckets = 24;  // bucket i: request bytes <= 4096 << i (last: everything above)
constexpr int kErrnoSlots = 134;  // errno counts by value; slot 0 collects errno >= 134

struct OpStats {
  std::atomic<uint64_t> ops{0}, bytes{0}, errors{0}, latency_ns{0};
  std::array<std::atomic<uint64_t>, kHistBuckets> hist{};
  // Per piece: submission to completion of each block_size piece in the kernel (same buckets as
  // hist), i.e. the latency the device gives one piece at the queue depth the engine keeps.
  std::array<std::atomic<uint64_t>, kHistBuckets> piece_hist{};
  std::array<std::atomic<uint64_t>, kSizeBuckets> size_hist{};
  std::array<std::atomic<uint64_t>, kErrnoSlots> errno_counts{};
};

struct Request {
  uint64_t tag;
  Op op;
  int fd;
  char* buf;
  uint64_t nbytes;
  int64_t offset;
  // Reads only: once a piece has been read in full into buf, the copier thread copies it to the
  // same position under copy_dst (GIL-free, before the request can complete). 0: no copy.
  char* copy_dst = nullptr;
  // Writes only: each piece is copied from the same position under copy_src into buf by the
  // worker that carved it, just before it is submitted. 0: no copy.
  char* copy_src = nullptr;
  // Staging ring (submit_staged): buf is unused; each piece takes a free staging slot of
  // block_size bytes from here (guarded by the queue mutex), is read into it and copied out to
  // copy_dst (reads), or copied in from copy_src and written from it (writes); the slot comes back
  // when the piece is done, so one request streams any size through a few slots with no round
  // trip to the caller per slot.
  std::vector<char*> stage_free;
  bool ring = false;
  // Reads only, optional: checksums computed as the bytes arrive (see Engine::submit). sum_cuts
  // holds sum_ncuts sorted file offsets; fragment j is [sum_cuts[j], sum_cuts[j + 1]). The copier
  // writes (1 << 32) | crc32c into sum_out[j] for each fragment lying wholly inside one piece read
  // in full, right before (or while) it copies that piece out; other fragments are left as they are.
  const uint64_t* sum_cuts = nullptr;
  uint64_t sum_ncuts = 0;
  uint64_t* sum_out = nullptr;
  uint64_t cursor = 0;                 // next byte to carve (guarded by the queue mutex)
  std::atomic<int64_t> outstanding{1};  // carved pieces not yet done, +1 until fully carved
  std::atomic<uint64_t> done{0};
  std::atomic<int> err{0};              // first errno, 0 if none
  std::atomic<bool> short_io{false};
  std::atomic<int64_t> err_offset{-1};
  uint64_t t_start_ns;
};

using Result = std::tuple<uint64_t, int64_t, int64_t>;  // tag, bytes or -errno, failing file offset

class Engine {
 public:
  Engine(const std::string& backend, uint64_t block_size, unsigned queue_depth, unsigned parallelism,
         bool single_submit, bool overlap_events);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // copy_dst (reads only, 0 = none): each piece read in full into buf is memcpy'd to the same
  // position under copy_dst by the engine's copier thread (the reaping worker hands it over and
  // goes on submitting), before the request completes. A piece
  // that failed or came back short is never copied. copy_src (writes only, 0 = none): each piece
  // is copied from the same position under copy_src into buf by its worker just before submission.
  //
  // sum_cuts / sum_ncuts / sum_out (reads only, 0 = none; both calls): the copier checksums (crc32c,
  // the fastest kernel the CPU has) each fragment [sum_cuts[j], sum_cuts[j + 1]) of file offsets that
  // lies wholly inside one piece read in full, while the piece is in its cache: fused with the copy
  // out of a staged piece (crc32c of a step, then the step copied), or on its own for a piece read
  // straight into the caller's memory (the piece then goes to the copier too). Its result goes to
  // sum_out[j] as (1 << 32) | crc. A fragment straddling pieces, or in a piece that failed, is left
  // untouched: the caller checksums what is not marked. The caller keeps both arrays alive until
  // the request completes. Ignored where the CPU has no crc32c instruction (crc32c_hw_supported).
  void submit(int op, int fd, uintptr_t buf, uint64_t nbytes, int64_t offset, uint64_t tag,
              uintptr_t copy_dst = 0, uintptr_t copy_src = 0, uintptr_t sum_cuts = 0, uint64_t sum_ncuts = 0,
              uintptr_t sum_out = 0);
  // A staged read as one request: ``user`` is the caller's memory (the destination),
  // ``slots`` staging buffers of at least block_size bytes each (aligned
  // for O_DIRECT), cycled by the workers piece by piece (see Request::stage_free). The caller keeps
  // user memory and slots alive until the request completes.
  void submit_staged(int op, int fd, uintptr_t user, uint64_t nbytes, int64_t offset, uint64_t tag,
                     const std::vector<uintptr_t>& slots, uintptr_t sum_cuts = 0, uint64_t sum_ncuts = 0,
                     uintptr_t sum_out = 0);
  std::vector<Result> reap();
  // Completes `tag` (result 0) through the eventfd once `stream` (a CUstream) reaches this point.
  // 0, -ENOSYS without a CUDA driver, or -CUresult.
  int notify_stream(uintptr_t stream, uint64_t tag);
  void post_external(uint64_t tag);
  // Lets every queued and in-flight request finish, then joins the workers. Idempotent.
  void shutdown();
  // shutdown() and close the eventfd (after the caller removed it from its event loop).
  void close();
  int eventfd() const { return efd_; }
  const std::string& backend() const { return backend_name_; }
  // Bytes the workers put in flight at once (block_size x queue_depth x workers): the part of a
  // direct read whose destination the submitting workers fault in themselves, before any I/O.
  uint64_t window_bytes() const { return block_size_ * queue_depth_ * parallelism_; }
  uint64_t block_size() const { return block_size_; }

  OpStats stats[3];
  // Populates read destinations ahead of the I/O (Python queues ranges; see prefault.hpp).
  Prefaulter prefaulter;
  std::atomic<uint64_t> submitted_{0}, finished_{0}, pieces_{0}, short_{0};
  // Staging copies done by the workers (see submit's copy_dst / copy_src): pieces, bytes, time spent.
  std::atomic<uint64_t> copies_{0}, copy_bytes_{0}, copy_ns_{0};
  // Bytes the copier checksummed for sum_out (fragments marked), and the fragments.
  std::atomic<uint64_t> summed_bytes_{0}, summed_fragments_{0};
  // Most pieces ever waiting for the copier at once (read back-pressure on the staging ring).
  std::atomic<uint64_t> copy_backlog_max_{0};
  // Per-piece timeline for diagnosis (bench/experiments/io_read_diag.py --timeline): off unless trace_start.
  void trace_start(uint64_t capacity);
  // How many copier threads copy staged read pieces out (started on first use; default: one per
  // worker). 0 is the benchmarks' A/B baseline: the reaping worker copies each piece itself (the
  // pre-copier behaviour: no submission or reaping while it copies). Raising it later starts more.
  void set_copy_threads(unsigned n);
  // Staged read copies write the caller's memory with streaming (non-temporal) stores (true) or
  // with memcpy (false): see copy.hpp. An A/B switch for the benchmarks.
  std::atomic<bool> copy_streaming_{true};
  unsigned copy_threads() const { return copy_threads_.load(); }
  // The recorded events (t_ns, kind, thread, byte position in its request), and tracing stops.
  // Call when no transfer is in flight (the buffer is kept until close, so a late writer is safe).
  std::vector<std::tuple<uint64_t, int, int, uint64_t>> trace_take();
  uint64_t submit_syscalls() const;
  uint64_t wait_syscalls() const;

 private:
  struct Slot {
    Request* req;
    char* buf;
    uint64_t len;
    int64_t off;
    uint64_t t_submit_ns = 0;
    char* start = nullptr;  // where the piece began in memory (buf moves on short transfers)
    uint64_t full = 0;      // the piece's whole length
    uint64_t pos = 0;       // the piece's byte position within its request
  };
  struct Worker {
    unsigned id = 0;
    std::unique_ptr<Backend> backend;
    std::thread thread;
    std::vector<Slot> slots;
    std::vector<uint32_t> free;
  };
  void run(Worker& w);
  bool carve(Slot& s);  // queue mutex held
  bool carvable() const;  // queue mutex held: a piece could be carved now
  void enqueue(Request* r);
  void piece_done(Request* r, int64_t res, const Slot& s);
  void finish(Request* r);
  // A read piece read in full into a staging buffer goes to the copier: the worker hands it over
  // and goes straight back to reaping and submitting, so the disk never waits for a copy.
  struct CopyJob {
    Slot slot;
    int64_t res;
  };
  void defer_copy(const Slot& s, int64_t res);
  void copy_out(const Slot& s, int thread);  // staging -> copy_dst for one piece, timed and traced
  void sum_piece(const Request& r, const char* src, char* dst, uint64_t off, uint64_t n);
  void set_sums(Request* r, uintptr_t cuts, uint64_t ncuts, uintptr_t out);
  void run_copier(unsigned idx);
  void trace(int kind, int thread, uint64_t pos);

  std::string backend_name_;
  uint64_t block_size_;
  unsigned queue_depth_;
  unsigned parallelism_;
  bool single_submit_, overlap_events_;
  int efd_ = -1;

  mutable std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<Request*> queue_;
  bool stopping_ = false;
  bool joined_ = false;
  uint64_t retired_submit_ = 0, retired_wait_ = 0;

  std::mutex xmu_;
  std::condition_variable xcv_;
  uint64_t external_pending_ = 0;

  std::mutex cmu_;
  std::vector<Result> completed_;

  std::vector<std::unique_ptr<Worker>> workers_;

  // The copier: staging -> caller copies of reads, off the workers' submit/reap loop.
  std::mutex kmu_;
  std::condition_variable kcv_;
  std::deque<CopyJob> copyq_;
  bool copier_stop_ = false;
  std::vector<std::thread> copiers_;
  std::atomic<unsigned> copy_threads_{1};

  struct TraceEvent {
    uint64_t t_ns;
    int kind;
    int thread;
    uint64_t pos;
  };
  std::atomic<TraceEvent*> trace_buf_{nullptr};
  std::atomic<uint64_t> trace_cap_{0}, trace_n_{0};
  std::vector<std::unique_ptr<TraceEvent[]>> trace_bufs_;  // kept until close (see trace_take)
  std::mutex tmu_;
};

// Timeline event kinds (trace_take) and the copier's thread id in them (workers are 0..n-1).
enum TraceKind : int { kTraceSubmit = 0, kTraceComplete = 1, kTraceCopyStart = 2, kTraceCopyEnd = 3 };
constexpr int kCopierThread = 100;

}  // namespace dsio
