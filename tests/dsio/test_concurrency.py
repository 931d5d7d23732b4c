"""1,000 concurrent operations on one handle: one open file at offsets, and many files."""

import asyncio
import os

import torch
from _dsio_helpers import fill_random

import dsio


async def test_thousand_ops_one_file(backend, data_dir):
    async with dsio.AsyncIOHandle(backend=backend, queue_depth=16, intra_op_parallelism=2) as h:
        size = 8192 + 8  # not a multiple of 4096: heads and tails everywhere
        parts = [fill_random(torch.empty(size, dtype=torch.uint8), i) for i in range(1000)]
        path = os.path.join(data_dir, "one.bin")
        async with h.open(path, "w+") as f:
            await asyncio.gather(*(f.pwrite(p, offset=i * size) for i, p in enumerate(parts)))
            assert f.size == 1000 * size
            backs = [torch.empty(size, dtype=torch.uint8) for _ in parts]
            await asyncio.gather(*(f.pread(b, offset=i * size) for i, b in enumerate(backs)))
        assert all(torch.equal(a, b) for a, b in zip(parts, backs))
        assert h.statistics().writes == 1000


async def test_thousand_ops_many_files(data_dir, many_fds):  # many_fds: ~1,000 fds at once
    async with dsio.AsyncIOHandle(queue_depth=32) as h:
        ts = [torch.full((1024 + i,), float(i)) for i in range(1000)]
        paths = [os.path.join(data_dir, f"f{i}.bin") for i in range(1000)]
        written = await asyncio.gather(*(h.pwrite(t, p) for t, p in zip(ts, paths)))
        assert written == [t.nbytes for t in ts]
        backs = [torch.empty_like(t) for t in ts]
        await asyncio.gather(*(h.pread(b, p) for b, p in zip(backs, paths)))
        assert all(torch.equal(a, b) for a, b in zip(ts, backs))
