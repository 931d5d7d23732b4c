"""Tuned vs tuned: each side's best of the same small sweep (issue 16, "fair baselines").

Both dsio and DeepSpeed's ``aio_handle`` run the same grid -- worker threads 1-2, overlap on/off,
(block size, queue depth) in {(1 MiB, 32), (1 MiB, 128), (8 MiB, 32)} -- plus each side's own
default configuration (dsio's ``IOConfig()`` and DeepSpeed's aio defaults; DeepSpeed's is in the
grid already), so a side's "tuned" figure can never be below its default measured the same way.
Each point writes a locked buffer to a new file and reads it back cold. Config by config, dsio and
DeepSpeed alternate rep by rep, and which goes first alternates too (one dsio handle and one
DeepSpeed process, with its locked buffer, alive at a time). Each side's best median per
operation is reported with the settings that won it.

The first quiet run's sweep (bench/results/2026-11-30-vm-io-quiet.md) sat below dsio's own default
run (best 1.84/1.48 vs 2.12/1.88 GB/s write/read) with every point within ~15% of the others. It
differed from the main table in four ways, each removed here: dsio's default (QD 64) was in no
point; all 12 dsio handles (24 engine threads, 12 rings) stayed open for the whole sweep; dsio
always ran right before DeepSpeed within a pair; and each file was read right after it was written,
with no fsync in between (the main table fsyncs: this disk has a write-back cache). Which of them
cost what was not isolated (the machine was loaded when this changed); the table now shows each
side's default point of the sweep beside the main table's default run, so a re-run says whether
the two methods agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from statistics import median

import torch

import dsio
from bench._common import drop_caches_verified, fmt
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
) -> dict:
    """{"results": {side: {op: {label: [GB/s per rep]}}}, "cold": bool, "defaults": {side: label}}."""
    path = os.path.join(directory, "tuned.bin")
    mem = native().AlignedBuffer(size, True)
    buf = torch.frombuffer(mem, dtype=torch.uint8)
    buf.fill_(5)
    loop = asyncio.new_event_loop()
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    cold = True

    def fresh() -> None:
        if os.path.exists(path):
            os.unlink(path)
        os.sync()

    try:
        for cfg in sweep:
            name = label(*cfg)
            # The main table's IOConfig with only the swept fields changed (its pools too: a locked,
            # aligned buffer is never staged, so they cost nothing here).
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
            if ds_python:
                extra = ["--threads", str(cfg[0]), "--block-size", str(cfg[2]), "--queue-depth", str(cfg[3])]
                server = DeepSpeedServer(
                    ds_python, ds_script, size, extra + (["--overlap-events"] if cfg[1] else [])
                )
            try:
                for rep in range(reps):
                    progress(f"tuned sweep: {name}, rep {rep + 1}/{reps}")
                    sides = ["dsio", "DeepSpeed"] if server is not None else ["dsio"]
                    if rep % 2:
                        sides.reverse()  # neither side always runs right after the other's writes
                    for side in sides:
                        fresh()
                        if side == "dsio":
                            t0 = time.perf_counter()
                            loop.run_until_complete(h.pwrite(buf, path))
                            out[side]["write"][name].append(size / (time.perf_counter() - t0) / 1e9)
                            _fsync(path)
                            cold &= drop_caches_verified(path)
                            t0 = time.perf_counter()
                            loop.run_until_complete(h.pread(buf, path))
                            out[side]["read"][name].append(size / (time.perf_counter() - t0) / 1e9)
                        else:
                            assert server is not None
                            out[side]["write"][name].append(server.call("write", path, 0, size)["gbps"])
                            _fsync(path)
                            cold &= drop_caches_verified(path)
                            out[side]["read"][name].append(server.call("read", path, 0, size)["gbps"])
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
        "the two sides alternate (and alternate who goes first) rep by rep."
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
    for op in ("write", "read"):
        if ("dsio", op) in best and ("DeepSpeed", op) in best:
            lines.append(
                f"\ntuned dsio / tuned DeepSpeed, {op}: {best['dsio', op] / best['DeepSpeed', op]:.2f}x"
            )
    return "\n".join(lines) + "\n"
