"""``dsio tune``: sweep the engine's settings on one disk and write the best dstrain ``"aio"`` block.

Successive halving over backend x block size x queue depth x workers x submit mode: every point
is screened on a small transfer, survivors grow to the full size, and the finalists are measured
for write AND read, interleaved, ``--reps`` times. The fastest read and the fastest write settings
are reported separately (and said to differ when they do); the emitted block favours what the user
names: ``--workload checkpoint`` (write), ``--workload offload`` (read), or a balanced score.
"""

from __future__ import annotations

import argparse
import asyncio
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

from ._cli_common import AIO_KEYS, CliError, buffer, check_dir, human, parse_size, run

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
    # both are dsio tune's options (one group: at most one given), None when not given
    if args.workload is not None:
        return WORKLOAD_GOALS[args.workload]
    return args.optimize or "balanced"


@dataclasses.dataclass(frozen=True)
class Point:
    backend: str
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool
    gpu_backend: str = "auto"  # "cufile" with --gds

    def config(self) -> Any:
        from .config import IOConfig

        return IOConfig(
            backend=self.backend,
            gpu_backend=self.gpu_backend,
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            intra_op_parallelism=self.intra_op_parallelism,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
            pool_bytes=1 << 20,  # tune/bench use aligned buffers: no staging needed
            staging_buffer_bytes=1 << 20,
        )

    def aio(self) -> dict[str, Any]:
        """The dstrain ``"aio"`` block of this point: DeepSpeed's keys, the tuned backend (a dsio key
        ``IOConfig.from_deepspeed`` reads) and ``use_gds`` when the sweep ran over cuFile."""
        block: dict[str, Any] = {k: getattr(self, k) for k in AIO_KEYS}
        block["backend"] = self.backend
        if self.gpu_backend == "cufile":
            block["use_gds"] = True
        return block

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


#: DeepSpeed's ds_nvme_tune sweep keys and what each becomes here.
SWEEP_KEYS = {
    "block_size": "block sizes",
    "queue_depth": "queue depths",
    "io_parallel": "intra_op_parallelism values",
    "single_submit": "single_submit values",
    "sequential_requests": "sequential_requests values (overlap_events = not sequential)",
}


def load_sweep_config(path: str) -> dict[str, list[Any]]:
    """A ``--sweep_config`` file in DeepSpeed's format (``{"block_size": ["1M", "8M"], "queue_depth":
    [32, 128], "sequential_requests": [true, false], "single_submit": [false, true], "io_parallel": [1,
    2]}``; every key optional), validated: unknown keys and values dsio's engine cannot run are errors."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise CliError(f"--sweep_config {path}: {e}") from None
    if not isinstance(raw, dict):
        raise CliError(f"--sweep_config {path}: expected a JSON object of lists")
    out: dict[str, list[Any]] = {}
    for key, values in raw.items():
        if key not in SWEEP_KEYS:
            raise CliError(f"--sweep_config {path}: unknown key {key!r} (accepted: {', '.join(SWEEP_KEYS)})")
        if not isinstance(values, list) or not values:
            raise CliError(f"--sweep_config {path}: {key} must be a non-empty list")
        conv: list[Any] = []
        for v in values:
            if key == "block_size":
                n = v if type(v) is int else parse_size(str(v)) if isinstance(v, str) else None
                if n is None or n < 4096 or n & (n - 1):
                    raise CliError(f"--sweep_config {path}: block_size {v!r} is not a power of two >= 4096")
                conv.append(n)
            elif key in ("queue_depth", "io_parallel"):
                if type(v) is not int or v < 1:
                    raise CliError(f"--sweep_config {path}: {key} {v!r} is not a positive int")
                conv.append(v)
            else:
                if not isinstance(v, bool):
                    raise CliError(f"--sweep_config {path}: {key} {v!r} is not true/false")
                conv.append(v)
        out[key] = conv
    return out


def _modes(args: argparse.Namespace) -> list[tuple[bool, bool]]:
    """(single_submit, overlap_events) pairs: from --sweep_config when it names them, else dsio's three."""
    sweep = args.sweep or {}
    if "single_submit" not in sweep and "sequential_requests" not in sweep:
        return [(False, True), (True, True), (False, False)]
    singles = sweep.get("single_submit", [False])
    overlaps = [not seq for seq in sweep.get("sequential_requests", [False])]
    return list(itertools.product(singles, overlaps))


def _grid(args: argparse.Namespace) -> list[Point]:
    sweep = args.sweep or {}
    block_sizes = sweep.get("block_size", args.block_sizes)
    queue_depths = sweep.get("queue_depth", args.queue_depths)
    parallelism = sweep.get("io_parallel", args.parallelism)
    gpu_backend = "cufile" if args.gds else "auto"
    pts = [
        Point(be, bs, qd, par, ss, oe, gpu_backend)
        for be, bs, qd, par, (ss, oe) in itertools.product(
            args.backends, block_sizes, queue_depths, parallelism, _modes(args)
        )
        if bs <= args.size
    ]
    if not pts:
        raise CliError("the sweep is empty: every --block-sizes value is larger than --size")
    return pts


async def _run_rung(
    points: list[Point],
    ops: Sequence[str],
    nbytes: int,
    reps: int,
    paths: Sequence[str],
    size: int,
    buf: Any,
    bar: Any,
    verbose: bool = False,
) -> dict[tuple[Point, str], list[float]]:
    """Measure every (point, op) ``reps`` times, interleaved: rep 1 of every point, then rep 2...

    With several directories (``--nvme_dir a b``, as ds_nvme_tune maps one folder per device) each
    transfer is split evenly over them and runs on all at once; GB/s is the total over the slowest."""
    from .handle import AsyncIOHandle

    out: dict[tuple[Point, str], list[float]] = {}
    part = max(4096, nbytes // len(paths) // 4096 * 4096)
    slots = max(1, size // part)
    k = 0
    for _rep in range(reps):
        for p in points:
            async with AsyncIOHandle(p.config()) as h, contextlib.AsyncExitStack() as stack:
                files = [await stack.enter_async_context(h.open(path, "r+")) for path in paths]
                for op in ops:
                    offset = (k % slots) * part  # walk the file so no region is re-read hot
                    k += 1
                    views = [buf[i * part : (i + 1) * part] for i in range(len(files))]
                    dts = await asyncio.gather(*(_timed(f, op, v, offset) for f, v in zip(files, views)))
                    gbps = part * len(files) / max(dts) / 1e9
                    out.setdefault((p, op), []).append(gbps)
                    if verbose:
                        print(f"  {op:<5} {human(part * len(files)):>9}  {gbps:6.2f} GB/s  {p.label()}")
                    bar.update(1)
    return out


def _ops(args: argparse.Namespace) -> tuple[str, ...]:
    ops = tuple(op for op, off in (("write", args.no_write), ("read", args.no_read)) if not off)
    if not ops:
        raise CliError("--no_read and --no_write together leave nothing to measure")
    return ops


def tune(args: argparse.Namespace) -> int:
    """Run ``dsio tune`` (arguments from :func:`dsio.cli.build_parser`); returns the exit status."""
    from . import backend_status
    from ._report import probe_o_direct

    ops = _ops(args)
    args.optimize = _goal(args) if len(ops) == 2 else ops[0]  # one op measured: the block is for it
    args.sweep = load_sweep_config(args.sweep_config) if args.sweep_config else None
    if args.verbose:
        print(f"dsio tune: args = {vars(args)}")
    if args.gds:
        args.gpu = True  # ds_nvme_tune's --gds: GPU tensors through cuFile
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise CliError(
                "--gpu needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)"
            )
    if args.gds:
        from .gpu import gpu_status

        g = gpu_status()
        if not g.cufile:
            raise CliError(f"--gds needs cuFile (GPUDirect Storage): {g.cufile_reason}")
    avail = {b.name: b for b in backend_status()}
    if args.backends is None:
        args.backends = [n for n in ("io_uring", "aio", "posix") if avail[n].available]
    for name in args.backends:
        if not avail[name].available:
            raise CliError(f"backend {name} is unavailable here: {avail[name].reason}")
    dirs = list(dict.fromkeys(args.dir))
    per_dir = max(4096, args.size // len(dirs) // 4096 * 4096)
    directories = [check_dir(d, per_dir + (64 << 20)) for d in dirs]
    if args.flush_page_cache:
        direct = [probe_o_direct(d) for d in directories]
        cached = [d["directory"] for d in direct if not d.get("o_direct")]
        if cached:
            print(
                f"  note: --flush_page_cache: {', '.join(cached)} cannot use O_DIRECT, so reads there may come "
                "from the page cache; dsio tune does not drop it (that needs root: sync; echo 3 > "
                "/proc/sys/vm/drop_caches before the run)"
            )
        else:
            print(
                "  note: --flush_page_cache: nothing to flush: every transfer uses O_DIRECT, which bypasses "
                "the page cache, so no read is served from it"
            )
    if args.log_dir is not None:
        os.makedirs(args.log_dir, exist_ok=True)  # ds_nvme_tune's log directory: results go there
        if args.out is None:
            args.out = os.path.join(args.log_dir, "dsio_tune")
    out_prefix = os.path.abspath(args.out or "dsio_tune")
    out_dir = os.path.dirname(out_prefix)
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise CliError(f"cannot write results to {out_dir} (set --out PREFIX)")
    points = _grid(args)
    tqdm = _progress_bar()

    random.Random(0).shuffle(points)  # noise must not line up with a parameter
    paths = [os.path.join(d, f".dsio-tune-{os.getpid()}.bin") for d in directories]
    t_start = time.perf_counter()
    results: list[Result] = []
    # Successive halving: screen everything on a small transfer, then grow the transfer and keep
    # only points within reach of the best. The final rung measures every asked op for the union
    # of survivors, interleaved, `reps` times.
    probe = max(args.size // 16, min(args.size, 16 << 20))
    rungs = [(probe, 1, 0.55), (max(probe, args.size // 4), 1, 0.75), (args.size, args.reps, 0.0)]
    try:
        buf = buffer(per_dir * len(paths), args.gpu)
        for i, path in enumerate(paths):  # uvloop when importable, like every loop dsio starts
            run(_fill(path, buf[i * per_dir : (i + 1) * per_dir]))
        alive = {op: list(points) for op in ops}
        for r, (nbytes, reps, keep) in enumerate(rungs):
            final = r == len(rungs) - 1
            if final:
                union = list(dict.fromkeys(p for op in ops for p in alive[op][: args.finalists]))
                plan: list[tuple[list[Point], tuple[str, ...]]] = [(union, ops)]
            else:
                both = [p for p in points if all(p in alive[op] for op in ops)]
                only = [(p, op) for op in ops for p in alive[op] if p not in both]
                plan = [(both, ops)]
                plan += [([p], (op,)) for p, op in only]
            total = sum(len(pts) * len(o) for pts, o in plan) * reps
            desc = f"rung {r + 1}/{len(rungs)}: {human(nbytes)} x {reps}"
            with tqdm(total=total, desc=desc, unit="op", disable=args.quiet, file=sys.stderr) as bar:
                measured: dict[tuple[Point, str], list[float]] = {}
                for pts, o in plan:
                    measured.update(
                        run(_run_rung(pts, o, nbytes, reps, paths, per_dir, buf, bar, args.verbose))
                    )
            for op in ops:
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
        for path in paths:
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
        f"dsio tune: {len({r.point for r in results})} points, {len({r.point for r in final})} finalists, "
        f"{elapsed:.0f} s"
    )
    for op in ("write", "read"):
        rs = sorted((r for r in final if r.op == op), key=lambda r: r.median, reverse=True)
        if rs:
            b = rs[0]
            print(
                f"  best {op:<5} {b.median:6.2f} GB/s  {b.point.label()}  (min {min(b.gbps):.2f}, max {max(b.gbps):.2f})"
            )
    picked = pick(results, None, args.optimize)  # the block names its backend: the best of all of them
    assert picked is not None
    p, v = picked
    block = {"aio": p.aio()}
    with open(prefix + ".json", "w") as f:
        json.dump(block, f, indent=2)
        f.write("\n")
    measured = ", ".join(f"{op} {v[op]:.2f} GB/s" for op in ("write", "read") if op in v)
    print(f"  aio block (favours {args.optimize}, backend {p.backend}): {measured} -> {prefix}.json")
    print("  " + json.dumps(block))
    _say_read_vs_write(results, p.backend, args, p)
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
