"""``dsio tune``: sweep the engine's settings on one disk and write the best dstrain ``"aio"`` block.

Successive halving over backend x block size x queue depth x workers x submit mode: every point
is screened on a small transfer, survivors grow to the full size, and the finalists are measured
for write AND read, interleaved, ``--reps`` times. The fastest read and the fastest write settings
are reported separately (and said to differ when they do); the emitted block favours what the user
names: ``--workload checkpoint`` (write), ``--workload offload`` (read), or a balanced score.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._cli_common import AIO_KEYS, CliError, buffer, check_dir, human, run

__all__ = ["Point", "Result", "WORKLOAD_GOALS", "pick", "tune"]

#: What each ``--workload`` makes the emitted block favour.
WORKLOAD_GOALS = {"checkpoint": "write", "offload": "read"}


async def _timed(f: Any, op: str, view: Any, offset: int) -> float:
    t0 = time.perf_counter()
    if op == "write":
        await f.pwrite(view, offset)
    else:
        await f.pread(view, offset)
    return time.perf_counter() - t0


def _goal(args: argparse.Namespace) -> str:
    workload = getattr(args, "workload", None)
    if workload is not None:
        return WORKLOAD_GOALS[workload]
    return getattr(args, "optimize", None) or "balanced"


@dataclasses.dataclass(frozen=True)
class Point:
    backend: str
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool

    def config(self) -> Any:
        from .config import IOConfig

        return IOConfig(
            backend=self.backend,
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            intra_op_parallelism=self.intra_op_parallelism,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
            pool_bytes=1 << 20,  # tune/bench use aligned buffers: no staging needed
            staging_buffer_bytes=1 << 20,
        )

    def aio(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in AIO_KEYS}

    def label(self) -> str:
        return (
            f"{self.backend} bs={human(self.block_size)} qd={self.queue_depth} par={self.intra_op_parallelism} "
            f"ss={int(self.single_submit)} oe={int(self.overlap_events)}"
        )


@dataclasses.dataclass
class Result:
    point: Point
    op: str
    rung: int
    nbytes: int
    gbps: list[float]
    status: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.gbps)


def _grid(args: argparse.Namespace) -> list[Point]:
    modes = [(False, True), (True, True), (False, False)]
    pts = [
        Point(be, bs, qd, par, ss, oe)
        for be, bs, qd, par, (ss, oe) in itertools.product(
            args.backends, args.block_sizes, args.queue_depths, args.parallelism, modes
        )
        if bs <= args.size
    ]
    if not pts:
        raise CliError("the sweep is empty: every --block-sizes value is larger than --size")
    return pts


async def _run_rung(
    points: list[Point], ops: Sequence[str], nbytes: int, reps: int, path: str, size: int, buf: Any, bar: Any
) -> dict[tuple[Point, str], list[float]]:
    """Measure every (point, op) ``reps`` times, interleaved: rep 1 of every point, then rep 2..."""
    from .handle import AsyncIOHandle

    out: dict[tuple[Point, str], list[float]] = {}
    slots = max(1, size // nbytes)
    k = 0
    for _rep in range(reps):
        for p in points:
            async with AsyncIOHandle(p.config()) as h, h.open(path, "r+") as f:
                for op in ops:
                    offset = (k % slots) * nbytes  # walk the file so no region is re-read hot
                    k += 1
                    dt = await _timed(f, op, buf[:nbytes], offset)
                    out.setdefault((p, op), []).append(nbytes / dt / 1e9)
                    bar.update(1)
    return out


def tune(args: argparse.Namespace) -> int:
    """Run ``dsio tune`` (arguments from :func:`dsio.cli.build_parser`); returns the exit status."""
    from . import backend_status

    args.optimize = _goal(args)

    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise CliError(
                "--gpu needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)"
            )
    avail = {b.name: b for b in backend_status()}
    if args.backends is None:
        args.backends = [n for n in ("io_uring", "aio", "posix") if avail[n].available]
    for name in args.backends:
        if not avail[name].available:
            raise CliError(f"backend {name} is unavailable here: {avail[name].reason}")
    directory = check_dir(args.dir, args.size + (64 << 20))
    out_prefix = os.path.abspath(args.out)
    out_dir = os.path.dirname(out_prefix)
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise CliError(f"cannot write results to {out_dir} (set --out PREFIX)")
    points = _grid(args)
    tqdm = _progress_bar()

    random.Random(0).shuffle(points)  # noise must not line up with a parameter
    path = os.path.join(directory, f".dsio-tune-{os.getpid()}.bin")
    t_start = time.perf_counter()
    results: list[Result] = []
    # Successive halving: screen everything on a small transfer, then grow the transfer and keep
    # only points within reach of the best. The final rung measures read AND write for the union
    # of survivors, interleaved, `reps` times.
    probe = max(args.size // 16, min(args.size, 16 << 20))
    rungs = [(probe, 1, 0.55), (max(probe, args.size // 4), 1, 0.75), (args.size, args.reps, 0.0)]
    try:
        buf = buffer(args.size, args.gpu)
        run(_fill(path, buf))  # uvloop when importable, like every loop dsio starts
        alive = {op: list(points) for op in ("read", "write")}
        for r, (nbytes, reps, keep) in enumerate(rungs):
            final = r == len(rungs) - 1
            if final:
                union = list(
                    dict.fromkeys(alive["write"][: args.finalists] + alive["read"][: args.finalists])
                )
                # The aio block cannot name a backend, so the one "auto" picks must reach the final
                # rung: add its best point of the last rung it ran in, for each op, if none survived.
                auto = next((n for n in ("io_uring", "aio", "posix") if avail[n].available), None)
                for op in ("write", "read"):
                    mine = [x for x in results if x.op == op and x.point.backend == auto]
                    prev = [x for x in mine if x.rung == max(y.rung for y in mine)] if mine else []
                    if prev and not any(p.backend == auto for p in alive[op][: args.finalists]):
                        best_auto = max(prev, key=lambda x: x.median)
                        best_auto.status = f"kept (best {auto}: the backend the aio block gets)"
                        if best_auto.point not in union:
                            union.append(best_auto.point)
                plan: list[tuple[list[Point], tuple[str, ...]]] = [(union, ("write", "read"))]
            else:
                both = [p for p in points if p in alive["write"] and p in alive["read"]]
                only = [(p, op) for op in ("write", "read") for p in alive[op] if p not in both]
                plan = [(both, ("write", "read"))]
                plan += [([p], (op,)) for p, op in only]
            total = sum(len(pts) * len(ops) for pts, ops in plan) * reps
            desc = f"rung {r + 1}/{len(rungs)}: {human(nbytes)} x {reps}"
            with tqdm(total=total, desc=desc, unit="op", disable=args.quiet, file=sys.stderr) as bar:
                measured: dict[tuple[Point, str], list[float]] = {}
                for pts, ops in plan:
                    measured.update(run(_run_rung(pts, ops, nbytes, reps, path, args.size, buf, bar)))
            for op in ("write", "read"):
                rs = [Result(p, op, r, nbytes, v) for (p, o), v in measured.items() if o == op]
                rs.sort(key=lambda x: x.median, reverse=True)
                best = rs[0].median if rs else 0.0
                survivors: list[Point] = []
                for res in rs:
                    if final:
                        res.status = "final"
                    elif res.median >= keep * best and len(survivors) < max(args.finalists, len(rs) // 4):
                        res.status = "kept"
                        survivors.append(res.point)
                    else:
                        res.status = f"early-stopped ({res.median / best:.2f}x best)"
                results.extend(rs)
                alive[op] = survivors
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    elapsed = time.perf_counter() - t_start
    return _tune_report(args, results, avail, elapsed, out_prefix)


async def _fill(path: str, buf: Any) -> None:
    """Lay the file out once (so later writes overwrite: no block allocation in the numbers)."""
    from .handle import AsyncIOHandle

    async with AsyncIOHandle() as h:
        await h.pwrite(buf, path, fsync=True)


def pick(results: list[Result], backend: str | None, optimize: str) -> tuple[Point, dict[str, float]] | None:
    final = [r for r in results if r.status == "final"]
    by_point: dict[Point, dict[str, float]] = {}
    for r in final:
        by_point.setdefault(r.point, {})[r.op] = r.median
    best = {op: max((r.median for r in final if r.op == op), default=0.0) for op in ("read", "write")}

    def score(p: Point) -> float:
        v = by_point[p]
        if optimize in ("read", "write"):
            return v.get(optimize, 0.0)
        if "read" not in v or "write" not in v or not best["read"] or not best["write"]:
            return 0.0
        return math.sqrt(v["read"] / best["read"] * v["write"] / best["write"])

    cands = [p for p in by_point if backend is None or p.backend == backend]
    if not cands:
        return None
    p = max(cands, key=score)
    return p, by_point[p]


def _tune_report(
    args: argparse.Namespace, results: list[Result], avail: dict[str, Any], elapsed: float, prefix: str
) -> int:
    final = [r for r in results if r.status == "final"]
    print(
        f"dsio tune: {len({r.point for r in results})} points, {len(final) // 2} finalists, {elapsed:.0f} s"
    )
    for op in ("write", "read"):
        rs = sorted((r for r in final if r.op == op), key=lambda r: r.median, reverse=True)
        if rs:
            b = rs[0]
            print(
                f"  best {op:<5} {b.median:6.2f} GB/s  {b.point.label()}  (min {min(b.gbps):.2f}, max {max(b.gbps):.2f})"
            )
    auto = next((n for n in ("io_uring", "aio", "posix") if avail[n].available), None)
    picked = pick(results, auto, args.optimize)
    overall = pick(results, None, args.optimize)
    if picked is None:
        picked = overall
    assert picked is not None
    p, v = picked
    block = {"aio": p.aio()}
    with open(prefix + ".json", "w") as f:
        json.dump(block, f, indent=2)
        f.write("\n")
    print(
        f"  aio block (favours {args.optimize}, backend {p.backend}): write {v.get('write', 0):.2f} GB/s, "
        f"read {v.get('read', 0):.2f} GB/s -> {prefix}.json"
    )
    print("  " + json.dumps(block))
    if overall is not None and overall[0].backend != p.backend:
        print(
            f"  note: the {overall[0].backend} backend scored best overall; the aio block cannot choose a "
            f"backend (dsio's auto picks {auto}); use IOConfig(backend={overall[0].backend!r}) in code for it"
        )
    _say_read_vs_write(results, auto, args, p)
    fields = [
        "backend",
        *AIO_KEYS,
        "op",
        "rung",
        "bytes",
        "reps",
        "gbps_median",
        "gbps_min",
        "gbps_max",
        "status",
    ]
    with open(prefix + ".csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(fields)
        for r in results:
            pt = dataclasses.asdict(r.point)
            w.writerow(
                [pt["backend"], *(pt[k] for k in AIO_KEYS), r.op, r.rung + 1, r.nbytes, len(r.gbps)]
                + [f"{r.median:.4f}", f"{min(r.gbps):.4f}", f"{max(r.gbps):.4f}", r.status]
            )
    try:
        _plot(results, p, prefix + ".png")
        print(f"  every point: {prefix}.csv   plot: {prefix}.png")
    except ImportError:
        print(f"  every point: {prefix}.csv   (no plot: matplotlib is not installed; pip install matplotlib)")
    return 0


def best_by_op(results: list[Result], backend: str | None) -> dict[str, Result]:
    """The final-rung winner of each op (``read``, ``write``), on ``backend`` (None: any)."""
    out: dict[str, Result] = {}
    for r in results:
        if r.status != "final" or (backend is not None and r.point.backend != backend):
            continue
        if r.op not in out or r.median > out[r.op].median:
            out[r.op] = r
    return out


def _say_read_vs_write(
    results: list[Result], backend: str | None, args: argparse.Namespace, chosen: Point
) -> None:
    """Print the fastest read and write settings on the block's backend, and say when they differ."""
    best = best_by_op(results, backend) or best_by_op(results, None)
    if "read" not in best or "write" not in best:
        return
    r, w = best["read"], best["write"]
    if r.point.aio() == w.point.aio():
        print(f"  fastest read and write settings agree: {json.dumps(r.point.aio())}")
        return
    favours = {"read": "read (offload)", "write": "write (checkpoint)", "balanced": "balanced"}[args.optimize]
    print("  note: the fastest READ and WRITE settings differ:")
    print(f"    read  {r.median:6.2f} GB/s  {json.dumps(r.point.aio())}")
    print(f"    write {w.median:6.2f} GB/s  {json.dumps(w.point.aio())}")
    print(
        f"    the aio block favours {favours}: {json.dumps(chosen.aio())}; pass --workload offload for the read "
        "settings, --workload checkpoint for the write settings"
    )


def _progress_bar() -> Any:
    """tqdm when installed, else a silent stand-in (progress is a nicety, not a dependency)."""
    try:
        from tqdm import tqdm

        return tqdm
    except ImportError:

        class _Quiet:
            def __init__(self, *a: Any, **k: Any) -> None: ...
            def update(self, n: int = 1) -> None: ...
            def __enter__(self) -> _Quiet:
                return self

            def __exit__(self, *exc: object) -> None: ...

        return _Quiet


def _plot(results: list[Result], chosen: Point, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    colors = {"io_uring": "tab:blue", "aio": "tab:orange", "posix": "tab:green"}
    for ax, op in zip(axes, ("write", "read")):
        first = {r.point: r.median for r in results if r.op == op and r.rung == 0}
        order = sorted(first, key=lambda p: first[p], reverse=True)
        x_of = {p: i for i, p in enumerate(order)}
        last: dict[Point, Result] = {}
        for r in results:
            if r.op == op and r.point in x_of:
                last[r.point] = r
        for be, color in colors.items():
            xs = [x_of[p] for p in order if p.backend == be]
            ys = [first[p] for p in order if p.backend == be]
            if xs:
                ax.scatter(xs, ys, s=10, color=color, alpha=0.35, label=f"{be} (screening)")
        for p, r in last.items():
            if r.status == "final":
                lo, hi = r.median - min(r.gbps), max(r.gbps) - r.median
                ax.errorbar(
                    x_of[p], r.median, yerr=[[lo], [hi]], fmt="o", color=colors.get(p.backend, "k"), ms=5
                )
        if chosen in last:
            ax.scatter([x_of[chosen]], [last[chosen].median], marker="*", s=250, color="red", zorder=5,
                       label="chosen: " + chosen.label())  # fmt: skip
        ax.set_title(f"{op}: points by screening rank (dots), finalists (error bars: min-max)")
        ax.set_xlabel("point (sorted by screening GB/s)")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
