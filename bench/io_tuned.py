"""Tuned vs tuned: each side's best of the same small sweep (issue 16, "fair baselines").

Both dsio and DeepSpeed's ``aio_handle`` run the same grid -- worker threads 1-2, overlap on/off,
(block size, queue depth) in {(1 MiB, 32), (1 MiB, 128), (8 MiB, 32)} -- plus each side's own
default configuration (dsio's ``IOConfig()`` and DeepSpeed's aio defaults; DeepSpeed's is in the
grid already), so a side's "tuned" figure can never be below its default measured the same way.
Each point writes a locked buffer to a new file and reads it back cold. Config by config, dsio and
DeepSpeed alternate rep by rep, and which goes first alternates too (one dsio handle and one
DeepSpeed process, with its locked buffer, alive at a time). Each side's best median per
operation is reported with the settings that won it.

Order: reps outside, points inside. Every rep visits every point (the starting point rotates
from rep to rep, and which side goes first alternates), so a drift of this disk over the ~10
minutes of a sweep spreads over all points instead of landing on the last ones. Before this,
each point ran all its reps back to back and dsio's default was the last point: in the quiet
run of 18:28 (bench/results/2026-11-30-vm-io-quiet.md) it measured 1.63/1.39 GB/s against
1.87/1.65 for the main table's default run, while the same run's main table had already drifted
to 1.55/1.23 in its own third rep. A freshly created handle per point, a second event loop,
the buffer's content, an overwrite before the read and a sync after the unlink were each
measured against the main table's method in one process, interleaved, under load (bench/results/
io-tuned-sweep-diagnosis-2026-11-30.md): none moved the medians beyond their rep-to-rep range,
except a second, freshly allocated 1 GiB locked buffer (1.45/1.31 vs 1.83/1.49 in one 10-rep
run, not reproduced in two others); the sweep now uses the caller's buffer (the main table's)
when given one, so that factor is gone too.

``reference`` (bench/io.py passes the main table's own runner: its handle, its buffer) runs
right next to dsio's default point in every rep, so the report shows the default point and the
main table's method measured in the same minutes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from statistics import median

import torch

import dsio
from bench._common import drop_caches_verified, fmt
from bench._io_runners import DS_SCRIPT, DsioRunner
from bench.io_read_path import DeepSpeedServer
from dsio._native import native

__all__ = ["DEEPSPEED_DEFAULT", "DSIO_DEFAULT", "SWEEP", "report_tuned", "run_tuned"]

MIB = 1 << 20
Point = tuple[int, bool, int, int]  # (threads, overlap, block size, queue depth)

GRID: list[Point] = [
    (threads, overlap, bs, qd)
    for threads, overlap, (bs, qd) in itertools.product(
        (1, 2), (True, False), ((1 * MIB, 32), (1 * MIB, 128), (8 * MIB, 32))
    )
]
_d = dsio.IOConfig()
#: dsio's defaults, read from ``IOConfig()`` (so the sweep follows them when they change).
DSIO_DEFAULT: Point = (_d.intra_op_parallelism, _d.overlap_events, _d.block_size, _d.queue_depth)
#: DeepSpeed's aio defaults (bench/baselines/deepspeed_io.py's, which are aio_handle's).
DEEPSPEED_DEFAULT: Point = (1, False, 1 * MIB, 128)
SWEEP: list[Point] = GRID + [p for p in (DSIO_DEFAULT, DEEPSPEED_DEFAULT) if p not in GRID]
DEFAULTS = {"dsio": DSIO_DEFAULT, "DeepSpeed": DEEPSPEED_DEFAULT}


def label(threads: int, overlap: bool, bs: int, qd: int) -> str:
    return f"threads {threads}, overlap {'on' if overlap else 'off'}, block {bs // MIB} MiB, QD {qd}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_tuned(
    directory: str,
    size: int,
    reps: int,
    ds_python: str | None,
    ds_script: str,
    progress: Callable[[str], None] = lambda s: None,
    sweep: Sequence[Point] = SWEEP,
    buf: torch.Tensor | None = None,
    reference: Callable[[], tuple[float, float]] | None = None,
) -> dict:
    """Run the sweep; ``{"results": {side: {op: {label: [GB/s per rep]}}}, "cold", "defaults",
    "reference"}``.

    ``buf``: a locked, 4096-aligned uint8 tensor of ``size`` bytes to write from and read into
    (default: one allocated here). ``reference``: called once per rep right next to dsio's
    default point (before it in even reps, after it in odd ones); returns (write, read) GB/s of
    the caller's own method, stored under ``"reference"``.
    """
    path = os.path.join(directory, "tuned.bin")
    if buf is None:
        mem = native().AlignedBuffer(size, True)
        buf = torch.frombuffer(mem, dtype=torch.uint8)
        buf.fill_(5)
    elif buf.nbytes != size or buf.data_ptr() % 4096:
        raise ValueError(f"buf must be a 4096-aligned tensor of exactly size={size} bytes")
    loop = asyncio.new_event_loop()
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    ref: dict[str, list[float]] = {"write": [], "read": []}
    cold = True

    def fresh() -> None:
        if os.path.exists(path):
            os.unlink(path)
        os.sync()

    def measure_dsio(h: dsio.AsyncIOHandle, name: str) -> None:
        nonlocal cold
        fresh()
        t0 = time.perf_counter()
        loop.run_until_complete(h.pwrite(buf, path))
        out["dsio"]["write"][name].append(size / (time.perf_counter() - t0) / 1e9)
        _fsync(path)
        cold &= drop_caches_verified(path)
        t0 = time.perf_counter()
        loop.run_until_complete(h.pread(buf, path))
        out["dsio"]["read"][name].append(size / (time.perf_counter() - t0) / 1e9)

    def measure_ds(server: DeepSpeedServer, name: str) -> None:
        nonlocal cold
        fresh()
        out["DeepSpeed"]["write"][name].append(server.call("write", path, 0, size)["gbps"])
        _fsync(path)
        cold &= drop_caches_verified(path)
        out["DeepSpeed"]["read"][name].append(server.call("read", path, 0, size)["gbps"])

    def measure_reference() -> None:
        assert reference is not None
        w, r = reference()
        ref["write"].append(w)
        ref["read"].append(r)

    try:
        for rep in range(reps):
            # Rotate the starting point: spread over the sweep (or step by one when reps outnumber
            # points), so no point always runs first or last.
            start = rep * len(sweep) // reps if reps <= len(sweep) else rep % len(sweep)
            order = list(sweep[start:]) + list(sweep[:start])
            for i, cfg in enumerate(order):
                name = label(*cfg)
                progress(f"tuned sweep: rep {rep + 1}/{reps}, {name}")
                # The main table's IOConfig with only the swept fields changed (its pools too: a
                # locked, aligned buffer is never staged, so they cost nothing here).
                h = dsio.AsyncIOHandle(
                    dataclasses.replace(
                        dsio.IOConfig(),
                        intra_op_parallelism=cfg[0],
                        overlap_events=cfg[1],
                        block_size=cfg[2],
                        queue_depth=cfg[3],
                    )
                )
                server = None
                try:
                    if ds_python:
                        extra = ["--threads", str(cfg[0]), "--block-size", str(cfg[2])]
                        extra += ["--queue-depth", str(cfg[3])] + (["--overlap-events"] if cfg[1] else [])
                        server = DeepSpeedServer(ds_python, ds_script, size, extra)
                    steps: list[Callable[[], None]] = [functools.partial(measure_dsio, h, name)]
                    if reference is not None and cfg == DSIO_DEFAULT:
                        steps.insert(rep % 2, measure_reference)
                    if server is not None:
                        steps.insert((rep + i) % 2 * len(steps), functools.partial(measure_ds, server, name))
                    for step in steps:
                        step()
                finally:
                    loop.run_until_complete(h.aclose())
                    if server is not None:
                        server.close()
    finally:
        loop.close()
        if os.path.exists(path):
            os.unlink(path)
    return {
        "results": {k: {o: dict(v) for o, v in d.items()} for k, d in out.items()},
        "cold": cold,
        "defaults": {side: label(*p) for side, p in DEFAULTS.items()},
        "reference": ref if reference is not None else None,
        "order": "reps outside, points inside (rotating)",
    }


def best_of(by_cfg: dict[str, list[float]]) -> tuple[str, list[float]]:
    """The setting with the highest median, and its values."""
    return max(by_cfg.items(), key=lambda kv: median(kv[1]))


def report_tuned(data: dict, size: int, main_defaults: dict[tuple[str, str], float] | None = None) -> str:
    """The tuned-vs-tuned table. ``main_defaults``: {(side, op): median GB/s} of the main table's
    default-config runs in the same invocation, shown beside the sweep's default point."""
    res = data["results"]
    defaults = data.get("defaults") or {side: label(*p) for side, p in DEFAULTS.items()}
    lines = ["", "## Tuned vs tuned: each side's best of the same sweep", ""]
    lines.append(
        f"{size / (1 << 30):g} GiB, locked buffer, new file / cold read"
        + ("" if data["cold"] else " (WARM: the cache drop did not take)")
        + "; grid: threads 1-2 x overlap on/off x (block, QD) in (1 MiB, 32), (1 MiB, 128), (8 MiB, 32), "
        "plus each side's default configuration; every point: write (timed), fsync, drop the cache, read; "
        + (
            "every rep visits every point (starting point rotating), the two sides alternating who goes first."
            if data.get("order")
            else "the two sides alternate (and alternate who goes first) rep by rep."
        )
    )
    lines += [
        "",
        "| side | op | best GB/s, median (min-max) | winning settings | its default in the sweep "
        "| its default, main table |",
        "|---|---|---|---|---|---|",
    ]
    best: dict = {}
    for side, ops in res.items():
        for op, by_cfg in ops.items():
            name, xs = best_of(by_cfg)
            best[side, op] = median(xs)
            d = by_cfg.get(defaults[side])
            main = (main_defaults or {}).get((side, op))
            lines.append(
                f"| {side} | {op} | {fmt(xs)} | {name} | {fmt(d) if d else 'not in sweep'} | "
                f"{f'{main:.2f}' if main else '-'} |"
            )
    ref = data.get("reference")
    if ref and ref.get("write") and "dsio" in res:
        lines.append(
            "\ndsio's default point in the sweep vs the main table's method (its handle and buffer), "
            "run next to it in every rep:"
        )
        for op in ("write", "read"):
            d = res["dsio"].get(op, {}).get(defaults["dsio"])
            if d and ref.get(op):
                lines.append(
                    f"- {op}: sweep point {fmt(d)}, main-table method {fmt(ref[op])} GB/s: "
                    f"{median(d) / median(ref[op]):.2f}x"
                )
    for op in ("write", "read"):
        if ("dsio", op) in best and ("DeepSpeed", op) in best:
            lines.append(
                f"\ntuned dsio / tuned DeepSpeed, {op}: {best['dsio', op] / best['DeepSpeed', op]:.2f}x"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Only the sweep, with bench/io.py's main-table method as the reference next to dsio's default.

    ``python -m bench.io_tuned [--points defaults|all] [--reps 3] [--label under-load]``; results go to
    bench/results/io-tuned[-LABEL]-<date>.md (+ .json).
    """
    import argparse
    import sys

    from bench._common import deepspeed_python, machine, scratch_dir, write_labelled_result

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--points", choices=("defaults", "all"), default="all")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    directory = args.dir or scratch_dir()
    os.makedirs(directory, exist_ok=True)
    size = int(args.size_gib * (1 << 30)) // MIB * MIB
    ds_python = None if args.skip_deepspeed else deepspeed_python(None)
    sweep = [DSIO_DEFAULT, DEEPSPEED_DEFAULT] if args.points == "defaults" else SWEEP
    mem = native().AlignedBuffer(size, True)
    buf = torch.frombuffer(mem, dtype=torch.uint8)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))  # as bench/io.py's `locked`
    loop = asyncio.new_event_loop()
    runner = DsioRunner(loop, dsio.IOConfig(backend="io_uring"))
    seq_path = os.path.join(directory, "seq.bin")

    def reference() -> tuple[float, float]:
        o: dict[str, list[float]] = defaultdict(list)
        runner.seq(buf, seq_path, o)
        return o["write_new"][0], o["read"][0]

    t0 = time.perf_counter()
    try:
        data = run_tuned(
            directory,
            size,
            args.reps,
            ds_python,
            DS_SCRIPT,
            lambda s: print(s, file=sys.stderr),
            sweep=sweep,
            buf=buf,
            reference=reference,
        )
    finally:
        runner.close()
        loop.close()
        if os.path.exists(seq_path):
            os.unlink(seq_path)
    meta = machine()
    md = f"# Tuned sweep, {meta['date']}\n\nMachine: " + ", ".join(f"{k} {v}" for k, v in meta.items())
    md += f"\nPoints: {args.points}; {args.reps} reps; took {time.perf_counter() - t0:.0f} s"
    md += (
        f"; label: **{args.label}**" if args.label else ""
    ) + f"; load average at the end {os.getloadavg()}.\n"
    md += report_tuned(data, size)
    write_labelled_result("io-tuned", args.label, meta, md, {"args": vars(args), **data})


if __name__ == "__main__":
    main()
