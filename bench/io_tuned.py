"""Tuned vs tuned: each side's best of the same small sweep (issue 16, "fair baselines").

Both dsio and DeepSpeed's ``aio_handle`` run the same grid -- worker threads 1-2, overlap on/off,
(block size, queue depth) in {(1 MiB, 32), (1 MiB, 128), (8 MiB, 32)} -- writing a locked buffer to
a new file and reading it back cold; config by config, dsio and DeepSpeed alternate rep by rep
(one DeepSpeed process, with its locked buffer, alive at a time). Each side's best
median per operation is reported with the settings that won it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import defaultdict
from collections.abc import Callable
from statistics import median

import torch

import dsio
from bench._common import drop_caches_verified, fmt
from bench.io_read_path import DeepSpeedServer
from dsio._native import native

__all__ = ["SWEEP", "run_tuned", "report_tuned"]

MIB = 1 << 20
SWEEP: list[tuple[int, bool, int, int]] = [
    (threads, overlap, bs, qd)
    for threads, overlap, (bs, qd) in itertools.product(
        (1, 2), (True, False), ((1 * MIB, 32), (1 * MIB, 128), (8 * MIB, 32))
    )
]


def _label(threads: int, overlap: bool, bs: int, qd: int) -> str:
    return f"threads {threads}, overlap {'on' if overlap else 'off'}, block {bs // MIB} MiB, QD {qd}"


def run_tuned(
    directory: str,
    size: int,
    reps: int,
    ds_python: str | None,
    ds_script: str,
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """{side: {op: {label: [GB/s per rep]}}, "cold": bool}."""
    path = os.path.join(directory, "tuned.bin")
    mem = native().AlignedBuffer(size, True)
    buf = torch.frombuffer(mem, dtype=torch.uint8)
    buf.fill_(5)
    loop = asyncio.new_event_loop()
    handles = {
        cfg: dsio.AsyncIOHandle(
            dsio.IOConfig(
                intra_op_parallelism=cfg[0],
                overlap_events=cfg[1],
                block_size=cfg[2],
                queue_depth=cfg[3],
                pool_bytes=1 << 20,  # a locked, aligned buffer: nothing is staged
                staging_buffer_bytes=1 << 20,
            )
        )
        for cfg in SWEEP
    }
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    cold = True
    try:
        # One DeepSpeed server (and its locked buffer of `size`) at a time: configs in turn, and
        # within a config dsio and DeepSpeed alternate rep by rep, so each pair is measured side by side.
        for cfg in SWEEP:
            label = _label(*cfg)
            server = None
            if ds_python:
                extra = ["--threads", str(cfg[0]), "--block-size", str(cfg[2]), "--queue-depth", str(cfg[3])]
                server = DeepSpeedServer(
                    ds_python, ds_script, size, extra + (["--overlap-events"] if cfg[1] else [])
                )
            try:
                for rep in range(reps):
                    progress(f"tuned sweep: {label}, rep {rep + 1}/{reps}")
                    for side in ("dsio", "DeepSpeed"):
                        if side == "DeepSpeed" and server is None:
                            continue
                        if os.path.exists(path):
                            os.unlink(path)
                        os.sync()
                        if side == "dsio":
                            h = handles[cfg]
                            t0 = time.perf_counter()
                            loop.run_until_complete(h.pwrite(buf, path))
                            out[side]["write"][label].append(size / (time.perf_counter() - t0) / 1e9)
                            cold &= drop_caches_verified(path)
                            t0 = time.perf_counter()
                            loop.run_until_complete(h.pread(buf, path))
                            out[side]["read"][label].append(size / (time.perf_counter() - t0) / 1e9)
                        else:
                            out[side]["write"][label].append(server.call("write", path, 0, size)["gbps"])
                            cold &= drop_caches_verified(path)
                            out[side]["read"][label].append(server.call("read", path, 0, size)["gbps"])
            finally:
                if server is not None:
                    server.close()
    finally:
        for h in handles.values():
            loop.run_until_complete(h.aclose())
        loop.close()
        if os.path.exists(path):
            os.unlink(path)
    return {"results": {k: {o: dict(v) for o, v in d.items()} for k, d in out.items()}, "cold": cold}


def report_tuned(data: dict, size: int) -> str:
    res = data["results"]
    lines = ["", "## Tuned vs tuned: each side's best of the same sweep", ""]
    lines.append(
        f"{size / (1 << 30):g} GiB, locked buffer, new file / cold read"
        + ("" if data["cold"] else " (WARM: the cache drop did not take)")
        + "; grid: threads 1-2 x overlap on/off x (block, QD) in (1 MiB, 32), (1 MiB, 128), (8 MiB, 32)."
    )
    lines += [
        "",
        "| side | op | best GB/s, median (min-max) | winning settings | defaults' median |",
        "|---|---|---|---|---|",
    ]
    defaults = {"dsio": _label(2, True, MIB, 64), "DeepSpeed": _label(1, False, MIB, 128)}
    best: dict = {}
    for side, ops in res.items():
        for op, by_cfg in ops.items():
            label, xs = max(by_cfg.items(), key=lambda kv: median(kv[1]))
            best[side, op] = median(xs)
            d = by_cfg.get(defaults[side])
            lines.append(
                f"| {side} | {op} | {fmt(xs)} | {label} | {f'{median(d):.2f}' if d else 'not in grid'} |"
            )
    for op in ("write", "read"):
        if ("dsio", op) in best and ("DeepSpeed", op) in best:
            lines.append(
                f"\ntuned dsio / tuned DeepSpeed, {op}: {best['dsio', op] / best['DeepSpeed', op]:.2f}x"
            )
    return "\n".join(lines) + "\n"
