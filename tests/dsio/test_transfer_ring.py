"""Ring staging (issue 17): a staged read (ordinary tensor, not 4096-aligned) is one engine
request whose pieces cycle through the pool buffers it took, cut into block_size slots; a slot
goes from a finished (copied-out) piece to the next, with no event-loop round trip per buffer.
Staged writes go one request per pool buffer (measured faster; there is no ring for writes).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from _dsio_helpers import fill_random, unaligned_tensor

import dsio
from dsio._tuning import SWITCHES

MIB = 1 << 20
BS = 64 << 10


def _cfg(backend: str, slots: int, **kw) -> dsio.IOConfig:
    """A handle whose pool holds ``slots`` block_size slots in one buffer each."""
    return dsio.IOConfig(
        backend=backend,
        block_size=BS,
        queue_depth=4,
        intra_op_parallelism=2,
        staging_buffer_bytes=BS,
        pool_bytes=slots * BS,
        **kw,
    )


@pytest.mark.parametrize("slots,size,offset", [(1, 4 * MIB + 123, 4099), (3, 4 * MIB, 0)])
async def test_ring_moves_every_byte_through_few_slots(backend, data_dir, slots, size, offset):
    """Fewer slots than pieces in flight (1: every piece waits for the one before it, across
    two workers): each byte arrives, nothing hangs, every buffer goes back to the pool."""
    path = os.path.join(data_dir, "ring.bin")
    src = fill_random(unaligned_tensor(size), seed=slots + offset)
    async with dsio.AsyncIOHandle(_cfg(backend, slots)) as h:
        await asyncio.wait_for(h.pwrite(src, path, offset=offset), 60)
        dst = unaligned_tensor(size)
        await asyncio.wait_for(h.pread(dst, path, offset), 60)
        assert torch.equal(dst, src)
        st = h.statistics()
        assert st.pool.in_use == 0
        assert st.staged_bytes >= 2 * (size - 2 * 4096)


async def test_staged_body_is_one_engine_request(data_dir):
    """The ring path: an 8 MiB staged read is one request, not one per pool buffer (the write
    is 8 either way); the per-buffer path (the A/B switch) makes 8 of each."""
    path = os.path.join(data_dir, "one.bin")
    src = fill_random(unaligned_tensor(8 * MIB), seed=9)
    cfg = dsio.IOConfig(staging_buffer_bytes=MIB, pool_bytes=4 * MIB, block_size=256 << 10)
    async with dsio.AsyncIOHandle(cfg) as h:
        counts = {}
        for ring in (True, False):
            SWITCHES.ring_staging = ring
            try:
                s0 = h._engine.statistics()["submitted"]
                await h.pwrite(src, path)
                dst = unaligned_tensor(8 * MIB)
                await h.pread(dst, path)
                counts[ring] = h._engine.statistics()["submitted"] - s0
            finally:
                SWITCHES.ring_staging = True
            assert torch.equal(dst, src)
        assert counts == {True: 9, False: 16}


async def test_concurrent_ring_transfers_share_the_pool(data_dir):
    """Several staged reads at once on one handle: the first takes what is free, the others wait
    for buffers (first come, first served) and still get every byte."""
    srcs = [fill_random(unaligned_tensor(2 * MIB + 17 * i), seed=i) for i in range(4)]
    paths = [os.path.join(data_dir, f"c{i}.bin") for i in range(4)]
    async with dsio.AsyncIOHandle(_cfg("posix", 4)) as h:
        await asyncio.gather(*(h.pwrite(s, p) for s, p in zip(srcs, paths, strict=True)))
        dsts = [unaligned_tensor(s.numel()) for s in srcs]
        await asyncio.wait_for(asyncio.gather(*(h.pread(d, p) for d, p in zip(dsts, paths, strict=True))), 60)
        for d, s in zip(dsts, srcs, strict=True):
            assert torch.equal(d, s)
        assert h.statistics().pool.in_use == 0


async def test_ring_failure_reports_the_first_bad_offset_and_returns_the_buffers(data_dir):
    """A file shorter than the read (shrunk after the size check): ShortIOError at the byte where
    the data stopped; the slots are back in the pool and the handle works on."""
    path = os.path.join(data_dir, "short.bin")
    src = fill_random(unaligned_tensor(4 * MIB), seed=2)
    async with dsio.AsyncIOHandle(_cfg("posix", 2)) as h:
        await h.pwrite(src, path)
        real = h._disp.submit

        def submit(*args, **kwargs):
            os.truncate(path, MIB)
            return real(*args, **kwargs)

        h._disp.submit = submit  # type: ignore[method-assign]
        with pytest.raises(dsio.ShortIOError) as ei:
            await h.pread(unaligned_tensor(4 * MIB), path)
        del h._disp.submit
        assert ei.value.offset == MIB
        assert h.statistics().pool.in_use == 0
        dst = unaligned_tensor(MIB)
        await h.pread(dst, path)
        assert torch.equal(dst, src[:MIB])


def test_submit_staged_rejects_bad_arguments():
    from dsio._native import native

    eng = native().Engine("posix", BS, 1, 1, False, True)
    try:
        with pytest.raises(ValueError):
            eng.submit_staged(2, 0, 4096, BS, 0, 1, [4096])  # fsync is not a transfer
        with pytest.raises(ValueError):
            eng.submit_staged(0, 0, 4096, BS, 0, 1, [])  # no slot
        with pytest.raises(ValueError):
            eng.submit_staged(1, 0, 4096, BS, 0, 1, [4096])  # no ring for writes
    finally:
        eng.close()


async def test_staged_writes_go_per_buffer_and_reads_take_the_ring(data_dir):
    """The measured choice (see SWITCHES.ring_staging): an 8 MiB staged write is one request per pool buffer
    (8), the read of it one ring request."""
    path = os.path.join(data_dir, "default.bin")
    src = fill_random(unaligned_tensor(8 * MIB), seed=11)
    cfg = dsio.IOConfig(staging_buffer_bytes=MIB, pool_bytes=4 * MIB, block_size=256 << 10)
    async with dsio.AsyncIOHandle(cfg) as h:
        s0 = h._engine.statistics()["submitted"]
        await h.pwrite(src, path)
        s1 = h._engine.statistics()["submitted"]
        dst = unaligned_tensor(8 * MIB)
        await h.pread(dst, path)
        s2 = h._engine.statistics()["submitted"]
    assert torch.equal(dst, src)
    assert (s1 - s0, s2 - s1) == (8, 1)
