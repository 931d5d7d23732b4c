"""The copier (issue 17): a staged read's pieces are copied out of their staging slots by the
engine's copier threads, not by the worker that reaped them, so the workers keep submitting and
reaping while copies run; copies use streaming stores (any alignment, any length) and the
per-piece timeline (``Engine.trace_start`` / ``trace_take``) shows who did what, when.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dsio_helpers import fill_random, unaligned_tensor

import dsio
from dsio._native import native

KIB = 1 << 10
BS = 64 * KIB
SUBMIT, COMPLETE, COPY_START, COPY_END = 0, 1, 2, 3
COPIER = 100


def _cfg(backend: str) -> dsio.IOConfig:
    return dsio.IOConfig(
        backend=backend,
        block_size=BS,
        queue_depth=4,
        intra_op_parallelism=2,
        staging_buffer_bytes=4 * BS,
        pool_bytes=16 * BS,
    )


def _events(trace, kind: int) -> list:
    return [e for e in trace if e[1] == kind]


@pytest.mark.parametrize("copy_threads", [2, 1, 0])
async def test_staged_read_copies_run_on_the_copier(backend, data_dir, copy_threads):
    """Every piece is submitted and reaped by a worker (0, 1) and, with copier threads, copied out
    by the copier (thread id 100), after it completed; with copy_threads=0 (the A/B baseline) the
    reaping worker copies. Same bytes either way."""
    path = os.path.join(data_dir, "c.bin")
    size = 40 * BS + 4096
    src = fill_random(unaligned_tensor(size), seed=copy_threads)
    async with dsio.AsyncIOHandle(_cfg(backend)) as h:
        await h.pwrite(src, path)
        eng = h._engine
        eng.copy_threads = copy_threads
        dst = unaligned_tensor(size)
        eng.trace_start(10_000)
        await h.pread(dst, path)
        trace = eng.trace_take()
        assert eng.trace_take() == []  # taking stops the trace
    assert torch.equal(dst, src)
    submits, completes = _events(trace, SUBMIT), _events(trace, COMPLETE)
    starts, ends = _events(trace, COPY_START), _events(trace, COPY_END)
    pieces = size // BS  # the O_DIRECT body is size - 4096 rounded: 40 whole pieces + 1 partial
    assert len(submits) == len(completes) >= pieces
    assert len(starts) == len(ends) == len(completes)
    assert {e[2] for e in submits} <= {0, 1} and {e[2] for e in completes} <= {0, 1}
    copiers = {e[2] for e in starts}
    assert copiers == ({COPIER} if copy_threads else copiers & {0, 1}) and copiers
    done_at = {e[3]: e[0] for e in completes}
    for t, _k, _th, pos in starts:
        assert t >= done_at[pos], "a piece was copied before its read completed"


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("shift", [1, 7, 31, 33, 64])
def test_copy_out_any_alignment_and_length(data_dir, streaming, shift):
    """The engine copies each piece to copy_dst + its position whatever the destination's
    alignment (streaming stores need 32-byte alignment: a head and tail go through memcpy) and
    whatever the piece's length (the last piece here is 4099 bytes, over the 4096 streaming floor,
    and a second request's is 100). Bytes around the destination are left alone."""
    path = os.path.join(data_dir, "a.bin")
    n = 3 * BS + 4099
    data = fill_random(torch.empty(n, dtype=torch.uint8), seed=shift)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    eng = native().Engine("posix", BS, 4, 2, False, True)
    eng.copy_streaming = streaming
    fd = os.open(path, os.O_RDONLY)
    try:
        stage = torch.frombuffer(native().AlignedBuffer(4 * BS, False), dtype=torch.uint8)
        room = torch.full((n + 256,), 0xEE, dtype=torch.uint8)
        at = room.data_ptr() + shift
        eng.submit(0, fd, stage.data_ptr(), n, 0, 1, at)
        eng.submit(0, fd, stage.data_ptr(), 100, 0, 2, at)  # shorter than one 128-byte stride
        got = _reap(eng, 2)
        assert sorted(got) == [(1, n, -1), (2, 100, -1)]
        assert torch.equal(room[shift : shift + n], data)
        assert bool((room[:shift] == 0xEE).all()) and bool((room[shift + n :] == 0xEE).all())
    finally:
        eng.close()
        os.close(fd)


async def test_copy_threads_change_between_reads(data_dir):
    """Copier threads can be added, parked and the copy moved back to the workers between reads
    (the benchmarks' A/B switches): each read is whole, and close() joins every thread."""
    path = os.path.join(data_dir, "t.bin")
    size = 24 * BS
    src = fill_random(unaligned_tensor(size), seed=3)
    async with dsio.AsyncIOHandle(_cfg("io_uring" if native().probe_io_uring() == 0 else "posix")) as h:
        await h.pwrite(src, path)
        for n in (1, 3, 0, 2, 1):
            h._engine.copy_threads = n
            dst = unaligned_tensor(size)
            await h.pread(dst, path)
            assert torch.equal(dst, src), n
        st = h._engine.statistics()["copy"]
        assert st["bytes"] >= 5 * (size - 4096) and st["backlog_max"] >= 1


def _reap(eng, tags: int, timeout: float = 20.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < tags:
        assert time.monotonic() < deadline, out
        out += eng.reap()
        time.sleep(0.002)
    return out


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


@pytest.mark.skipif(
    not native().populate_write_supported(), reason="kernel lacks MADV_POPULATE_WRITE (< 5.14)"
)
@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off (THP 'never')")
def test_prefault_hugepage_advice_only_when_asked():
    """A range queued with hugepage=True has its fresh whole 2 MiB steps advised MADV_HUGEPAGE
    before being populated; without it none are."""
    n = 16 << 20
    eng = native().Engine("posix", BS, 1, 1, False, True)
    try:
        for ask in (False, True):
            mem = native().AlignedBuffer(n + (2 << 20), False)  # fresh, never touched
            base = (mem.ptr + (2 << 20) - 1) & ~((2 << 20) - 1)
            before = eng.statistics()["prefault"]
            assert eng.prefault(base, n, ask) != 0
            deadline = time.monotonic() + 30
            while True:
                pf = eng.statistics()["prefault"]
                if (
                    pf["populated_bytes"]
                    + pf["resident_bytes"]
                    - before["populated_bytes"]
                    - before["resident_bytes"]
                    >= n
                ):
                    break
                assert time.monotonic() < deadline, pf
                time.sleep(0.01)
            advised = pf["hugepage_bytes"] - before["hugepage_bytes"]
            assert advised == (n if ask else 0)
            del mem
    finally:
        eng.close()


def test_direct_reads_ask_for_huge_pages_and_staged_reads_do_not():
    """The policy in _transfer.prefault: the kernel reads straight into the memory (direct) ->
    hugepage advice; a staged read's destination is written by copies -> none (no gain measured)."""
    import dsio._transfer as transfer
    from dsio._dispatch import READ

    calls = []

    class Engine:
        window_bytes = 1 << 20

        def prefault(self, ptr, nbytes, hugepage=False):
            calls.append((ptr, nbytes, hugepage))
            return 1

    class Disp:
        engine = Engine()

    n = 64 << 20
    transfer.prefault(Disp(), READ, 4096, n, direct=True)
    transfer.prefault(Disp(), READ, 4096 + 64, n, direct=False)
    assert calls == [(4096 + (1 << 20), n - (1 << 20), True), (4096 + 64, n, False)]
