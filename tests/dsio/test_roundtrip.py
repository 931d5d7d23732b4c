"""Round trips for every backend x sizes x dtypes x aligned/unaligned memory x file offsets."""

import os

import pytest
import torch
from _dsio_helpers import aligned_tensor, fill_random, unaligned_tensor

import dsio

# Small blocks and staging buffers so that even small tensors cross piece and chunk boundaries.
SMALL = dict(block_size=16384, queue_depth=8, pool_bytes=4 * 65536, staging_buffer_bytes=65536)

BYTE_SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3, 3 * 65536 + 4096 * 5 + 17]
DTYPES = [torch.uint8, torch.float32, torch.bfloat16, torch.int64, torch.float16]
OFFSETS = [None, 0, 4096, 4099]


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    return max(1, nbytes // torch.empty(0, dtype=dtype).element_size())


@pytest.mark.parametrize("intra", [1, 3])
async def test_roundtrip_matrix(backend, data_dir, intra):
    cfg = dsio.IOConfig(backend=backend, intra_op_parallelism=intra, **SMALL)
    async with dsio.AsyncIOHandle(cfg) as h:
        assert h.backend == backend
        case = 0
        for dtype in DTYPES:
            for nb in BYTE_SIZES:
                n = _numel(nb, dtype)
                esize = torch.empty(0, dtype=dtype).element_size()
                for make in (aligned_tensor, unaligned_tensor):
                    for off in OFFSETS:
                        case += 1
                        path = os.path.join(data_dir, f"c{case}.bin")
                        src = fill_random(make(n * esize, dtype), seed=case)
                        assert await h.pwrite(src, path, off) == n * esize
                        if off is None:
                            assert os.path.getsize(path) == n * esize
                        else:
                            assert os.path.getsize(path) == off + n * esize
                        dst = make(n * esize, dtype)
                        assert await h.pread(dst, path, off or 0) == n * esize
                        assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8)), (dtype, nb, off)
        st = h.statistics()
        assert st.errors == 0 and st.in_flight == 0
        assert st.written_bytes == st.read_bytes > 0
        # Every route was taken: aligned memory went direct, unaligned memory through the pool.
        assert st.direct_bytes > 0 and st.staged_bytes > 0 and st.buffered_bytes > 0
        assert st.pool.in_use == 0


async def test_replace_shrinks_file_and_offset_write_keeps_it(data_dir):
    path = os.path.join(data_dir, "f.bin")
    async with dsio.AsyncIOHandle() as h:
        big = fill_random(torch.empty(3 * 4096 + 5, dtype=torch.uint8), 1)
        await h.pwrite(big, path)
        small = fill_random(torch.empty(100, dtype=torch.uint8), 2)
        await h.pwrite(small, path, offset=10)  # in place: size unchanged, bytes patched
        assert os.path.getsize(path) == big.numel()
        expect = big.clone()
        expect[10:110] = small
        back = torch.empty_like(big)
        await h.pread(back, path)
        assert torch.equal(back, expect)
        await h.pwrite(small, path)  # replace: exactly the new size (DeepSpeed keeps the tail)
        assert os.path.getsize(path) == 100


async def test_zero_bytes_and_scalar(data_dir):
    async with dsio.AsyncIOHandle() as h:
        p = os.path.join(data_dir, "z.bin")
        assert await h.pwrite(torch.empty(0), p) == 0
        assert os.path.getsize(p) == 0
        s = torch.tensor(3.5, dtype=torch.float64)
        assert await h.pwrite(s, p) == 8
        back = torch.tensor(0.0, dtype=torch.float64)
        await h.pread(back, p)
        assert back.item() == 3.5


async def test_fsync_and_open_file_ops(data_dir):
    async with dsio.AsyncIOHandle(**SMALL) as h:
        parts = [fill_random(torch.empty(5000 + i, dtype=torch.uint8), i) for i in range(16)]
        offs = [sum(p.numel() for p in parts[:i]) for i in range(len(parts))]
        path = os.path.join(data_dir, "big.bin")
        async with h.open(path, "w") as f:
            assert f.direct
            import asyncio

            await asyncio.gather(*(f.pwrite(p, offset=o) for p, o in zip(parts, offs)))
            await f.fsync()
            assert f.size == sum(p.numel() for p in parts)
        async with h.open(path, "r") as f:
            backs = [torch.empty_like(p) for p in parts]
            await asyncio.gather(*(f.pread(b, offset=o) for b, o in zip(backs, offs)))
        assert all(torch.equal(a, b) for a, b in zip(parts, backs))
        await h.pwrite(parts[0], path, fsync=True)
        assert h.statistics().engine.fsync.ops == 2
