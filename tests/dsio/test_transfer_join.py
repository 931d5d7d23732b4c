"""A transfer joins its pieces through ``_gather.wait_all``: whatever stops it (a refused
submission, a failed piece, the caller's cancellation), nothing of it is still reading into or
writing from the caller's memory once the call has ended.

The backend does not matter here (the join is Python). The staged path is used throughout
(ordinary tensors at an odd address, at an unaligned file offset): a buffered head and tail go
first, then the staged body (one ring request, or one request per pool buffer), so there is
always something in flight when the failure comes.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from _dsio_helpers import fill_random, unaligned_tensor

import dsio
from dsio._dispatch import READ
from dsio._tuning import SWITCHES

MIB = 1 << 20
# 1 MiB staging chunks, 4 in the pool: an 8 MiB transfer is 8 requests, at most 4 in flight.
SMALL = dict(block_size=256 << 10, queue_depth=4, pool_bytes=4 * MIB, staging_buffer_bytes=MIB)
SIZE = 8 * MIB
OFF = 100  # unaligned: a buffered head and tail around the O_DIRECT body


@pytest.fixture(params=["ring", "per-buffer"])
def staging(request, monkeypatch):
    """Both staged paths: one ring request (default), or one request per pool buffer."""
    monkeypatch.setattr(SWITCHES, "ring_staging", request.param == "ring")
    return request.param


class Injected(OSError):
    """The refusal injected into the third submission."""


def _refuse_third(h: dsio.AsyncIOHandle, seen: list[asyncio.Future], at_failure: list[int]) -> None:
    disp = h._disp
    real = disp.submit
    calls = [0]

    def submit(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            at_failure.append(sum(not f.done() for f in seen))
            raise Injected(5, "injected")
        fut = real(*args, **kwargs)
        seen.append(fut)
        return fut

    disp.submit = submit  # type: ignore[method-assign]


@pytest.mark.parametrize("op", ["read", "write"])
async def test_refused_submission_waits_for_the_pieces_in_flight(data_dir, op, staging):
    path = os.path.join(data_dir, "j.bin")
    src = fill_random(unaligned_tensor(SIZE), seed=3)
    async with dsio.AsyncIOHandle(dsio.IOConfig(**SMALL)) as h:
        await h.pwrite(src, path, offset=OFF)
        seen: list[asyncio.Future] = []
        at_failure: list[int] = []
        _refuse_third(h, seen, at_failure)
        with pytest.raises(Injected):
            if op == "read":
                await h.pread(unaligned_tensor(SIZE), path, OFF)
            else:
                await h.pwrite(src, path, offset=OFF)
        assert at_failure and at_failure[0] >= 1, "nothing was in flight when the submission failed"
        # The call raised only after every request it had started was done.
        assert all(f.done() for f in seen)
        assert not h._disp._entries
        assert h._pool.statistics().in_use == 0  # every staging buffer is back
        del h._disp.submit  # the handle works on
        dst = unaligned_tensor(SIZE)
        await h.pread(dst, path, OFF)
        assert torch.equal(dst, src)


async def test_cancelled_staged_read_leaves_nothing_in_flight(data_dir, staging):
    """After ``CancelledError`` reaches the caller, the kernel no longer writes into its tensor."""
    path = os.path.join(data_dir, "c.bin")
    src = fill_random(unaligned_tensor(SIZE), seed=4)
    async with dsio.AsyncIOHandle(dsio.IOConfig(**SMALL)) as h:
        await h.pwrite(src, path)
        dst = unaligned_tensor(SIZE)
        task = asyncio.ensure_future(h.pread(dst, path))
        for _ in range(1000):
            await asyncio.sleep(0)
            if h._disp._entries:
                break
        assert h._disp._entries, "the read never reached the engine"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not h._disp._entries  # drained before the cancellation propagated
        assert h._pool.statistics().in_use == 0
        before = dst.clone()
        await asyncio.sleep(0.05)
        assert torch.equal(dst, before)  # and nothing lands in it afterwards


async def test_failed_piece_stops_staging_and_is_raised_after_the_rest(data_dir, staging):
    """A read past the end of a file that shrank after the size check: the short piece is
    raised (ShortIOError) only once every other request of the read is done."""
    path = os.path.join(data_dir, "s.bin")
    src = fill_random(unaligned_tensor(SIZE), seed=5)
    async with dsio.AsyncIOHandle(dsio.IOConfig(**SMALL)) as h:
        await h.pwrite(src, path)
        seen: list[asyncio.Future] = []
        real = h._disp.submit

        def submit(op, *args, **kwargs):
            if op == READ and not seen:
                os.truncate(path, 2 * MIB + 4096)  # after check_readable, before any I/O
            fut = real(op, *args, **kwargs)
            seen.append(fut)
            return fut

        h._disp.submit = submit  # type: ignore[method-assign]
        copied = h._engine.statistics()["copy"]["bytes"]
        with pytest.raises(dsio.ShortIOError):
            await h.pread(unaligned_tensor(SIZE), path)
        assert seen and all(f.done() for f in seen)
        assert not h._disp._entries
        assert len(seen) < SIZE // MIB + 2  # staging stopped early instead of reading on
        # Nothing read (or copied) much past the 2 MiB the file still had.
        assert h._engine.statistics()["copy"]["bytes"] - copied <= 4 * MIB
