"""The read path into every kind of destination (issue 17), and the prefault thread behind it.

Reads of at least ``PREFAULT_MIN_BYTES`` queue their destination on the engine's prefault thread
(``madvise(MADV_POPULATE_WRITE)``), which populates fresh pages ahead of the I/O and the staging
copies, skips resident ones, and stops when the read is over. These tests lower the threshold so
small tensors take the same path as big ones.
"""

from __future__ import annotations

import os
import resource
import time

import pytest
import torch
from conftest import fill_random

import dsio
import dsio._transfer as transfer
from dsio._native import native

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


async def test_prefault_populates_fresh_and_skips_touched(data_dir):
    """Every byte of a queued destination is accounted for: populated (fresh pages), skipped
    (already resident) or cancelled (the read finished first); touched memory is never populated."""
    n = 8 * MIB
    path = os.path.join(data_dir, "p.bin")
    src = fill_random(torch.empty(n, dtype=torch.uint8))
    # posix, one worker, 64 KiB pieces one at a time: the read takes a while, so the prefault
    # thread gets ahead of it on fresh memory.
    cfg = dsio.IOConfig(backend="posix", intra_op_parallelism=1, queue_depth=1, block_size=64 << 10)
    async with dsio.AsyncIOHandle(cfg) as h:
        await h.pwrite(src, path)
        touched = torch.ones(n, dtype=torch.uint8)
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
    eng = native().Engine("posix", 1 << 20, 1, 1, False, True)
    mem = _aligned(n, False)
    tok = eng.prefault(mem.data_ptr(), n)
    eng.prefault_cancel(tok)
    eng.prefault_cancel(tok)  # idempotent
    deadline = time.monotonic() + 20
    while eng.statistics()["prefault"]["cancelled_bytes"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pf = eng.statistics()["prefault"]
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
