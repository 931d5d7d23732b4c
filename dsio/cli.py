"""The ``dsio`` command: ``report`` (what this machine can do, and why not), ``tune`` (sweep the
engine's knobs and write a dstrain ``"aio"`` block), ``bench`` (quick GB/s and op rate).

``report`` lives in :mod:`dsio._report`; ``tune`` and ``bench`` share the measuring core here
(still past the ~500-line mark: the tuner's early-stopping sweep, its CSV and its plot belong
together; splitting tune into its own module is the next step if it grows).
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
import re
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._report import _human, _report

__all__ = ["main", "parse_size"]

#: The keys of dstrain's ``"aio"`` config block that tune writes (dstrain/config_sections.py AioConfig).
AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1, no traceback."""


# -- argument types ------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"1G"``, ``"512M"``, ``"64KiB"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 512M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _size_arg(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0 or n % 4096:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive multiple of 4096 bytes")
    return n


def _pow2_size(text: str) -> int:
    n = _size_arg(text)
    if n & (n - 1):
        raise argparse.ArgumentTypeError(f"{text!r} must be a power of two")
    return n


def _list_of(conv: Any) -> Any:
    def parse(text: str) -> list[Any]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return [conv(t.strip()) for t in items]

    return parse


def _pos_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _backend_name(text: str) -> str:
    if text not in ("io_uring", "aio", "posix"):
        raise argparse.ArgumentTypeError(f"unknown backend {text!r} (choose from io_uring, aio, posix)")
    return text


# -- measuring core ------------------------------------------------------------------------------
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
            f"{self.backend} bs={_human(self.block_size)} qd={self.queue_depth} par={self.intra_op_parallelism} "
            f"ss={int(self.single_submit)} oe={int(self.overlap_events)}"
        )


def _check_dir(directory: str, need: int) -> str:
    d = os.path.abspath(directory)
    if not os.path.exists(d):
        raise CliError(f"directory {d} does not exist")
    if not os.path.isdir(d):
        raise CliError(f"{d} is not a directory")
    probe = os.path.join(d, f".dsio-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CliError(f"cannot write to {d}: {e.strerror}") from None
    free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    if free < need:
        raise CliError(f"{d} has {_human(free)} free; this run needs {_human(need)} (lower --size)")
    return d


def _buffer(nbytes: int, gpu: bool) -> Any:
    import torch

    from ._native import native

    mem = native().AlignedBuffer(nbytes, True)
    t = torch.frombuffer(mem, dtype=torch.uint8)
    t.view(torch.int64)[: nbytes // 8].copy_(torch.arange(nbytes // 8, dtype=torch.int64))
    return t.cuda() if gpu else t


async def _timed(f: Any, op: str, view: Any, offset: int) -> float:
    t0 = time.perf_counter()
    if op == "write":
        await f.pwrite(view, offset)
    else:
        await f.pread(view, offset)
    return time.perf_counter() - t0


# -- tune ----------------------------------------------------------------------------------------
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


def _tune(args: argparse.Namespace) -> int:
    from . import backend_status

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
    directory = _check_dir(args.dir, args.size + (64 << 20))
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
        buf = _buffer(args.size, args.gpu)
        asyncio.run(_fill(path, buf))
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
            desc = f"rung {r + 1}/{len(rungs)}: {_human(nbytes)} x {reps}"
            with tqdm(total=total, desc=desc, unit="op", disable=args.quiet, file=sys.stderr) as bar:
                measured: dict[tuple[Point, str], list[float]] = {}
                for pts, ops in plan:
                    measured.update(asyncio.run(_run_rung(pts, ops, nbytes, reps, path, args.size, buf, bar)))
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


def _pick(results: list[Result], backend: str | None, optimize: str) -> tuple[Point, dict[str, float]] | None:
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
    picked = _pick(results, auto, args.optimize)
    overall = _pick(results, None, args.optimize)
    if picked is None:
        picked = overall
    assert picked is not None
    p, v = picked
    block = {"aio": p.aio()}
    with open(prefix + ".json", "w") as f:
        json.dump(block, f, indent=2)
        f.write("\n")
    print(
        f"  aio block ({args.optimize}, backend {p.backend}): write {v.get('write', 0):.2f} GB/s, "
        f"read {v.get('read', 0):.2f} GB/s -> {prefix}.json"
    )
    print("  " + json.dumps(block))
    if overall is not None and overall[0].backend != p.backend:
        print(
            f"  note: the {overall[0].backend} backend scored best overall; the aio block cannot choose a "
            f"backend (dsio's auto picks {auto}); use IOConfig(backend={overall[0].backend!r}) in code for it"
        )
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


# -- bench ---------------------------------------------------------------------------------------
def _load_config(path: str | None, args: argparse.Namespace) -> Any:
    from .config import IOConfig
    from .errors import ConfigError

    fields: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as e:
            raise CliError(f"cannot read --config {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CliError(f"--config {path} is not JSON: {e}") from None
        block = doc.get("aio", doc) if isinstance(doc, dict) else None
        if not isinstance(block, dict):
            raise CliError(f'--config {path}: expected a JSON object (an "aio" block)')
        for key, val in block.items():
            key = {"thread_count": "intra_op_parallelism"}.get(key, key)
            if key == "use_gds":
                continue
            if key not in AIO_KEYS and key not in ("backend", "o_direct"):
                raise CliError(f"--config {path}: unknown aio key {key!r} (accepted: {', '.join(AIO_KEYS)})")
            fields[key] = val
    for key in (*AIO_KEYS, "backend"):
        val = getattr(args, key, None)
        if val is not None:
            fields[key] = val
    fields.update(pool_bytes=1 << 20, staging_buffer_bytes=1 << 20)
    try:
        return IOConfig(**fields)
    except ConfigError as e:
        raise CliError(f"invalid configuration: {e}") from None


async def _bench_rep(
    cfg: Any, d: str, size: int, op_size: int, n_ops: int, conc: int, buf: Any
) -> dict[str, float]:
    from .handle import AsyncIOHandle

    out: dict[str, float] = {}
    big = os.path.join(d, f".dsio-bench-{os.getpid()}.bin")
    small = os.path.join(d, f".dsio-bench-ops-{os.getpid()}.bin")
    async with AsyncIOHandle(cfg) as h:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(big)
        t0 = time.perf_counter()
        await h.pwrite(buf, big, fsync=True)
        out["write_new_gbps"] = size / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        await h.pwrite(buf, big, offset=0, fsync=True)
        out["write_overwrite_gbps"] = size / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        await h.pread(buf, big)
        out["read_gbps"] = size / (time.perf_counter() - t0) / 1e9
        os.unlink(big)
        sem = asyncio.Semaphore(conc)
        piece = buf[:op_size]
        async with h.open(small, "w+") as f:
            f.truncate(op_size * n_ops)

            async def one(op: str, i: int) -> None:
                async with sem:
                    await (f.pwrite(piece, i * op_size) if op == "write" else f.pread(piece, i * op_size))

            for op in ("write", "read"):
                t0 = time.perf_counter()
                await asyncio.gather(*(one(op, i) for i in range(n_ops)))
                out[f"{op}_ops_per_s"] = n_ops / (time.perf_counter() - t0)
        os.unlink(small)
    return out


def _bench(args: argparse.Namespace) -> int:
    cfg = _load_config(args.config, args)
    d = _check_dir(args.dir, args.size + args.op_size * args.ops + (16 << 20))
    buf = _buffer(max(args.size, args.op_size), False)
    reps: list[dict[str, float]] = []
    try:
        for _ in range(args.reps):
            reps.append(
                asyncio.run(_bench_rep(cfg, d, args.size, args.op_size, args.ops, args.concurrency, buf))
            )
    except OSError as e:
        raise CliError(f"I/O failed in {d}: {e}") from None
    summary = {
        k: {
            "median": statistics.median(r[k] for r in reps),
            "min": min(r[k] for r in reps),
            "max": max(r[k] for r in reps),
        }
        for k in reps[0]
    }
    from .handle import AsyncIOHandle

    with AsyncIOHandle(cfg) as h:
        backend = h.backend
    conf = {"backend": backend, **{k: getattr(cfg, k) for k in AIO_KEYS}}
    if args.json:
        print(
            json.dumps(
                {"config": conf, "size": args.size, "op_size": args.op_size, "reps": args.reps, **summary},
                indent=2,
            )
        )
        return 0
    print(f"dsio bench: {d}, {_human(args.size)} transfers, {args.ops} x {_human(args.op_size)} ops (concurrency "
          f"{args.concurrency}), median of {args.reps} (min-max)")  # fmt: skip
    print("  config  " + " ".join(f"{k}={v}" for k, v in conf.items()))
    for key, label, unit in (
        ("write_new_gbps", "write, new file", "GB/s"),
        ("write_overwrite_gbps", "write, overwrite", "GB/s"),
        ("read_gbps", "read", "GB/s"),
        ("write_ops_per_s", f"{_human(args.op_size)} writes", "ops/s"),
        ("read_ops_per_s", f"{_human(args.op_size)} reads", "ops/s"),
    ):
        s = summary[key]
        fmt = "{:,.0f}" if unit == "ops/s" else "{:.2f}"
        print(
            f"  {label:<18} {fmt.format(s['median']):>9} {unit:<5} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
        )
    return 0


# -- entry point ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsio", description="dsio: asyncio-native tensor I/O tools")
    sub = p.add_subparsers(dest="command", metavar="{report,tune,bench}")
    sub.required = True

    r = sub.add_parser("report", help="what this machine supports, and why not")
    r.add_argument(
        "--dir", action="append", help="directory to probe for O_DIRECT (repeatable; default: cwd)"
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=_report)

    t = sub.add_parser("tune", help='sweep engine settings, write the best dstrain "aio" block')
    t.add_argument("--dir", required=True, help="directory on the storage to tune for")
    t.add_argument(
        "--size", type=_size_arg, default=1 << 30, help="bytes per transfer in the final rung (default 1G)"
    )
    t.add_argument("--gpu", action="store_true", help="transfer to/from a CUDA tensor")
    t.add_argument(
        "--out", default="dsio_tune", help="output prefix: PREFIX.json, .csv, .png (default ./dsio_tune)"
    )
    t.add_argument(
        "--backends",
        type=_list_of(_backend_name),
        metavar="LIST",
        help="io_uring,aio,posix (default: all available)",
    )
    t.add_argument(
        "--block-sizes",
        type=_list_of(_pow2_size),
        default=[256 << 10, 1 << 20, 4 << 20, 8 << 20],
        metavar="LIST",
        help="block_size values (default 256K,1M,4M,8M)",
    )
    t.add_argument(
        "--queue-depths",
        type=_list_of(_pos_int),
        default=[8, 32, 128],
        metavar="LIST",
        help="default 8,32,128",
    )
    t.add_argument(
        "--parallelism",
        type=_list_of(_pos_int),
        default=[1, 2],
        metavar="LIST",
        help="intra_op_parallelism values (default 1,2)",
    )
    t.add_argument("--reps", type=_pos_int, default=3, help="interleaved repetitions of the final rung")
    t.add_argument("--finalists", type=_pos_int, default=6, help="points per op that reach the final rung")
    t.add_argument(
        "--optimize",
        choices=("balanced", "read", "write"),
        default="balanced",
        help="what the aio block is best at (balanced: geometric mean of read and write vs the best of each)",
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_tune)

    b = sub.add_parser("bench", help="quick read/write GB/s and small-op rate")
    b.add_argument("--dir", required=True)
    b.add_argument("--size", type=_size_arg, default=1 << 30, help="bytes per large transfer (default 1G)")
    b.add_argument(
        "--config", help='JSON file with an "aio" block (dsio tune\'s output or a DeepSpeed config)'
    )
    b.add_argument("--backend", type=_backend_name)
    b.add_argument("--block-size", dest="block_size", type=_pow2_size)
    b.add_argument("--queue-depth", dest="queue_depth", type=_pos_int)
    b.add_argument("--intra-op-parallelism", dest="intra_op_parallelism", type=_pos_int)
    b.add_argument(
        "--single-submit", dest="single_submit", action=argparse.BooleanOptionalAction, default=None
    )
    b.add_argument(
        "--overlap-events", dest="overlap_events", action=argparse.BooleanOptionalAction, default=None
    )
    b.add_argument("--op-size", type=_size_arg, default=64 << 10, help="small-op size (default 64K)")
    b.add_argument("--ops", type=_pos_int, default=2000, help="small ops per measurement (default 2000)")
    b.add_argument("--concurrency", type=_pos_int, default=32, help="small ops in flight (default 32)")
    b.add_argument("--reps", type=_pos_int, default=3)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dsio`` console script; returns the exit status."""
    from .errors import DsioError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"dsio {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (OSError, DsioError) as e:  # e.g. ENOSPC in the middle of a sweep: one line, no traceback
        print(f"dsio {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dsio {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
