"""A/B of two (or more) builds of dsio, interleaved rep by rep: how a regression is bisected.

    python bench/experiments/io_version_ab.py --site old=/path/site-old --site new=/path/site-new \
        [--size-mib 1024] [--reps 5] [--cases write,overwrite,read] [--dir DIR] [--json OUT]

Each ``--site`` is a directory holding one build of the ``dsio`` package (an unpacked wheel,
e.g. ``pip wheel --no-build-isolation --no-deps -w W <worktree>`` then ``unzip W/*.whl -d SITE``).
One server process per site imports that build (``PYTHONPATH=SITE``, checked) and keeps one
``AsyncIOHandle(IOConfig())``, one ordinary tensor (``torch.randn``: 64 mod 4096, staged) and
one locked page-aligned buffer for its whole life; the driver asks every server in turn for each
case, rep by rep, dropping the page cache (verified) before reads. Output: GB/s per rep, and per
case the median of per-rep ratios to the first site.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as S
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench._common import drop_caches_verified, scratch_dir  # noqa: E402

SERVER = r"""
import asyncio, json, os, sys, time
# The venv's editable install of the working tree redirects "dsio" through a meta-path finder
# that PYTHONPATH does not override: drop it so that this site's build is the one imported.
sys.meta_path[:] = [f for f in sys.meta_path if "Redirect" not in type(f).__name__]
sys.path.insert(0, os.environ["PYTHONPATH"])
import torch
import dsio
try:
    from dsio._native import native
    C = native()
except ImportError:
    C = dsio._C
size = int(sys.argv[1])
plain = torch.randn(size // 4)
locked = torch.frombuffer(C.AlignedBuffer(size, True), dtype=torch.uint8)
locked.fill_(7)
loop = asyncio.new_event_loop()
h = dsio.AsyncIOHandle(dsio.IOConfig())
print(json.dumps({"ready": True, "dsio": dsio.__file__}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    buf = plain if req["buf"] == "ordinary" else locked
    path = req["path"]
    if req["case"] == "write":
        if os.path.exists(path):
            os.unlink(path)
        coro = h.pwrite(buf, path)
    elif req["case"] == "overwrite":
        coro = h.pwrite(buf, path, offset=0)
    else:
        coro = h.pread(buf, path)
    t0 = time.perf_counter()
    loop.run_until_complete(coro)
    dt = time.perf_counter() - t0
    print(json.dumps({"gbps": size / dt / 1e9}), flush=True)
loop.run_until_complete(h.aclose())
"""


class Server:
    def __init__(self, name: str, site: str, size: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(site), OMP_NUM_THREADS="1")
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )
        hello = self._line()
        where = os.path.realpath(hello["dsio"])
        if not where.startswith(os.path.realpath(site)):
            raise RuntimeError(f"site {name} imported dsio from {where}, not {site}")

    def _line(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server {self.name} exited (rc {self.proc.poll()})")
        return json.loads(line)

    def call(self, **req: object) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return float(self._line()["gbps"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", action="append", required=True, help="NAME=DIR (repeat; the first is the base)")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="write,overwrite,read")
    ap.add_argument("--bufs", default="ordinary,locked")
    ap.add_argument("--dir", default=scratch_dir())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    size = args.size_mib << 20
    sites = [s.split("=", 1) for s in args.site]
    os.makedirs(args.dir, exist_ok=True)
    servers = [Server(n, d, size) for n, d in sites]
    res: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps):
            for case in args.cases.split(","):
                for buf in args.bufs.split(","):
                    order = servers if rep % 2 == 0 else servers[::-1]  # alternate who goes first
                    for s in order:
                        path = os.path.join(args.dir, f"vab-{s.name}.bin")
                        if case == "read":
                            drop_caches_verified(path)
                        gbps = s.call(case=case, buf=buf, path=path)
                        res.setdefault(f"{case}|{buf}|{s.name}", []).append(gbps)
                        print(
                            f"rep {rep} {case} {buf} {s.name}: {gbps:.2f} GB/s", file=sys.stderr, flush=True
                        )
    finally:
        for s in servers:
            s.close()
        for n, _ in sites:
            p = os.path.join(args.dir, f"vab-{n}.bin")
            if os.path.exists(p):
                os.unlink(p)
    base = sites[0][0]
    print(
        "| case | buffer | build | GB/s median (min-max) | ratio to " + base + " per rep, median (min-max) |"
    )
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        for buf in args.bufs.split(","):
            ref = res[f"{case}|{buf}|{base}"]
            for n, _ in sites:
                xs = res[f"{case}|{buf}|{n}"]
                r = [a / b for a, b in zip(xs, ref, strict=True)]
                print(
                    f"| {case} | {buf} | {n} | {S.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) | "
                    f"{S.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) |"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "reps": args.reps, "sites": dict(sites), "gbps": res}, f, indent=1)


if __name__ == "__main__":
    main()
