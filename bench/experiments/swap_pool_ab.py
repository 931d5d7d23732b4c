"""Swap-style direct reads into 4 KiB-page vs huge-page pinned pools, interleaved (issues 11 and 17).

    python bench/experiments/swap_pool_ab.py [reps]        # ~1 min; needs root to drop the page cache

The offload swappers read 32 MiB slots with O_DIRECT into buffers of a `PinnedPool`, a few in
flight. This reads a 512 MiB file that way (4 buffers of 32 MiB, 4 reads in flight) through three
pools of each kind, pool by pool in every rep, the page cache dropped and checked before each read,
and prints per-pool GB/s and per-kind medians.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

import dsio  # noqa: E402
from bench._common import drop_caches_verified, scratch_dir  # noqa: E402
from bench.io_read_path import prepare  # noqa: E402
from dsio.pool import PinnedPool  # noqa: E402

SIZE = 512 << 20
BUF = 32 << 20
POOLS = 3
KINDS = ("4k", "huge")


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    d = scratch_dir()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "swap-ab.bin")
    prepare(path, 0, SIZE)
    pools = {f"{k}-{i}": PinnedPool(4 * BUF, BUF, hugepage=k == "huge") for i in range(POOLS) for k in KINDS}
    leases = {n: [p.try_acquire() for _ in range(4)] for n, p in pools.items()}  # each pool's 4 buffers, held
    bufs = {n: [lease.tensor for lease in ls if lease is not None] for n, ls in leases.items()}
    loop = asyncio.new_event_loop()
    h = dsio.AsyncIOHandle()

    async def read_all(bs: list[torch.Tensor]) -> None:
        async def one(k: int) -> None:
            for off in range(k * BUF, SIZE, 4 * BUF):
                await h.pread(bs[k], path, off)

        await asyncio.gather(*(one(k) for k in range(4)))

    res: dict[str, list[float]] = {}
    try:
        for _ in range(reps):
            for n, bs in bufs.items():
                if not drop_caches_verified(path):
                    raise SystemExit("the page cache could not be dropped (run as root)")
                t0 = time.perf_counter()
                loop.run_until_complete(read_all(bs))
                res.setdefault(n, []).append(SIZE / (time.perf_counter() - t0) / 1e9)
    finally:
        loop.run_until_complete(h.aclose())
        loop.close()
        os.unlink(path)
    for kind in KINDS:
        xs = [x for n, v in res.items() if n.startswith(kind) for x in v]
        per = {n: [round(x, 2) for x in v] for n, v in res.items() if n.startswith(kind)}
        huge = [p.statistics().hugepages for n, p in pools.items() if n.startswith(kind)]
        print(
            f"{kind:5s} median {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) GB/s  {per}  huge pages: {huge}"
        )


if __name__ == "__main__":
    main()
