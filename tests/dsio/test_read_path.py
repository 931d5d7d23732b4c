"""The read path into every kind of destination (issue 17), and the prefault thread behind it.

Reads of at least ``PREFAULT_MIN_BYTES`` queue their destination on the engine's prefault thread
(``madvise(MADV_POPULATE_WRITE)``), which populates fresh pages ahead of the I/O and the staging
copies, skips resident ones, and stops when the read is over. These tests lower the threshold so
small tensors take the same path as big ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time

import pytest
import torch
from _dsio_helpers import fill_random

import dsio
import dsio._transfer as transfer
from dsio._native import native
from dsio._tuning import SWITCHES

MIB = 1 << 20
SMALL = dict(block_size=64 << 10, queue_depth=8, pool_bytes=4 * MIB, staging_buffer_bytes=MIB)
SIZE = 3 * MIB + 123  # crosses pieces, staging chunks and 2 MiB prefault steps; unaligned tail

pytestmark = pytest.mark.skipif(
    not native().populate_write_supported(), reason="kernel without MADV_POPULATE_WRITE (Linux < 5.14)"
)


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    monkeypatch.setattr(transfer, "PREFAULT_MIN_BYTES", 256 << 10)


def _aligned(nbytes: int, lock: bool) -> torch.Tensor:
    return torch.frombuffer(native().AlignedBuffer(nbytes, lock), dtype=torch.uint8)[:nbytes]


DESTINATIONS = {
    "fresh": lambda n: torch.empty(n, dtype=torch.uint8),  # what a loader does: never touched
    "touched": lambda n: torch.zeros(n, dtype=torch.uint8),
    "locked": lambda n: _aligned(n, True),  # dsio.compat new_cpu_locked_tensor's memory
    "fresh_aligned": lambda n: _aligned(n, False),  # page-aligned, never touched: direct path
    "odd_address": lambda n: torch.empty(n + 1, dtype=torch.uint8)[1:],
}


def _settle(h: dsio.AsyncIOHandle, timeout: float = 10.0) -> dsio.IOEngineStatistics:
    """Engine statistics once the prefault thread has accounted for every byte it was given."""
    deadline = time.monotonic() + timeout
    while True:
        raw = h._engine.statistics()["prefault"]
        st = h.statistics().engine
        if raw["ranges"] == 0 or time.monotonic() > deadline:
            return st
        done = raw["populated_bytes"] + raw["resident_bytes"] + raw["cancelled_bytes"]
        if done and not _busy(h):
            return st
        time.sleep(0.01)


def _busy(h: dsio.AsyncIOHandle) -> bool:
    a = h._engine.statistics()["prefault"]
    time.sleep(0.02)
    b = h._engine.statistics()["prefault"]
    return a != b


@pytest.mark.parametrize("kind", list(DESTINATIONS))
@pytest.mark.parametrize("offset", [0, 4099])
async def test_read_into_every_destination(backend, data_dir, kind, offset):
    src = fill_random(torch.empty(SIZE, dtype=torch.uint8), seed=len(kind) + offset)
    path = os.path.join(data_dir, "t.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL)) as h:
        await h.pwrite(torch.zeros(offset, dtype=torch.uint8), path) if offset else None
        await h.pwrite(src, path, offset=offset)
        dst = DESTINATIONS[kind](SIZE)
        assert await h.pread(dst, path, offset) == SIZE
        assert torch.equal(dst, src)
        st = h.statistics().engine
        assert st.prefault_ranges == 1  # one large read, one destination queued


async def test_short_file_is_short_io_error_and_prefault_stops(backend, data_dir):
    path = os.path.join(data_dir, "short.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL)) as h:
        await h.pwrite(fill_random(torch.empty(MIB, dtype=torch.uint8)), path)
        with pytest.raises(dsio.ShortIOError):
            await h.pread(torch.empty(SIZE, dtype=torch.uint8), path)
        with pytest.raises(dsio.ShortIOError):
            await h.pread(torch.empty(MIB, dtype=torch.uint8), path, offset=4096)
        # The size check comes before any I/O or prefaulting.
        assert h.statistics().engine.prefault_ranges == 0


async def test_prefault_populates_fresh_and_skips_touched(data_dir, monkeypatch):
    """Every byte of a queued destination is accounted for: populated (fresh pages), skipped
    (already resident) or cancelled (the read finished first); touched memory is never populated.
    (Fresh aligned memory read directly: with ``SWITCHES.fresh_staged`` off; on, it is staged, as the touched
    tensor here: tests/dsio/test_read_fresh_staged.py.)"""

    monkeypatch.setattr(SWITCHES, "fresh_staged", False)
    n = 8 * MIB
    path = os.path.join(data_dir, "p.bin")
    src = fill_random(torch.empty(n, dtype=torch.uint8))
    # posix, one worker, 64 KiB pieces one at a time: the read takes a while, so the prefault
    # thread gets ahead of it on fresh memory.
    cfg = dsio.IOConfig(backend="posix", intra_op_parallelism=1, queue_depth=1, block_size=64 << 10)
    async with dsio.AsyncIOHandle(cfg) as h:
        await h.pwrite(src, path)
        # not page-aligned on purpose (so staged): torch.ones(n) is page-aligned now and then
        # (glibc serves it from the heap once its mmap threshold has grown), and an aligned
        # touched tensor is read directly, its first window not queued (2 n - 2 windows)
        base = torch.ones(n + 64, dtype=torch.uint8)
        lead = 0 if base.data_ptr() % 4096 else 16
        touched = base[lead : lead + n]
        assert touched.data_ptr() % 4096 != 0
        await h.pread(touched, path)
        st = _settle(h)
        assert st.prefault_ranges == 1 and st.prefaulted_bytes == 0
        assert torch.equal(touched, src)
        fresh = _aligned(n, False)
        assert not native().probably_resident(fresh.data_ptr(), n)
        await h.pread(fresh, path)
        st2 = _settle(h)
        raw = h._engine.statistics()["prefault"]
        assert st2.prefault_ranges == 2
        accounted = raw["populated_bytes"] + raw["resident_bytes"] + raw["cancelled_bytes"]
        # The touched tensor (not page-aligned: staged) is queued whole, in whole pages; the fresh
        # aligned one (direct) from past the window the worker submits, and faults in, at once.
        window = h._engine.window_bytes
        assert window == 64 << 10
        assert 2 * n - 4096 - window <= accounted <= 2 * n - window
        assert st2.prefaulted_bytes > 0, "the prefault thread never got ahead of a slow read"
        assert torch.equal(fresh, src)


def test_engine_prefault_populates_without_changing_contents():
    """The mechanism itself: populated pages are resident, later touches do not fault, and data
    already there is kept (MADV_POPULATE_WRITE never writes)."""
    n = 32 * MIB
    eng = native().Engine("posix", 1 << 20, 1, 1, False, True)
    try:
        mem = _aligned(n, False)
        mem[:4096].fill_(7)  # one touched page with contents
        tok = eng.prefault(mem.data_ptr(), n)
        assert tok > 0
        deadline = time.monotonic() + 20
        while (
            eng.statistics()["prefault"]["populated_bytes"] + eng.statistics()["prefault"]["resident_bytes"]
            < n
        ):
            assert time.monotonic() < deadline, eng.statistics()["prefault"]
            time.sleep(0.01)
        assert native().probably_resident(mem.data_ptr(), n)
        assert int(mem[:4096].sum()) == 7 * 4096
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        mem.fill_(1)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < n // 4096 // 10, f"{faults} faults touching prefaulted memory"
    finally:
        eng.close()


def test_prefault_cancel_and_close_stop_promptly():
    n = 1 << 30  # 1 GiB of address space: populating all of it would take a visible while
    # On a loaded machine this thread can be descheduled between prefault() and prefault_cancel()
    # for as long as the prefault thread needs to populate the whole range (~0.2 s): that attempt
    # proves nothing either way, so it is made again (3 attempts; a cancel that never stops a
    # prefault fails every one of them).
    for _attempt in range(3):
        eng = native().Engine("posix", 1 << 20, 1, 1, False, True)
        mem = _aligned(n, False)
        tok = eng.prefault(mem.data_ptr(), n)
        eng.prefault_cancel(tok)
        eng.prefault_cancel(tok)  # idempotent
        deadline = time.monotonic() + 20
        while True:
            pf = eng.statistics()["prefault"]
            if pf["cancelled_bytes"] or pf["populated_bytes"] + pf["resident_bytes"] == n:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if pf["cancelled_bytes"]:
            break
        eng.close()  # the whole range was populated before the cancel reached it: again
    else:
        pytest.fail("prefault_cancel stopped none of 3 prefaults of 1 GiB")
    assert (
        pf["populated_bytes"] < n
        and pf["populated_bytes"] + pf["cancelled_bytes"] + pf["resident_bytes"] == n
    )
    tok2 = eng.prefault(mem.data_ptr(), n)
    assert tok2 > tok
    t0 = time.monotonic()
    eng.close()  # joins the prefault thread mid-range
    assert time.monotonic() - t0 < 5
    assert eng.prefault(mem.data_ptr(), n) == 0  # closed: nothing is queued any more


async def test_writes_and_small_reads_never_prefault(data_dir):
    path = os.path.join(data_dir, "w.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(**SMALL)) as h:
        await h.pwrite(torch.empty(SIZE, dtype=torch.uint8), path)
        await h.pread(torch.empty(4096, dtype=torch.uint8), path)
        prefaulted = h.statistics().engine.prefault_ranges
    assert prefaulted == 0


async def test_piece_latency_histogram_counts_every_piece(backend, data_dir):
    """Where read time goes: every block_size piece lands in one latency bucket, per op."""
    path = os.path.join(data_dir, "h.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL)) as h:
        await h.pwrite(fill_random(_aligned(2 * MIB, True)), path)
        await h.pread(_aligned(2 * MIB, True), path)
        st = h.statistics().engine
    assert sum(st.read.piece_latency_buckets) == 2 * MIB // SMALL["block_size"]
    assert sum(st.read.piece_latency_buckets) + sum(st.write.piece_latency_buckets) == st.pieces


# -- the staged read's pool -> tensor copy runs in the engine's workers, not on the loop -------


class _CountingMemcpy:
    """Stands in for ``dsio._C.memcpy``: counts the copies made from Python."""

    def __init__(self, real) -> None:
        self._real = real
        self.calls = 0

    def __call__(self, dst: int, src: int, n: int) -> None:
        self.calls += 1
        self._real(dst, src, n)


def _never_page_aligned(make, n: int) -> torch.Tensor:
    """``make(n + 128)`` cut to ``n`` bytes at a start that is not 4096-aligned (the allocator
    sometimes hands out page-aligned memory, which would take the direct path)."""
    t = make(n + 128)
    shift = 64 if (t.data_ptr() + 64) % 4096 else 128
    return t[shift : shift + n]


@pytest.mark.parametrize("kind", ["fresh", "touched", "odd_address"])
@pytest.mark.parametrize("offset", [0, 4096, 4099])
async def test_staged_read_copies_natively(backend, data_dir, kind, offset, monkeypatch):
    """Every staged body byte is copied by the engine (its copy counters), none by Python."""
    src = fill_random(torch.empty(SIZE, dtype=torch.uint8), seed=offset + 3)
    path = os.path.join(data_dir, "c.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL)) as h:
        if offset:
            await h.pwrite(torch.zeros(offset, dtype=torch.uint8), path)
        await h.pwrite(src, path, offset=offset)
        counting = _CountingMemcpy(native().memcpy)
        monkeypatch.setattr(native(), "memcpy", counting)
        before = h._engine.statistics()["copy"]
        staged_before = h.statistics().staged_bytes
        dst = _never_page_aligned(DESTINATIONS[kind], SIZE)
        assert await h.pread(dst, path, offset) == SIZE
        assert torch.equal(dst, src)
        after = h._engine.statistics()["copy"]
        staged = h.statistics().staged_bytes - staged_before
        st = h.statistics().engine
    assert staged > 0, "this destination should have been staged"
    assert counting.calls == 0, "a staged read copied on the event-loop thread"
    assert after["bytes"] - before["bytes"] == staged
    assert after["pieces"] - before["pieces"] >= staged // SMALL["block_size"]
    assert st.staged_copy_bytes == after["bytes"] and st.staged_copy_seconds_total > 0


def _reap_all(eng, tags: int, timeout: float = 20.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < tags:
        assert time.monotonic() < deadline, out
        out += eng.reap()
        time.sleep(0.002)
    return out


def test_engine_copy_skips_short_and_failed_pieces(backend, data_dir):
    """copy_dst receives exactly the pieces read in full: a piece cut short by end of file, the
    pieces past it and a failed request leave the destination's bytes as they were."""
    bs = 64 << 10
    path = os.path.join(data_dir, "s.bin")
    data = fill_random(torch.empty(bs + bs // 2, dtype=torch.uint8), seed=5)  # 1.5 pieces
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    eng = native().Engine(backend, bs, 4, 2, False, True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        stage = _aligned(4 * bs, True)
        dst = torch.full((4 * bs,), 0xAB, dtype=torch.uint8)
        eng.submit(0, fd, stage.data_ptr(), 4 * bs, 0, 1, dst.data_ptr())
        [(tag, res, err_off)] = _reap_all(eng, 1)
        assert (tag, res) == (1, bs + bs // 2)  # short: the caller raises ShortIOError
        assert err_off == bs + bs // 2
        assert torch.equal(dst[:bs], data[:bs])
        assert bool((dst[bs:] == 0xAB).all()), "a short piece or one past end of file was copied"
        assert eng.statistics()["copy"]["bytes"] == bs

        # A failed request (bad fd) copies nothing.
        dst2 = torch.full((2 * bs,), 0xCD, dtype=torch.uint8)
        eng.submit(0, 1 << 20, stage.data_ptr(), 2 * bs, 0, 2, dst2.data_ptr())
        [(tag, res, _)] = _reap_all(eng, 1)
        assert tag == 2 and res < 0
        assert bool((dst2 == 0xCD).all())
        assert eng.statistics()["copy"]["bytes"] == bs

        with pytest.raises(ValueError):
            eng.submit(1, fd, stage.data_ptr(), bs, 0, 3, dst.data_ptr())  # copies are for reads
    finally:
        eng.close()
        os.close(fd)


async def test_cancelled_staged_read_returns_every_lease(backend, data_dir):
    """Cancelling a staged read mid-way: the engine finishes (and copies) what it holds, every
    pool buffer comes back, and the handle keeps working."""
    n = 32 * MIB
    path = os.path.join(data_dir, "x.bin")
    src = fill_random(torch.empty(n, dtype=torch.uint8), seed=9)
    async with dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL)) as h:
        await h.pwrite(src, path)
        for delay in (0.0, 0.002, 0.01):
            dst = torch.zeros(n, dtype=torch.uint8)
            task = asyncio.ensure_future(h.pread(dst, path))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            del dst  # the engine keeps the memory alive until its copies are done
            deadline = time.monotonic() + 20
            while h._pool.statistics().in_use:
                assert time.monotonic() < deadline, h._pool.statistics()
                await asyncio.sleep(0.005)
        again = torch.empty(n + 1, dtype=torch.uint8)[1:]
        assert await h.pread(again, path) == n
        assert torch.equal(again, src)


def test_staged_read_spends_little_loop_cpu(data_dir):
    """The loop thread's CPU time during a 128 MiB staged read is a fraction of what copying
    128 MiB costs that thread (CPU time, so other load on the machine does not matter)."""
    n = 128 * MIB
    path = os.path.join(data_dir, "big.bin")
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n + 64, dtype=torch.uint8)[64:]  # touched, 64 mod 4096: staged
    from dsio._bridge import run_sync

    async def go() -> tuple[float, float]:
        async with dsio.AsyncIOHandle(dsio.IOConfig()) as h:
            await h.pwrite(src, path)
            t0 = time.thread_time()
            native().memcpy(dst.data_ptr(), src.data_ptr(), n)  # what the loop used to pay
            copy_cpu = time.thread_time() - t0
            dst.zero_()
            t0 = time.thread_time()
            await h.pread(dst, path)
            read_cpu = time.thread_time() - t0
            assert h.statistics().staged_bytes >= n - 4096
        return copy_cpu, read_cpu

    copy_cpu, read_cpu = run_sync(go(), timeout=120)
    assert torch.equal(dst, src)
    assert read_cpu < 0.5 * copy_cpu, f"loop thread CPU {read_cpu:.3f}s vs a 128 MiB copy {copy_cpu:.3f}s"


@pytest.mark.parametrize("offset", [0, 4099])
async def test_staged_write_copies_natively(backend, data_dir, offset, monkeypatch):
    """The tensor -> pool copy of a staged write runs in the engine's workers too."""
    src = fill_random(torch.empty(SIZE + 1, dtype=torch.uint8), seed=offset + 11)[1:]  # odd address
    path = os.path.join(data_dir, "w.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL)) as h:
        counting = _CountingMemcpy(native().memcpy)
        monkeypatch.setattr(native(), "memcpy", counting)
        before = h._engine.statistics()["copy"]["bytes"]
        assert await h.pwrite(src, path, offset=offset) == SIZE
        copied = h._engine.statistics()["copy"]["bytes"] - before
        staged = h.statistics().staged_bytes
        monkeypatch.undo()
        back = _aligned(SIZE, True)
        assert await h.pread(back, path, offset) == SIZE
    assert staged > 0 and copied == staged
    assert counting.calls == 0, "a staged write copied on the event-loop thread"
    assert torch.equal(back, src)
    with open(path, "rb") as f:
        assert len(f.read()) == offset + SIZE


def test_engine_copy_src_is_for_writes_only(backend, data_dir):
    eng = native().Engine(backend, 64 << 10, 4, 2, False, True)
    path = os.path.join(data_dir, "v.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        stage = _aligned(128 << 10, True)
        src = fill_random(torch.empty(128 << 10, dtype=torch.uint8), seed=2)
        with pytest.raises(ValueError):
            eng.submit(0, fd, stage.data_ptr(), 128 << 10, 0, 1, 0, src.data_ptr())
        with pytest.raises(ValueError):
            eng.submit(2, fd, 0, 0, 0, 1, stage.data_ptr())
        eng.submit(1, fd, stage.data_ptr(), 128 << 10, 0, 2, 0, src.data_ptr())
        assert [r[:2] for r in _reap_all(eng, 1)] == [(2, 128 << 10)]
        assert torch.equal(stage, src)  # the worker staged it before writing
        with open(path, "rb") as f:
            assert f.read() == src.numpy().tobytes()
    finally:
        eng.close()
        os.close(fd)


async def test_loop_thread_copy_switch_is_a_faithful_baseline(data_dir, monkeypatch):
    """SWITCHES.loop_thread_copy (the benchmarks' A/B baseline) copies on the loop thread, same bytes."""
    monkeypatch.setattr(SWITCHES, "loop_thread_copy", True)
    counting = _CountingMemcpy(native().memcpy)
    monkeypatch.setattr(native(), "memcpy", counting)
    src = fill_random(torch.empty(SIZE + 1, dtype=torch.uint8), seed=4)[1:]
    path = os.path.join(data_dir, "b.bin")
    async with dsio.AsyncIOHandle(dsio.IOConfig(**SMALL)) as h:
        await h.pwrite(src, path, offset=4099)
        dst = _never_page_aligned(DESTINATIONS["fresh"], SIZE)
        assert await h.pread(dst, path, 4099) == SIZE
        native_copies = h._engine.statistics()["copy"]["pieces"]
    assert torch.equal(dst, src)
    assert counting.calls >= 2 * (SIZE // SMALL["staging_buffer_bytes"]) and native_copies == 0


async def test_close_mid_staged_read_finishes_or_raises(backend, data_dir):
    """Closing the handle while staged reads are in flight: the engine drains (copies included),
    each read either completes with the right bytes or raises a dsio error; nothing hangs."""
    n = 32 * MIB
    path = os.path.join(data_dir, "m.bin")
    src = fill_random(torch.empty(n, dtype=torch.uint8), seed=13)
    h = dsio.AsyncIOHandle(dsio.IOConfig(backend=backend, **SMALL))
    await h.pwrite(src, path)
    dsts = [_never_page_aligned(DESTINATIONS["touched"], n) for _ in range(2)]
    tasks = [asyncio.ensure_future(h.pread(d, path)) for d in dsts]
    await asyncio.sleep(0.003)
    await asyncio.wait_for(h.aclose(), 60)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    for d, r in zip(dsts, results):
        if isinstance(r, BaseException):
            assert isinstance(r, dsio.DsioError | asyncio.CancelledError), repr(r)
        else:
            assert r == n and torch.equal(d, src)
