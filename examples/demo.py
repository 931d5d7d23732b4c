"""dsio demo: write and read a few GiB of tensors concurrently and print GB/s.

make demo                         # or: python examples/demo.py --dir /path --gib 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time

import torch
from tqdm import tqdm

import dsio


async def main(directory: str, gib: float, count: int) -> None:
    per = int(gib * (1 << 30)) // count // 4  # float32 elements per tensor
    tensors = [torch.randn(per) for _ in range(count)]  # ordinary (unaligned, unpinned) tensors
    paths = [os.path.join(directory, f"tensor-{i:03d}.bin") for i in range(count)]
    total = sum(t.nbytes for t in tensors)
    cfg = dsio.IOConfig(queue_depth=32, intra_op_parallelism=2)
    async with dsio.AsyncIOHandle(cfg) as h:
        print(
            f"dsio {dsio.__version__}: backend={h.backend}, {count} tensors, {total / 2**30:.2f} GiB in {directory}"
        )

        async def timed(op, what: str) -> float:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=what)

            async def one(t, p):
                n = await op(t, p)
                bar.update(n)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(t, p) for t, p in zip(tensors, paths)))
            dt = time.perf_counter() - t0
            bar.close()
            return total / dt / 1e9

        w = await timed(lambda t, p: h.pwrite(t, p, fsync=True), "write")
        backs = [torch.empty_like(t) for t in tensors]
        reads = []
        for what in ("read ", "again"):
            it = iter(backs)
            reads.append(await timed(lambda _t, p, it=it: h.pread(next(it), p), what))
        ok = all(torch.equal(a, b) for a, b in zip(tensors, backs))
        st = h.statistics()
    print(
        f"write (durable): {w:.2f} GB/s   read: {reads[0]:.2f} GB/s, again: {reads[1]:.2f} GB/s   verified: {ok}"
    )
    print(
        "(on virtual disks the first read right after a large write can be slow: the host is still writing back)"
    )
    print(
        f"routes: direct {st.direct_bytes / 2**30:.2f} GiB, staged {st.staged_bytes / 2**30:.2f} GiB, "
        f"buffered {st.buffered_bytes / 2**20:.2f} MiB; pool waits {st.pool.waited_total}"
    )
    if not ok:
        raise SystemExit("data mismatch")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory to write into (default: a temp dir under ./)")
    ap.add_argument("--gib", type=float, default=3.0, help="total GiB to write and read (default 3)")
    ap.add_argument("--count", type=int, default=24, help="number of tensors (default 24)")
    a = ap.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="dsio-demo-", dir=".")
    try:
        asyncio.run(main(d, a.gib, a.count))
    finally:
        if a.dir is None:
            shutil.rmtree(d, ignore_errors=True)
