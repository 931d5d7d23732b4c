// dsio._C: the private native module. Ints, pointers and fds in; counts and
// -errno out. Every call that can block releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/utsname.h>

#include <cstring>
#include <stdexcept>

#include "copy.hpp"
#include "crc32c.hpp"
#include "cuda.hpp"
#include "engine.hpp"
#include "memory.hpp"
#include "prefault.hpp"

namespace py = pybind11;
using namespace dsio;

namespace {

py::dict op_stats(const OpStats& s) {
  py::dict d;
  d["ops"] = s.ops.load();
  d["bytes"] = s.bytes.load();
  d["errors"] = s.errors.load();
  d["latency_ns"] = s.latency_ns.load();
  py::list h;
  for (const auto& b : s.hist) h.append(b.load());
  d["latency_hist"] = h;
  py::list ph;
  for (const auto& b : s.piece_hist) ph.append(b.load());
  d["piece_latency_hist"] = ph;
  py::list sizes;
  for (const auto& b : s.size_hist) sizes.append(b.load());
  d["size_hist"] = sizes;
  py::dict by_errno;
  for (int e = 0; e < kErrnoSlots; ++e) {
    uint64_t n = s.errno_counts[e].load();
    if (n) by_errno[py::int_(e)] = n;
  }
  d["errno_counts"] = by_errno;
  return d;
}

// One crc32c kernel called from Python: refused where this CPU lacks it, the GIL released for
// spans of 32 KiB and more (below, the hand-off costs more than the checksum).
uint32_t crc_kernel(uint32_t (*fn)(const uint8_t*, size_t, uint32_t), bool supported, const char* refusal,
                    uintptr_t ptr, size_t nbytes, uint32_t value) {
  if (!supported) throw std::runtime_error(refusal);
  const auto* p = reinterpret_cast<const uint8_t*>(ptr);
  if (nbytes < (size_t{1} << 15)) return fn(p, nbytes, value);
  py::gil_scoped_release nogil;
  return fn(p, nbytes, value);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dsio native core (private): io_uring / Linux AIO / posix engine and aligned memory";
  m.attr("HIST_BUCKETS") = kHistBuckets;

  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&, uint64_t, unsigned, unsigned, bool, bool>(), py::arg("backend"),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("parallelism"), py::arg("single_submit"),
           py::arg("overlap_events"))
      .def("submit", &Engine::submit, py::arg("op"), py::arg("fd"), py::arg("buf"), py::arg("nbytes"),
           py::arg("offset"), py::arg("tag"), py::arg("copy_dst") = 0,
           py::arg("copy_src") = 0, py::arg("sum_cuts") = 0, py::arg("sum_ncuts") = 0, py::arg("sum_out") = 0,
           "One request; reads may name checksum fragments (sum_cuts: uint64 file offsets, sum_out: one "
           "uint64 per fragment, (1 << 32) | crc32c once computed by the copier)")
      .def("submit_staged", &Engine::submit_staged, py::arg("op"), py::arg("fd"), py::arg("user"),
           py::arg("nbytes"), py::arg("offset"), py::arg("tag"), py::arg("slots"), py::arg("sum_cuts") = 0,
           py::arg("sum_ncuts") = 0, py::arg("sum_out") = 0,
           "A staged read/write as one request cycling through `slots` (staging buffers of >= block_size); "
           "checksum fragments as submit's")
      .def(
          "prefault",
          [](Engine& e, uintptr_t ptr, uint64_t nbytes, bool hugepage) {
            return e.prefaulter.add(ptr, nbytes, hugepage);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("hugepage") = false,
          "Populate [ptr, ptr+nbytes) on the prefault thread; a token for prefault_cancel (0: nothing queued)")
      .def(
          "prefault_cancel", [](Engine& e, uint64_t token) { e.prefaulter.cancel(token); }, py::arg("token"))
      .def("trace_start", &Engine::trace_start, py::arg("capacity"),
           "Record a per-piece timeline of up to `capacity` events (0: stop); read it with trace_take")
      .def("trace_take", &Engine::trace_take, py::call_guard<py::gil_scoped_release>(),
           "Stop tracing; the events as (t_ns, kind, thread, pos): kind 0 submit, 1 complete, 2 copy start, "
           "3 copy end; thread = worker index, 100 = the copier; pos = byte position in the request")
      .def_property("copy_threads", &Engine::copy_threads, &Engine::set_copy_threads,
                    "Copier threads that copy staged reads out (default: one per worker); 0: the reaping "
                    "worker copies each piece itself (the benchmarks' A/B baseline)")
      .def_property(
          "copy_streaming", [](const Engine& e) { return e.copy_streaming_.load(); },
          [](Engine& e, bool on) { e.copy_streaming_.store(on); },
          "Staged reads copy out with non-temporal stores (True) or memcpy (False): an A/B switch")
      .def_property(
          "prefault_hugepage", [](const Engine& e) { return e.prefaulter.hugepage.load(); },
          [](Engine& e, bool on) { e.prefaulter.hugepage.store(on); },
          "Prefaulting advises MADV_HUGEPAGE on fresh 2 MiB steps first (an A/B switch, default off)")
      .def("reap", &Engine::reap)
      .def("notify_stream", &Engine::notify_stream, py::arg("stream"), py::arg("tag"))
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("eventfd", &Engine::eventfd)
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("window_bytes", &Engine::window_bytes)
      .def("statistics", [](const Engine& e) {
        py::dict d;
        d["read"] = op_stats(e.stats[0]);
        d["write"] = op_stats(e.stats[1]);
        d["fsync"] = op_stats(e.stats[2]);
        d["submitted"] = e.submitted_.load();
        d["completed"] = e.finished_.load();
        d["pieces"] = e.pieces_.load();
        d["short"] = e.short_.load();
        py::dict cp;
        cp["pieces"] = e.copies_.load();
        cp["bytes"] = e.copy_bytes_.load();
        cp["busy_ns"] = e.copy_ns_.load();
        cp["backlog_max"] = e.copy_backlog_max_.load();
        cp["summed_bytes"] = e.summed_bytes_.load();
        cp["summed_fragments"] = e.summed_fragments_.load();
        d["copy"] = cp;
        d["submit_syscalls"] = e.submit_syscalls();
        d["wait_syscalls"] = e.wait_syscalls();
        const Prefaulter& p = e.prefaulter;
        py::dict pf;
        pf["ranges"] = p.ranges.load();
        pf["populated_bytes"] = p.populated_bytes.load();
        pf["resident_bytes"] = p.resident_bytes.load();
        pf["cancelled_bytes"] = p.cancelled_bytes.load();
        pf["busy_ns"] = p.busy_ns.load();
        pf["last_errno"] = p.last_errno.load();
        pf["hugepage_bytes"] = p.hugepage_bytes.load();
        d["prefault"] = pf;
        return d;
      });

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t, bool, bool>(), py::arg("nbytes"), py::arg("lock") = true,
           py::arg("hugepage") = false)
      .def_property_readonly("ptr", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &AlignedBuffer::size)
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def_property_readonly("lock_errno", &AlignedBuffer::lock_errno)
      .def_property_readonly("hugepage", &AlignedBuffer::hugepage,
                             "Whether the kernel accepted MADV_HUGEPAGE for the region (asked for, >= 2 MiB)")
      .def_buffer([](AlignedBuffer& b) -> py::buffer_info {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });

  m.def("memcpy", [](uintptr_t dst, uintptr_t src, size_t n) {
    py::gil_scoped_release nogil;
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  }, py::arg("dst"), py::arg("src"), py::arg("nbytes"));
  m.def("crc32c_avx512_supported", &crc32c_avx512_supported,
        "True if this CPU runs crc32c_avx512 (avx512f/bw/vl + vpclmulqdq + pclmul + sse4.2, OS-enabled)");
  m.def(
      "crc32c_avx512",
      [](uintptr_t ptr, size_t nbytes, uint32_t value) {
        static const bool supported = crc32c_avx512_supported();
        return crc_kernel(crc32c_avx512, supported, "crc32c_avx512: this CPU lacks AVX-512 + VPCLMULQDQ", ptr,
                          nbytes, value);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("value"),
      "crc32c of nbytes at ptr continuing value (the crc32c package's convention); GIL released for >= 32 KiB");
  m.def("crc32c_sse42_supported", &crc32c_sse42_supported, "True if this CPU has the SSE4.2 crc32 instruction");
  m.def(
      "crc32c_sse42",
      [](uintptr_t ptr, size_t nbytes, uint32_t value) {
        static const bool supported = crc32c_sse42_supported();
        return crc_kernel(crc32c_sse42, supported, "crc32c_sse42: this CPU lacks SSE4.2", ptr, nbytes, value);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("value"),
      "crc32c of nbytes at ptr continuing value, three interleaved crc32 instruction streams");
  m.def(
      "copy_crc32c",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, uint32_t value) {
        static const bool supported = crc32c_hw_supported();
        if (!supported) throw std::runtime_error("copy_crc32c: this CPU has no crc32c instruction");
        py::gil_scoped_release nogil;
        return copy_crc32c(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), nbytes, value);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("value"),
      "Copy nbytes from src to dst (streaming stores) and return their crc32c continuing value, in one pass "
      "(64 KiB steps: each checksummed, then copied from the cache); GIL released");
  m.def("crc32c_hw_supported", &crc32c_hw_supported,
        "True if the engine's copier can checksum reads here (AVX-512 folds or the SSE4.2 instruction)");
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
        "crc32c(A + B) from crc32c(A), crc32c(B) and len(B)");
  m.def("populate_write_supported", &populate_write_supported,
        "True if the kernel has madvise(MADV_POPULATE_WRITE) (Linux >= 5.14): prefaulting works");
  m.def("probably_resident", &probably_resident, py::arg("ptr"), py::arg("nbytes"),
        "True if [ptr, ptr+nbytes) looks populated (first and last page of every 2 MiB step resident)");
  m.def("probe_io_uring", &probe_io_uring, "0 if io_uring works here, else -errno");
  m.def("probe_aio", &probe_aio, "0 if Linux AIO works here, else -errno");
  m.def("cuda_driver_status", [] {
    const CudaDriver& d = cuda_driver();
    return py::make_tuple(d.ok, d.error);
  });
  m.def("cufile_status", [] {
    const CuFileLib& c = cufile();
    return py::make_tuple(c.ok, c.error, nvidia_fs_loaded());
  });
  m.def("cufile_register", &cufile_register, py::arg("fd"));
  m.def("cufile_deregister", &cufile_deregister, py::arg("fd"));
  m.def("cufile_buf_register", &cufile_buf_register, py::arg("ptr"), py::arg("nbytes"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cufile_buf_deregister", &cufile_buf_deregister, py::arg("ptr"), py::call_guard<py::gil_scoped_release>());
  m.def("kernel_release", [] {
    utsname u;
    uname(&u);
    return std::string(u.release);
  });
}
