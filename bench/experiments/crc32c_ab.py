"""GB/s per core of each crc32c path of this machine (issue 31: the checksum's CPU is the gap of a
verified load): ``avx512`` (dsio's native core, VPCLMULQDQ folds) vs ``portable`` (the ``crc32c``
package), one thread, in rotating order rep by rep.

- ``in cache``: one span checksummed over and over (``--span``, default 32 MiB: L3-sized here;
  1 MiB is one checksum block of a save, checksummed in L2 right after its copy)
- ``out of cache``: ``--pool`` bytes (default 1 GiB, well past L3) of fresh 32 MiB spans, each
  checksummed once per pass (the load's case: bytes just read from disk)

    .venv/bin/python bench/experiments/crc32c_ab.py                  # 32 MiB in cache, 1 GiB out
    .venv/bin/python bench/experiments/crc32c_ab.py --span 1048576 --reps 9

Prints per path and case the best and median GB/s over the reps, and each rep's avx512/portable
ratio (the ratio within a rep is what a loaded machine still measures fairly), plus the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from dsio.checkpoint._integrity import crc_path, crc_paths  # noqa: E402

GB = 1e9
MiB = 1 << 20


def gbps(fn, spans: list[torch.Tensor], passes: int) -> float:
    nbytes = sum(s.numel() for s in spans) * passes
    t = time.perf_counter()
    for _ in range(passes):
        for s in spans:
            fn(s.data_ptr(), s.numel(), 0)
    return nbytes / (time.perf_counter() - t) / GB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--span", type=int, default=32 * MiB, help="bytes of one span (default 32 MiB)")
    p.add_argument(
        "--pool", type=int, default=1 << 30, help="bytes of the out-of-cache spans (default 1 GiB)"
    )
    p.add_argument("--reps", type=int, default=5, help="reps; each runs every path once per case (default 5)")
    p.add_argument("--inner", type=int, default=8, help="passes over the in-cache span per rep (default 8)")
    args = p.parse_args()
    paths = crc_paths()
    hot = torch.randint(0, 256, (args.span,), dtype=torch.uint8)
    cold = [
        torch.randint(0, 256, (32 * MiB,), dtype=torch.uint8) for _ in range(max(1, args.pool // (32 * MiB)))
    ]
    names = list(paths)
    for fn in paths.values():  # warm: constants, first calls
        gbps(fn, [hot], 1)
    rates: dict[tuple[str, str], list[float]] = {
        (n, c): [] for n in names for c in ("in cache", "out of cache")
    }
    ratios: dict[str, list[float]] = {"in cache": [], "out of cache": []}
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        got: dict[tuple[str, str], float] = {}
        for n in order:
            got[(n, "in cache")] = gbps(paths[n], [hot], args.inner)
            got[(n, "out of cache")] = gbps(paths[n], cold, 1)
        for k, v in got.items():
            rates[k].append(v)
        if "avx512" in paths:
            for c in ratios:
                ratios[c].append(got[("avx512", c)] / got[("portable", c)])
    load = os.getloadavg()
    print(
        f"chosen path: {crc_path()}; span {args.span} B in cache, {len(cold)} x 32 MiB out of cache; "
        f"{args.reps} reps; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"
    )
    print("| path | case | best GB/s | median GB/s |")
    print("| --- | --- | --- | --- |")
    for (n, c), v in rates.items():
        print(f"| {n} | {c} | {max(v):.2f} | {statistics.median(v):.2f} |")
    for c, r in ratios.items():
        if r:
            print(
                f"avx512 / portable, {c}, per rep: "
                + " ".join(f"{x:.2f}" for x in r)
                + f" (median {statistics.median(r):.2f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
