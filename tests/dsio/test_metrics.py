"""dsio.metrics: the Prometheus collector reads statistics() snapshots of weakly tracked objects."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass

import pytest
import torch
from _dsio_helpers import aligned_tensor, run_loop
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import dsio
from dsio import _registry as registry_mod
from dsio import metrics


def _registry() -> tuple[registry_mod.Registry, CollectorRegistry]:
    """A private tracking registry and a prometheus registry holding only its collector."""
    reg = registry_mod.Registry()
    prom = CollectorRegistry()
    prom.register(metrics.DsioCollector(reg))
    return reg, prom


def _val(prom: CollectorRegistry, name: str, **labels: str) -> float:
    v = prom.get_sample_value(name, labels)
    assert v is not None, f"{name}{labels} not exported"
    return v


async def _io(h: dsio.AsyncIOHandle, d: str, n: int = 5, nbytes: int = 65536) -> None:
    t = aligned_tensor(nbytes)
    path = os.path.join(d, "m.bin")
    for _ in range(n):
        await h.pwrite(t, path)
    for _ in range(n):
        await h.pread(t, path)


def test_counters_match_statistics(backend, data_dir):
    reg, prom = _registry()

    async def main():
        async with dsio.AsyncIOHandle(backend=backend) as h:
            reg.add(h, "handle")
            await _io(h, data_dir, n=7)
            st = h.statistics()
            be = st.engine.backend
            for op in ("read", "write"):
                o = getattr(st.engine, op)
                assert _val(prom, "dsio_requests_total", op=op, backend=be) == o.ops == 7
                assert _val(prom, "dsio_bytes_total", op=op, backend=be) == o.bytes == 7 * 65536
                assert _val(prom, "dsio_calls_total", op=op, backend=be) == 7
                # Histogram: cumulative buckets, +Inf bucket == _count == ops, _sum == latency total.
                count = _val(prom, "dsio_request_latency_seconds_count", op=op, backend=be)
                inf = _val(prom, "dsio_request_latency_seconds_bucket", op=op, backend=be, le="+Inf")
                assert count == inf == o.ops
                assert _val(prom, "dsio_request_latency_seconds_sum", op=op, backend=be) == pytest.approx(
                    o.latency_seconds_total
                )
                assert _val(prom, "dsio_request_size_bytes_sum", op=op, backend=be) == o.bytes
            assert _val(prom, "dsio_transfer_bytes_total", route="direct") == st.direct_bytes > 0
            assert _val(prom, "dsio_tracked_objects", kind="handle") == 1
            assert _val(prom, "dsio_pool_buffers") == st.pool.buffers
            assert _val(prom, "dsio_requests_in_flight", backend=be) == 0

    run_loop("asyncio", main())


def test_latency_histogram_is_cumulative_and_matches_engine_buckets(data_dir):
    reg, prom = _registry()

    async def main():
        async with dsio.AsyncIOHandle() as h:
            reg.add(h, "handle")
            await _io(h, data_dir, n=20, nbytes=4096)
            st = h.statistics()
            fams = {f.name: f for f in text_string_to_metric_families(_text(prom))}
            fam = fams["dsio_request_latency_seconds"]
            buckets = [
                (float(s.labels["le"]), s.value)
                for s in fam.samples
                if s.name.endswith("_bucket") and s.labels["op"] == "write"
            ]
            bounds = [b for b, _ in buckets]
            assert bounds == sorted(bounds) and bounds[-1] == float("inf")
            assert bounds == list(dsio.LATENCY_BUCKET_BOUNDS_S)
            values = [v for _, v in buckets]
            assert values == sorted(values)  # cumulative
            expected, acc = [], 0
            for n in st.engine.write.latency_buckets:
                acc += n
                expected.append(acc)
            assert values == expected

    run_loop("asyncio", main())


def _text(prom: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(prom).decode()


def test_errors_are_counted_by_op(data_dir):
    reg, prom = _registry()

    async def main():
        async with dsio.AsyncIOHandle() as h:
            reg.add(h, "handle")
            path = os.path.join(data_dir, "e.bin")
            t = aligned_tensor(8192)
            await h.pwrite(t, path)
            async with h.open(path, "w") as f:  # write-only fd: a read fails with EBADF
                for _ in range(3):
                    with pytest.raises(dsio.IOFailedError):
                        await f.pread(t)
            be = h.backend
            st = h.statistics()
            errs = sum(
                s.value
                for fam in text_string_to_metric_families(_text(prom))
                if fam.name == "dsio_request_errors"
                for s in fam.samples
                if s.labels.get("op") == "read" and s.name.endswith("_total")
            )
            assert errs == st.engine.read.errors >= 3
            assert _val(prom, "dsio_call_errors_total", backend=be) == 3
            assert _val(prom, "dsio_request_errors_total", op="write", backend=be, errno="unreported") == 0

    run_loop("asyncio", main())


def test_tracking_is_weak_and_totals_stay_monotonic(data_dir):
    reg, prom = _registry()

    async def main():
        h = dsio.AsyncIOHandle()
        reg.add(h, "handle")
        reg.add(h, "handle")  # idempotent
        assert reg.count() == {"handle": 1}
        await _io(h, data_dir, n=4)
        be = h.backend
        before = _val(prom, "dsio_requests_total", op="write", backend=be)  # scrape: last snapshot kept
        assert before == 4
        await h.aclose()
        ref = weakref.ref(h)
        del h
        gc.collect()
        assert ref() is None, "tracking must not keep a handle alive"
        assert reg.count() == {}
        assert _val(prom, "dsio_requests_total", op="write", backend=be) == 4  # retired, not reset
        assert _val(prom, "dsio_tracked_objects", kind="handle") == 0
        # A second handle adds on top of the retired totals.
        async with dsio.AsyncIOHandle() as h2:
            reg.add(h2, "handle")
            await _io(h2, data_dir, n=2)
            assert _val(prom, "dsio_requests_total", op="write", backend=be) == 6
            reg.remove(h2)  # untrack folds the final snapshot in
            await _io(h2, data_dir, n=1)
        assert _val(prom, "dsio_requests_total", op="write", backend=be) == 6

    run_loop("asyncio", main())


def test_untrack_without_scrape_keeps_everything(data_dir):
    reg, prom = _registry()

    async def main():
        async with dsio.AsyncIOHandle() as h:
            reg.add(h, "handle")
            await _io(h, data_dir, n=3)
            reg.remove(h)
            reg.remove(h)  # idempotent
            be = h.backend
        assert _val(prom, "dsio_requests_total", op="read", backend=be) == 3

    run_loop("asyncio", main())


def test_pool_gauges_follow_buffers_and_waiters():
    reg, prom = _registry()

    async def main():
        with dsio.PinnedPool(4 * 4096, 4096) as pool:
            reg.add(pool, "pool")
            leases = [await pool.acquire() for _ in range(4)]
            waiter = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0)
            assert _val(prom, "dsio_pool_buffers") == 4
            assert _val(prom, "dsio_pool_buffers_in_use") == 4
            assert _val(prom, "dsio_pool_waiters") == 1
            assert _val(prom, "dsio_pool_bytes") == 4 * 4096
            leases.pop().release()
            leases.append(await waiter)
            assert _val(prom, "dsio_pool_waiters") == 0
            assert _val(prom, "dsio_pool_waits_total") == 1
            assert _val(prom, "dsio_pool_acquisitions_total") == 5
            assert _val(prom, "dsio_pool_wait_seconds_total") > 0
            for lease in leases:
                lease.release()
            assert _val(prom, "dsio_pool_buffers_in_use") == 0

    run_loop("asyncio", main())


@dataclass(frozen=True, slots=True)
class _CkptStats:
    saves: int
    loads: int
    in_flight: bool
    last_step: int | None
    last_write_seconds: float
    staging_buffer_bytes: int
    blocked_seconds_total: float
    bytes_written_total: int


class Checkpointer:  # the name decides the kind: "checkpoint"
    def __init__(self) -> None:
        self.stats = _CkptStats(2, 1, True, None, 0.75, 8192, 0.125, 4096)

    def statistics(self) -> _CkptStats:
        return self.stats


def test_checkpointer_is_exported_generically():
    reg, prom = _registry()
    ck = Checkpointer()
    reg.add(ck, registry_mod._kind_of(ck))
    assert _val(prom, "dsio_checkpoint_saves_total") == 2
    assert _val(prom, "dsio_checkpoint_loads_total") == 1
    assert _val(prom, "dsio_checkpoint_blocked_seconds_total") == 0.125
    assert _val(prom, "dsio_checkpoint_bytes_written_total") == 4096
    assert _val(prom, "dsio_checkpoint_in_flight") == 1  # levels are gauges
    assert _val(prom, "dsio_checkpoint_last_write_seconds") == 0.75
    assert _val(prom, "dsio_checkpoint_staging_buffer_bytes") == 8192
    assert prom.get_sample_value("dsio_checkpoint_last_step") is None  # None is not a number
    ck2 = Checkpointer()
    reg.add(ck2, "checkpoint")
    assert _val(prom, "dsio_checkpoint_saves_total") == 4  # totals add up
    assert _val(prom, "dsio_checkpoint_last_write_seconds") == 0.75  # last_*: max, not sum
    del ck, ck2
    gc.collect()
    # Running totals survive the objects; levels go away with them.
    assert _val(prom, "dsio_checkpoint_saves_total") == 4
    assert prom.get_sample_value("dsio_checkpoint_in_flight") is None


def test_real_checkpointer_statistics_are_exported(data_dir):
    checkpoint = pytest.importorskip("dsio.checkpoint")
    reg, prom = _registry()

    async def main():
        async with checkpoint.Checkpointer(os.path.join(data_dir, "run")) as ck:
            reg.add(ck, registry_mod._kind_of(ck))
            state = {"w": torch.arange(100_000, dtype=torch.float32)}
            for step in (1, 2):
                task = await ck.save(step, state)
                await task
            await ck.load()
            st = ck.statistics()
            assert _val(prom, "dsio_checkpoint_saves_total") == st.saves == 2
            assert _val(prom, "dsio_checkpoint_loads_total") == st.loads == 1
            assert _val(prom, "dsio_checkpoint_bytes_written_total") == st.bytes_written_total > 400_000
            assert _val(prom, "dsio_checkpoint_blocked_seconds_total") == st.blocked_seconds_total > 0
            assert _val(prom, "dsio_checkpoint_staging_seconds_total") == st.staging_seconds_total
            assert _val(prom, "dsio_checkpoint_write_seconds_total") == st.write_seconds_total > 0
            assert _val(prom, "dsio_checkpoint_load_seconds_total") == st.load_seconds_total > 0
            assert _val(prom, "dsio_checkpoint_last_blocked_seconds") == st.last_blocked_seconds
            assert _val(prom, "dsio_checkpoint_in_flight") == 0

    run_loop("asyncio", main())


def test_kind_names():
    assert registry_mod._kind_of(Checkpointer()) == "checkpoint"

    class SwapManager:
        def statistics(self):
            return {}

    assert registry_mod._kind_of(SwapManager()) == "swap_manager"

    class Named:
        metrics_kind = "optimizer_swapper"

        def statistics(self):
            return {}

    assert registry_mod._kind_of(Named()) == "optimizer_swapper"


def test_broken_statistics_does_not_break_the_scrape(data_dir):
    reg, prom = _registry()

    class Broken:
        def statistics(self):
            raise RuntimeError("boom")

    b = Broken()
    reg.add(b, "broken")
    assert _val(prom, "dsio_info", version=dsio.__version__) == 1
    with pytest.raises(TypeError):
        metrics.track(object())  # type: ignore[arg-type]


def test_global_track_and_register_is_idempotent(data_dir):
    c1 = metrics.register()
    c2 = metrics.register()
    assert c1 is c2

    async def main():
        async with dsio.AsyncIOHandle() as h:
            metrics.track(h)
            metrics.track(h)
            assert metrics.tracked().get("handle", 0) >= 1
            await _io(h, data_dir, n=1)
            prom = CollectorRegistry()
            metrics.register(prom)
            assert _val(prom, "dsio_calls_total", op="write", backend=h.backend) >= 1
            metrics.untrack(h)

    run_loop("asyncio", main())


def test_serve_on_loopback_and_close(data_dir):
    srv = metrics.serve(port=0)
    try:
        assert srv.addr == "127.0.0.1" and srv.port > 0
        assert srv.url == f"http://127.0.0.1:{srv.port}/metrics"

        async def main():
            async with dsio.AsyncIOHandle() as h:
                metrics.track(h)
                await _io(h, data_dir, n=2)
                body = urllib.request.urlopen(srv.url, timeout=10).read().decode()
                names = {f.name for f in text_string_to_metric_families(body)}
                assert {
                    "dsio_requests",
                    "dsio_bytes",
                    "dsio_request_latency_seconds",
                    "dsio_pool_buffers",
                } <= names
                assert "process_cpu_seconds" in names  # process collector comes along
                metrics.untrack(h)

        run_loop("asyncio", main())
    finally:
        srv.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(srv.url, timeout=2)


def test_serve_into_callers_registry():
    prom = CollectorRegistry()
    with metrics.serve(port=0, registry=prom) as srv:
        body = urllib.request.urlopen(srv.url, timeout=10).read().decode()
    assert "dsio_info" in body and "process_cpu_seconds" not in body  # only what the caller registered


def test_scrapes_during_load_are_consistent_and_monotonic(data_dir):
    """Scrape from another thread while I/O runs: counters never go backwards."""
    reg, prom = _registry()
    seen: list[float] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            v = prom.get_sample_value("dsio_requests_total", {"op": "write", "backend": be})
            seen.append(v or 0.0)

    async def main():
        nonlocal be
        async with dsio.AsyncIOHandle(queue_depth=16) as h:
            reg.add(h, "handle")
            be = h.backend
            th = threading.Thread(target=scraper)
            th.start()
            t = aligned_tensor(65536)
            path = os.path.join(data_dir, "load.bin")
            async with h.open(path, "w+") as f:
                for _ in range(20):
                    await asyncio.gather(*(f.pwrite(t, offset=i * 65536) for i in range(32)))
            stop.set()
            th.join()
            assert h.statistics().engine.write.ops == 640

    be = ""
    run_loop("asyncio", main())
    assert len(seen) > 3
    assert seen == sorted(seen)
    assert seen[-1] <= 640


def test_hot_path_does_not_import_prometheus_client(tmp_path):
    """Tracking and I/O never touch prometheus-client; only a scrape imports it."""
    code = f"""
import asyncio, sys, torch, dsio, dsio.metrics
async def main():
    async with dsio.AsyncIOHandle() as h:
        dsio.metrics.track(h)
        await h.pwrite(torch.ones(4096, dtype=torch.uint8), {str(tmp_path / "x.bin")!r})
asyncio.run(main())
assert "prometheus_client" not in sys.modules, "hot path imported prometheus_client"
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_merge_sums_snapshots():
    a = dsio.OpStatistics(1, 10, 0, 0.5, (1, 0))
    b = dsio.OpStatistics(2, 20, 1, 0.25, (0, 2))
    m = registry_mod._merge(a, b)
    assert m == dsio.OpStatistics(3, 30, 1, 0.75, (1, 2))
    assert registry_mod._merge({"EIO": 1}, {"EIO": 2, "ENOSPC": 1}) == {"EIO": 3, "ENOSPC": 1}


def test_tensor_memory_is_not_retained(data_dir):
    """A tracked handle's snapshots hold numbers only (no tensors, no buffers)."""
    reg, prom = _registry()

    async def main():
        async with dsio.AsyncIOHandle() as h:
            reg.add(h, "handle")
            t = torch.ones(65536, dtype=torch.uint8)
            await h.pwrite(t, os.path.join(data_dir, "w.bin"))
            _text(prom)
            r = weakref.ref(t)
            del t
            gc.collect()
            assert r() is None

    run_loop("asyncio", main())


@dataclass(frozen=True, slots=True)
class _FutureOpStats:
    """OpStatistics as the engine will report it once it keeps size buckets and errno counts."""

    ops: int
    bytes: int
    errors: int
    latency_seconds_total: float
    latency_buckets: tuple[int, ...]
    size_buckets: tuple[int, ...]
    errors_by_errno: dict[int, int]


def test_size_buckets_and_errno_counts_are_used_when_the_engine_has_them(monkeypatch):
    """Forward compatibility: per-errno counts become errno labels (the rest of the errors are
    "short"), and engine size buckets become a real size histogram."""
    from dsio import _stats

    monkeypatch.setattr(_stats, "SIZE_BUCKET_BOUNDS_BYTES", (4096.0, 65536.0, float("inf")), raising=False)
    lat = (0,) * len(dsio.LATENCY_BUCKET_BOUNDS_S)
    read = _FutureOpStats(10, 10 * 65536, 5, 0.01, (10,) + lat[1:], (0, 10, 0), {5: 2, 28: 1, 0: 1})
    idle = _FutureOpStats(0, 0, 0, 0.0, lat, (0, 0, 0), {})
    pool = dsio.PoolStatistics(1, 4096, 0, 0, 0, 0, 0.0, True, False)
    eng = dsio.IOEngineStatistics("io_uring", read, idle, idle, 0, 10, 10, 10, 1, 10, 10)  # type: ignore[arg-type]
    st = dsio.HandleStatistics("io_uring", 10, 0, 10 * 65536, 0, 4, 0, 0, 0, 0, eng, pool)

    class FakeHandle:
        def statistics(self):
            return st

    reg, prom = _registry()
    h = FakeHandle()
    reg.add(h, "handle")
    labels = {"op": "read", "backend": "io_uring"}
    assert _val(prom, "dsio_request_errors_total", errno="EIO", **labels) == 2
    assert _val(prom, "dsio_request_errors_total", errno="ENOSPC", **labels) == 1
    assert _val(prom, "dsio_request_errors_total", errno="other", **labels) == 1  # errno past the table
    assert _val(prom, "dsio_request_errors_total", errno="short", **labels) == 1
    assert _val(prom, "dsio_request_size_bytes_bucket", le="4096", **labels) == 0
    assert _val(prom, "dsio_request_size_bytes_bucket", le="65536", **labels) == 10
    assert _val(prom, "dsio_request_size_bytes_bucket", le="+Inf", **labels) == 10
    assert _val(prom, "dsio_request_size_bytes_sum", **labels) == 10 * 65536


def test_a_failing_snapshot_falls_back_to_the_last_good_one():
    """statistics() runs on the exporter thread; if it fails once, totals must not dip."""
    reg, prom = _registry()

    @dataclass(frozen=True, slots=True)
    class S:
        ops_total: int

    class Flaky:
        def __init__(self) -> None:
            self.n = 0
            self.fail = False

        def statistics(self) -> S:
            if self.fail:
                raise RuntimeError("deque mutated during iteration")
            self.n += 5
            return S(self.n)

    f = Flaky()
    reg.add(f, "flaky")
    assert _val(prom, "dsio_flaky_ops_total") == 5
    f.fail = True
    assert _val(prom, "dsio_flaky_ops_total") == 5  # the last good snapshot, not a reset to nothing
    f.fail = False
    assert _val(prom, "dsio_flaky_ops_total") == 10


def test_other_namespaces_for_dstrain():
    @dataclass(frozen=True, slots=True)
    class SwapStats:
        swaps: int
        swapped_bytes_total: int
        in_flight: int

    class Swapper:
        def statistics(self) -> SwapStats:
            return SwapStats(3, 1 << 20, 2)

    s = Swapper()
    metrics.track(s, kind="swapper", namespace="dstrain")
    try:
        prom = CollectorRegistry()
        metrics.register(prom)
        assert _val(prom, "dstrain_swapper_swaps_total") == 3
        assert _val(prom, "dstrain_swapper_swapped_bytes_total") == 1 << 20
        assert _val(prom, "dstrain_swapper_in_flight") == 2
        assert _val(prom, "dsio_tracked_objects", kind="dstrain:swapper") == 1
    finally:
        metrics.untrack(s)
    with pytest.raises(ValueError):
        metrics.track(s, namespace="bad-name")


def test_handles_track_themselves(data_dir):
    """Every AsyncIOHandle is exported without the caller doing anything (wired in its __init__)."""
    prom = CollectorRegistry()
    metrics.register(prom)

    def total(be: str) -> float:
        return prom.get_sample_value("dsio_requests_total", {"op": "write", "backend": be}) or 0.0

    async def main():
        before = metrics.tracked().get("handle", 0)
        h = dsio.AsyncIOHandle()
        assert metrics.tracked().get("handle", 0) == before + 1
        be = h.backend
        start = total(be)
        await _io(h, data_dir, n=3)
        assert total(be) == start + 3
        await h.aclose()
        del h
        gc.collect()
        assert metrics.tracked().get("handle", 0) == before
        assert total(be) == start + 3  # retired into the totals, not lost

    run_loop("asyncio", main())


# -- the exporter: burst of scrapes, ports, label and unit hygiene -------------------------------
def _burst(url: str, n: int) -> int:
    """``n`` scrapes released at once from ``n`` threads; how many were answered with 200 within
    Prometheus's default scrape timeout (10 s). With the standard library's listen backlog of 5
    this answered 106 of 200 here (the rest waited on SYN retransmits past the timeout)."""
    barrier = threading.Barrier(n)
    ok: list[int] = []

    def one() -> None:
        barrier.wait()
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                if r.status == 200 and b"dsio_info" in r.read():
                    ok.append(1)
        except OSError:
            pass

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(ok)


def test_burst_of_200_concurrent_scrapes_is_all_answered():
    with metrics.serve(port=0) as srv:
        assert srv.backlog >= 200
        assert _burst(srv.url, 200) == 200


def test_default_port_is_not_dcgms_and_follows_local_rank(monkeypatch):
    assert metrics.DEFAULT_PORT not in (9400, 9464) and not 9100 <= metrics.DEFAULT_PORT <= 9999
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("DSIO_METRICS_PORT", raising=False)
    assert metrics.default_port() == metrics.DEFAULT_PORT
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert metrics.default_port() == metrics.DEFAULT_PORT + 3
    monkeypatch.setenv("DSIO_METRICS_PORT", "20000")
    assert metrics.default_port() == 20003
    monkeypatch.setenv("DSIO_METRICS_PORT", "nope")
    with pytest.raises(dsio.ConfigError):
        metrics.default_port()
    # serve() with no port binds base + LOCAL_RANK: pick a free base so the test cannot collide
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("DSIO_METRICS_PORT", str(free - 1))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with metrics.serve() as srv:
        assert srv.port == free


def test_no_label_carries_a_path_and_units_are_spelled_out(data_dir):
    from prometheus_client import generate_latest

    @dataclass(frozen=True, slots=True)
    class Snap:
        last_throughput_bytes_per_s: float
        directory_depth: int

    class Thing:
        directory = data_dir

        def statistics(self) -> Snap:
            return Snap(1.5e9, 2)

    reg, prom = _registry()
    thing = Thing()
    reg.add(thing, "thing")

    async def main():
        async with dsio.AsyncIOHandle() as h:
            reg.add(h, "handle")
            await _io(h, data_dir, n=2)
            text = generate_latest(prom).decode()
            for fam in text_string_to_metric_families(text):
                assert not fam.name.endswith("_per_s"), fam.name
                for sample in fam.samples:
                    for k, v in sample.labels.items():
                        assert "/" not in v and data_dir not in v, (fam.name, k, v)
            assert _val(prom, "dsio_thing_last_throughput_bytes_per_second") == 1.5e9

    run_loop("asyncio", main())


def test_sources_export_their_own_samples_through_the_one_collector():
    """dstrain's way in: track(obj, describe=...) turns a snapshot into named, labelled samples."""

    @dataclass(frozen=True, slots=True)
    class Snap:
        steps: int

    class Engine:
        def __init__(self) -> None:
            self.steps = 0

        def statistics(self) -> Snap:
            return Snap(self.steps)

    def describe(s: Snap):
        yield metrics.Sample("dstrain_test_steps", "counter", s.steps, "steps", {"rank": "0"})
        yield metrics.Sample("dstrain_test_phase_seconds", "counter", 1.0, "t", {"rank": "0", "phase": "fwd"})

    reg, prom = _registry()
    e = Engine()
    reg.add(e, "dstrain:engine", describe)
    e.steps = 4
    assert _val(prom, "dstrain_test_steps_total", rank="0") == 4
    assert _val(prom, "dstrain_test_phase_seconds_total", rank="0", phase="fwd") == 1.0
    del e
    gc.collect()
    assert prom.get_sample_value("dstrain_test_steps_total", {"rank": "0"}) is None  # live values only
