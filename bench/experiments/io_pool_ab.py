"""Staged reads through a staging pool on 4 KiB pages vs on huge pages (issue 17), interleaved.

    python bench/experiments/io_pool_ab.py [--size-mib 512] [--handles 3] [--reps 2] [--dests locked,touched,fresh]

A staged read's speed turned out to depend on the staging pool a handle got: one process's
handles, reading into the same touched tensor, ran 1.2-2.0 GB/s, each pool steady across reps.
So this makes ``--handles`` handles of each kind (``PinnedPool(hugepage=False)`` vs the default
huge-page pool) and reads, rep by rep, every destination through every handle (the page cache
dropped and checked before each read). ``locked`` is the direct path (one handle of each kind:
the pool is not used). Prints per-handle GB/s and per-kind medians; the JSON lines go to
``--out`` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

import dsio  # noqa: E402
import dsio.pool  # noqa: E402
from bench._common import drop_caches_verified, scratch_dir  # noqa: E402
from bench.io_read_path import prepare  # noqa: E402
from dsio._native import native  # noqa: E402
from dsio._tuning import SWITCHES  # noqa: E402

KINDS = ("4k", "huge")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--handles", type=int, default=3, help="handles (pools) of each kind")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dests", default="locked,touched,fresh")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()
    size = args.size_mib << 20
    d = args.dir or scratch_dir()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"pool-ab-{args.size_mib}.bin")
    prepare(path, 0, size)
    loop = asyncio.new_event_loop()
    handles: dict[str, dsio.AsyncIOHandle] = {}
    for i in range(args.handles):
        for kind in KINDS:
            SWITCHES.hugepages = kind == "huge"
            handles[f"{kind}-{i}"] = dsio.AsyncIOHandle()
    SWITCHES.hugepages = True
    locked = torch.frombuffer(native().AlignedBuffer(size, True), dtype=torch.uint8)
    locked.fill_(3)
    touched = torch.empty(size, dtype=torch.uint8)
    touched.fill_(1)
    dests = [x.strip() for x in args.dests.split(",") if x.strip()]
    res: dict[tuple[str, str], list[float]] = {}
    out = open(args.out, "a") if args.out else None  # noqa: SIM115
    try:
        for rep in range(args.reps):
            for dest in dests:
                for name, h in handles.items():
                    if dest == "locked" and not name.endswith("-0"):
                        continue
                    cold = drop_caches_verified(path)
                    t = (
                        locked
                        if dest == "locked"
                        else touched
                        if dest == "touched"
                        else torch.empty(size, dtype=torch.uint8)
                    )
                    t0 = time.perf_counter()
                    loop.run_until_complete(h.pread(t, path))
                    gbps = size / (time.perf_counter() - t0) / 1e9
                    del t
                    res.setdefault((dest, name), []).append(gbps)
                    rec = {"dest": dest, "pool": name, "rep": rep, "gbps": gbps, "cold": cold}
                    rec["hugepages"] = h.statistics().pool.hugepages
                    if out:
                        out.write(json.dumps(rec) + "\n")
    finally:
        if out:
            out.close()
        for h in handles.values():
            loop.run_until_complete(h.aclose())
        loop.close()
        os.unlink(path)
    for dest in dests:
        for kind in KINDS:
            per = {n: v for (dd, n), v in res.items() if dd == dest and n.startswith(kind)}
            xs = [x for v in per.values() for x in v]
            if xs:
                cells = " ".join(f"{n}={'/'.join(f'{x:.2f}' for x in v)}" for n, v in per.items())
                print(
                    f"{dest:8s} {kind:5s} median {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})  {cells}"
                )


if __name__ == "__main__":
    main()
