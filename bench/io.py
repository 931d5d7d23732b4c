"""dsio I/O benchmark against fio and DeepSpeed's DeepNVMe, interleaved rep by rep.

    python bench/io.py [--dir DIR] [--size-gib 1] [--reps 5] [--skip-tuned]
    python bench/io.py --read-path [--sizes-mib 512,2048] [--runs 5] [--reps 3]   (issue 17)

Defaults follow the checkout, not this machine: files go to $DSIO_BENCH_DIR (default
<checkout>/.bench-tmp, which must be on the disk under test), DeepSpeed runs from
$DSIO_DEEPSPEED_VENV (default <checkout>/.venv-deepspeed, made by
bench/baselines/setup_deepspeed.sh) or $DSIO_DEEPSPEED_PYTHON; a missing baseline is skipped
with a message saying how to get it. Reads are "cold" only where the page-cache drop worked and
mincore confirmed it (root); otherwise they are labelled warm.

Per rep, every method runs once in turn (this disk drifts up to 3x within minutes, see
shared/ANCHORS.md), so medians and ratios compare methods measured side by side:
  - 1 GiB sequential: write to a new file, overwrite, read (page cache dropped before reads),
    for each dsio backend with a locked (4096-aligned, mlock'ed) buffer and with an ordinary
    torch.randn tensor; fio (libaio and io_uring, 1 MiB, QD32, O_DIRECT, end_fsync) and
    DeepSpeed's aio_handle (defaults: 1 MiB, QD128, 1 thread; locked and plain buffers).
  - small ops: 2,000 concurrent 64 KiB and 1 MiB writes and reads at distinct offsets of one
    file: dsio through paths (one open per op, as DeepSpeed's async_* + wait() does: the
    headline) and through one open file (its own row), fio QD1/QD32 (no end fsync: none of
    the others flush either).
  - tuned vs tuned: each side's best of the same small sweep (``--tuned-only``: only that, with the
    main table's method as the reference next to dsio's default; ``--points defaults`` for the two
    default points alone). Results of that mode: bench/results/io-tuned[-LABEL]-<date>.md (+ .json).
Writes are timed to completion of the data transfer; "+fsync" columns add a durable flush.
Results: bench/results/<date>-<host>-io.md (+ .json, .png).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from statistics import median

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsio  # noqa: E402
from bench._common import (  # noqa: E402
    deepspeed_python,
    drop_caches_verified,
    fmt,
    fs_of,
    machine,
    result_path,
    scratch_dir,
    summarize,
    write_labelled_result,
)
from bench._io_runners import COLD, DS_SCRIPT, DsioRunner, drop, fsync_path, unlink  # noqa: E402
from bench.baselines import fio  # noqa: E402
from bench.io_read_path import DeepSpeedServer  # noqa: E402
from dsio._memory import aligned_buffer  # noqa: E402

DS_PY: str | None = None  # set by main() from --ds-python / the environment
Results = dict[str, dict[str, list[float]]]  # method -> case -> values


# -- DeepSpeed -----------------------------------------------------------------------------------
def ds_call(**kw: object) -> dict:
    assert DS_PY is not None
    args = [DS_PY, DS_SCRIPT]
    for k, v in kw.items():
        if v is True:
            args.append(f"--{k.replace('_', '-')}")
        elif v is not False and v is not None:
            args += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
    res = json.loads(line)
    if not res.get("ok"):
        raise RuntimeError(f"DeepSpeed run failed: {res.get('error')} {r.stderr[-500:]}")
    return res


def ds_seq(path: str, size: int, buffer: str, out: dict[str, list[float]]) -> None:
    unlink(path)
    w = ds_call(path=path, size=size, mode="write", buffer=buffer)
    out["write_new"].append(w["gbps"])
    out["write_new_fsync"].append(w["gbps_with_fsync"])
    out["overwrite"].append(ds_call(path=path, size=size, mode="write", buffer=buffer)["gbps"])
    r = ds_call(path=path, size=size, mode="read", buffer=buffer, drop_caches=True)
    out["read"].append(r["gbps"])
    COLD["ok"] &= bool(r.get("cold"))


def ds_ops(path: str, size: int, count: int, out: dict[str, list[float]]) -> None:
    k = f"{size // 1024}K"
    unlink(path)
    with open(path, "wb") as f:  # sized up front, like fio's layout and dsio's run (same conditions)
        f.truncate(size * count)
    out[f"ops_write_{k}"].append(ds_call(path=path, mode="ops_write", ops=count, op_size=size)["ops_per_s"])
    r = ds_call(path=path, mode="ops_read", ops=count, op_size=size, drop_caches=True)
    out[f"ops_read_{k}"].append(r["ops_per_s"])
    COLD["ok"] &= bool(r.get("cold"))


# -- fio -------------------------------------------------------------------------------------------
def fio_seq(path: str, size: int, engine: str, out: dict[str, list[float]]) -> None:
    common = dict(size=size, block_size=1 << 20, queue_depth=32, ioengine=engine)
    unlink(path)
    out["write_new_fsync"].append(fio.run_fio(path, rw="write", **common)["gbps"])
    out["overwrite"].append(fio.run_fio(path, rw="write", **common)["gbps"])
    drop(path)
    out["read"].append(fio.run_fio(path, rw="read", **common)["gbps"])


def fio_ops(path: str, size: int, count: int, out: dict[str, list[float]]) -> None:
    k = f"{size // 1024}K"
    unlink(path)
    for qd in (1, 32):
        common = dict(size=size * count, block_size=size, queue_depth=qd, ioengine="libaio")
        # No end fsync: dsio's and DeepSpeed's small-op writes are not flushed either.
        out[f"ops_write_{k}_qd{qd}"].append(
            fio.run_fio(path, rw="randwrite", end_fsync=False, **common)["iops"]
        )
        drop(path)
        out[f"ops_read_{k}_qd{qd}"].append(fio.run_fio(path, rw="randread", **common)["iops"])


# -- report ------------------------------------------------------------------------------------------
SEQ_CASES = [
    ("write_new", "write, new file"),
    ("write_new_fsync", "write new + fsync"),
    ("overwrite", "overwrite"),
    ("read", "read (cold)"),
]


def seq_cases() -> list[tuple[str, str]]:
    """SEQ_CASES, with the read labelled warm when the cache drop did not verifiably work."""
    return [(c, "read (WARM)" if c == "read" and not COLD["ok"] else label) for c, label in SEQ_CASES]


def med(res: Results, method: str, case: str) -> float | None:
    xs = res.get(method, {}).get(case)
    return summarize(xs)[0] if xs else None


def report(res: Results, meta: dict, args: argparse.Namespace) -> str:
    lines = [f"# dsio I/O benchmark, {meta['date']}", ""]
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in meta.items() if k != "date"))
    lines.append(
        f"Disk: `{args.dir}` ({fs_of(args.dir)}); {args.reps} interleaved reps; values are median (min-max)."
    )
    if COLD["ok"]:
        lines.append(
            f"Sequential size {args.size_gib} GiB. Page cache dropped (and checked with mincore) before every read."
        )
    else:
        lines.append(
            f"Sequential size {args.size_gib} GiB. **Reads are WARM**: the page-cache drop failed (not root?) "
            "or did not take, so read figures include page-cache hits."
        )
    lines += ["", "## Sequential, GB/s", ""]
    lines.append("| method | " + " | ".join(c[1] for c in seq_cases()) + " |")
    lines.append("|---" * (len(SEQ_CASES) + 1) + "|")
    for m in res:
        if not any(c in res[m] for c, _ in SEQ_CASES):
            continue
        lines.append(f"| {m} | " + " | ".join(fmt(res[m].get(c, [])) for c, _ in SEQ_CASES) + " |")
    ds = "DeepSpeed aio_handle, locked"
    lines += ["", "### Ratios (medians, same run)", ""]
    lines.append("| dsio method | case | vs DeepSpeed locked | vs fio libaio |")
    lines.append("|---|---|---|---|")
    for m in res:
        if not m.startswith("dsio"):
            continue
        for c, label in seq_cases():
            v = med(res, m, c)
            if v is None:
                continue
            d = med(res, ds, c)
            f = med(res, "fio libaio 1M QD32", c)
            lines.append(f"| {m} | {label} | {v / d:.2f}x |" if d else f"| {m} | {label} | - |")
            lines[-1] += f" {v / f:.2f}x |" if f else " - |"
    lines += ["", "## Small operations (2,000 concurrent), ops/s", ""]
    op_cases = sorted({c for m in res for c in res[m] if c.startswith("ops_")})
    for m in res:
        row = [(c, res[m][c]) for c in op_cases if c in res[m]]
        if row:
            lines.append(f"- **{m}**: " + "; ".join(f"{c.removeprefix('ops_')} {fmt(v, 0)}" for c, v in row))
    lines += ["", "### Op-rate ratios", ""]
    for size in ("64K", "1024K"):
        for kind in ("write", "read"):
            # Headline: path per op on both sides (DeepSpeed's async_* opens the file per call).
            ours_path = med(res, "dsio io_uring (default config)", f"ops_{kind}_{size}_path")
            ours_file = med(res, "dsio io_uring (default config)", f"ops_{kind}_{size}")
            d = med(res, "DeepSpeed aio_handle", f"ops_{kind}_{size}")
            f32 = med(res, "fio libaio", f"ops_{kind}_{size}_qd32")
            if ours_path:
                parts = [f"dsio {size} {kind}, path per op: {ours_path:,.0f}/s"]
                if d:
                    parts.append(f"{ours_path / d:.2f}x DeepSpeed (path per op)")
                lines.append("- " + ", ".join(parts))
            if ours_file:
                parts = [f"dsio {size} {kind}, one open file (its own row): {ours_file:,.0f}/s"]
                if f32:
                    parts.append(f"{ours_file / f32:.2f}x fio QD32 (fio also keeps one file open)")
                lines.append("- " + ", ".join(parts))
    lines += loop_lines(res)
    return "\n".join(lines) + "\n"


UVLOOP = "dsio io_uring (default config), uvloop"


def uvloop_runner(cfg: dsio.IOConfig) -> DsioRunner | None:
    """The default config on a uvloop event loop (None without uvloop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return DsioRunner(uvloop.new_event_loop(), cfg)


def loop_lines(res: Results) -> list[str]:
    """asyncio vs uvloop for the 64 KiB op rate (issue 16): the same calls, reps interleaved."""
    a, u = res.get("dsio io_uring (default config)", {}), res.get(UVLOOP, {})
    rows = []
    for case, name in (
        ("ops_write_64K_path", "64K write, path per op"),
        ("ops_read_64K_path", "64K read, path per op"),
        ("ops_write_64K", "64K write, one open file"),
        ("ops_read_64K", "64K read, one open file"),
    ):
        if a.get(case) and u.get(case):
            ra, ru = summarize(a[case])[0], summarize(u[case])[0]
            rows.append(f"| {name} | {fmt(a[case], 0)} | {fmt(u[case], 0)} | {ru / ra:.2f}x |")
    if not rows:
        return []
    return [
        "",
        "### Event loop: asyncio vs uvloop, dsio default config, ops/s",
        "",
        "| case | asyncio | uvloop | uvloop / asyncio |",
        "|---|---|---|---|",
        *rows,
    ]


def plot(res: Results, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = seq_cases()
    methods = [m for m in res if any(c in res[m] for c, _ in cases)]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [med(res, m, c) or 0 for c, _ in cases]
        ax.bar([x + i * width for x in range(len(cases))], vals, width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], [c[1] for c in cases])
    ax.set_ylabel("GB/s (median)")
    ax.set_title("1 GiB sequential I/O, interleaved reps")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def unaligned_tensor(nbytes: int) -> torch.Tensor:
    """An ordinary float32 tensor whose memory is NOT 4096-aligned, so it takes the staged path."""
    t = torch.randn(nbytes // 4 + 1024)
    skip = 0 if t.data_ptr() % 4096 else 16  # torch returned page-aligned memory: shift by 64 bytes
    out = t[skip : skip + nbytes // 4]
    if out.data_ptr() % 4096 == 0:
        raise RuntimeError("could not make an unaligned tensor for the ordinary-tensor case")
    return out


# -- tuned vs tuned (issue 16) ----------------------------------------------------------------
# Tuned vs tuned: each side's best of the same small sweep (issue 16, "fair baselines").
#
# Both dsio and DeepSpeed's ``aio_handle`` run the same grid -- worker threads 1-2, overlap on/off,
# (block size, queue depth) in {(1 MiB, 32), (1 MiB, 128), (8 MiB, 32)} -- plus each side's own
# default configuration (dsio's ``IOConfig()`` and DeepSpeed's aio defaults; DeepSpeed's is in the
# grid already), so a side's "tuned" figure can never be below its default measured the same way.
# Each point writes a locked buffer to a new file and reads it back cold. Config by config, dsio and
# DeepSpeed alternate rep by rep, and which goes first alternates too (one dsio handle and one
# DeepSpeed process, with its locked buffer, alive at a time). Each side's best median per
# operation is reported with the settings that won it.
#
# Order: reps outside, points inside. Every rep visits every point (the starting point rotates
# from rep to rep, and which side goes first alternates), so a drift of this disk over the ~10
# minutes of a sweep spreads over all points instead of landing on the last ones. Before this,
# each point ran all its reps back to back and dsio's default was the last point: in the quiet
# run of 18:28 (bench/results/2026-11-30-vm-io-quiet.md) it measured 1.63/1.39 GB/s against
# 1.87/1.65 for the main table's default run, while the same run's main table had already drifted
# to 1.55/1.23 in its own third rep. A freshly created handle per point, a second event loop,
# the buffer's content, an overwrite before the read and a sync after the unlink were each
# measured against the main table's method in one process, interleaved, under load (bench/results/
# io-tuned-sweep-diagnosis-2026-11-30.md): none moved the medians beyond their rep-to-rep range,
# except a second, freshly allocated 1 GiB locked buffer (1.45/1.31 vs 1.83/1.49 in one 10-rep
# run, not reproduced in two others); the sweep now uses the caller's buffer (the main table's)
# when given one, so that factor is gone too.
#
# ``reference`` (bench/io.py passes the main table's own runner: its handle, its buffer) runs
# right next to dsio's default point in every rep, so the report shows the default point and the
# main table's method measured in the same minutes.

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
        mem = aligned_buffer(size)
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
        fsync_path(path)
        cold &= drop_caches_verified(path)
        t0 = time.perf_counter()
        loop.run_until_complete(h.pread(buf, path))
        out["dsio"]["read"][name].append(size / (time.perf_counter() - t0) / 1e9)

    def measure_ds(server: DeepSpeedServer, name: str) -> None:
        nonlocal cold
        fresh()
        out["DeepSpeed"]["write"][name].append(server.call("write", path, 0, size)["gbps"])
        fsync_path(path)
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
    global DS_PY
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir",
        default=None,
        help="scratch folder on the disk under test (default: $DSIO_BENCH_DIR or <checkout>/.bench-tmp)",
    )
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=None, help="interleaved reps (default 5; 3 with --read-path)")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument(
        "--ds-python",
        default=None,
        help="DeepSpeed venv interpreter (default: $DSIO_DEEPSPEED_PYTHON, "
        "else $DSIO_DEEPSPEED_VENV/bin/python, else <checkout>/.venv-deepspeed/bin/python)",
    )
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--skip-fio", action="store_true")
    ap.add_argument("--skip-tuned", action="store_true", help="skip the tuned-vs-tuned sweep")
    ap.add_argument(
        "--tuned-reps", type=int, default=3, help="reps of the tuned sweep (each visits every point)"
    )
    ap.add_argument("--tuned-only", action="store_true", help="only the tuned-vs-tuned sweep")
    ap.add_argument(
        "--points", choices=("defaults", "all"), default="all", help="--tuned-only: the sweep's points"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="seconds (make bench): 64 MiB, 1 rep, 200 ops, the sweep's two default points, no DeepSpeed",
    )
    ap.add_argument("--read-path", action="store_true", help="only the issue-17 read-path matrix")
    ap.add_argument("--sizes-mib", default="512,2048", help="--read-path tensor sizes")
    ap.add_argument("--runs", type=int, default=5, help="--read-path: interleaved runs")
    ap.add_argument("--label", default="", help="appended to the result file names (e.g. under-load)")
    args = ap.parse_args()
    if args.quick:
        args.size_gib, args.reps, args.ops, args.tuned_reps, args.points = 1 / 16, 1, 200, 1, "defaults"
        args.skip_deepspeed, args.label = True, args.label or "quick"
    args.dir = args.dir or scratch_dir()
    os.makedirs(args.dir, exist_ok=True)
    DS_PY = None if args.skip_deepspeed else deepspeed_python(args.ds_python)
    meta = machine()
    meta["torch"] = torch.__version__
    meta["dsio backends"] = ", ".join(s.name for s in dsio.backend_status() if s.available)
    if args.read_path:
        main_read_path(args, meta)
        return
    if args.tuned_only:
        main_tuned(args, meta)
        return
    args.reps = args.reps or 5
    main_io(args, meta)


def main_read_path(args: argparse.Namespace, meta: dict) -> None:
    from bench.io_read_path import report_read_path, run_read_path

    sizes = [int(x) << 20 for x in args.sizes_mib.split(",")]
    reps = args.reps or 3
    bar = tqdm(desc="read path", unit="step")
    t0 = time.perf_counter()
    data = run_read_path(
        args.dir,
        sizes,
        args.runs,
        reps,
        DS_PY,
        DS_SCRIPT,
        progress=lambda s: (bar.set_postfix_str(s), bar.update()),
    )
    bar.close()
    header = (
        f"Disk `{args.dir}` ({fs_of(args.dir)}); {args.runs} runs x {reps} interleaved reps per case; "
        f"`IOConfig()` defaults; took {time.perf_counter() - t0:.0f} s."
        + (f" Label: **{args.label}**." if args.label else "")
    )
    md = report_read_path(data, meta, header)
    write_labelled_result("io-read-path", args.label, meta, md, {"args": vars(args), **data})


def tuned_points(points: str) -> list[Point]:
    return [DSIO_DEFAULT, DEEPSPEED_DEFAULT] if points == "defaults" else SWEEP


def main_tuned(args: argparse.Namespace, meta: dict) -> None:
    """Only the sweep, with the main table's method as the reference next to dsio's default."""
    size = int(args.size_gib * (1 << 30)) // MIB * MIB
    mem = aligned_buffer(size)
    buf = torch.frombuffer(mem, dtype=torch.uint8)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))  # as the main table's `locked`
    loop = asyncio.new_event_loop()
    runner = DsioRunner(loop, dsio.IOConfig(backend="io_uring"))
    seq_path = os.path.join(args.dir, "seq.bin")

    def reference() -> tuple[float, float]:
        o: dict[str, list[float]] = defaultdict(list)
        runner.seq(buf, seq_path, o)
        return o["write_new"][0], o["read"][0]

    t0 = time.perf_counter()
    try:
        data = run_tuned(
            args.dir,
            size,
            args.tuned_reps,
            DS_PY,
            DS_SCRIPT,
            lambda s: print(s, file=sys.stderr),
            sweep=tuned_points(args.points),
            buf=buf,
            reference=reference,
        )
    finally:
        runner.close()
        loop.close()
        unlink(seq_path)
    md = f"# Tuned sweep, {meta['date']}\n\nMachine: " + ", ".join(f"{k} {v}" for k, v in meta.items())
    md += f"\nPoints: {args.points}; {args.tuned_reps} reps; took {time.perf_counter() - t0:.0f} s"
    md += (
        f"; label: **{args.label}**" if args.label else ""
    ) + f"; load average at the end {os.getloadavg()}.\n"
    md += report_tuned(data, size)
    write_labelled_result("io-tuned", args.label, meta, md, {"args": vars(args), **data})


def main_io(args: argparse.Namespace, meta: dict) -> None:
    size = int(args.size_gib * (1 << 30)) // (1 << 20) * (1 << 20)
    seq_path = os.path.join(args.dir, "seq.bin")
    ops_path = os.path.join(args.dir, "ops.bin")

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    locked = torch.frombuffer(aligned_buffer(size), dtype=torch.uint8)
    locked.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    plain = unaligned_tensor(size)  # an ordinary tensor: not 4096-aligned, not locked
    ops_buf = torch.frombuffer(aligned_buffer(args.ops << 20), dtype=torch.uint8)
    ops_buf.fill_(7)

    default = dsio.IOConfig()
    backends = [s.name for s in dsio.backend_status() if s.available]
    runners = {b: DsioRunner(loop, dsio.IOConfig(backend=b)) for b in backends}
    steps: list[tuple[str, Callable[[dict[str, list[float]]], None]]] = []
    for b in backends:
        steps.append((f"dsio {b}, locked buffer", lambda o, b=b: runners[b].seq(locked, seq_path, o)))
        steps.append((f"dsio {b}, ordinary tensor", lambda o, b=b: runners[b].seq(plain, seq_path, o)))
    use_ds = DS_PY is not None
    use_fio = fio.fio_available() and not args.skip_fio
    if not use_fio and not args.skip_fio:
        print("bench: fio baseline skipped: no working `fio` on PATH (apt-get install fio)", file=sys.stderr)
    if use_ds:
        steps.append(("DeepSpeed aio_handle, locked", lambda o: ds_seq(seq_path, size, "locked", o)))
        steps.append(("DeepSpeed aio_handle, ordinary tensor", lambda o: ds_seq(seq_path, size, "plain", o)))
    if use_fio:
        steps.append(("fio libaio 1M QD32", lambda o: fio_seq(seq_path, size, "libaio", o)))
        steps.append(("fio io_uring 1M QD32", lambda o: fio_seq(seq_path, size, "io_uring", o)))
    uv = uvloop_runner(default)
    if uv is None:
        print(
            "bench: asyncio vs uvloop skipped: uvloop is not importable (pip install uvloop)", file=sys.stderr
        )
    for op_size in (64 << 10, 1 << 20):
        steps.append(
            (
                "dsio io_uring (default config)",
                lambda o, s=op_size: runners[
                    default.backend if default.backend != "auto" else backends[0]
                ].ops(ops_buf, s, args.ops, ops_path, o),
            )
        )
        if uv is not None and op_size == 64 << 10:  # the same calls on uvloop's loop, interleaved
            steps.append((UVLOOP, lambda o, s=op_size: uv.ops(ops_buf, s, args.ops, ops_path, o)))
        if use_ds:
            steps.append(("DeepSpeed aio_handle", lambda o, s=op_size: ds_ops(ops_path, s, args.ops, o)))
        if use_fio:
            steps.append(("fio libaio", lambda o, s=op_size: fio_ops(ops_path, s, args.ops, o)))

    res: Results = defaultdict(lambda: defaultdict(list))
    with tqdm(total=args.reps * len(steps), desc="bench io", unit="step") as bar:
        for rep in range(args.reps):
            for name, fn in steps:
                bar.set_postfix_str(f"rep {rep + 1}: {name}")
                fn(res[name])
                bar.update()
    if uv is not None:
        uv.close()
        uv.loop.close()
    unlink(ops_path)

    md = report(res, meta, args)
    if not args.skip_tuned:
        ref_runner = runners.get("io_uring") or next(iter(runners.values()))

        def reference() -> tuple[float, float]:
            """The main table's "dsio <backend>, locked buffer" method, once, next to the sweep's point."""
            o: dict[str, list[float]] = defaultdict(list)
            ref_runner.seq(locked, seq_path, o)
            return o["write_new"][0], o["read"][0]

        with tqdm(desc="tuned sweep", unit="step") as tbar:
            tuned = run_tuned(
                args.dir,
                size,
                args.tuned_reps,
                DS_PY,
                DS_SCRIPT,
                progress=lambda s: (tbar.set_postfix_str(s), tbar.update()),
                sweep=tuned_points(args.points),
                buf=locked,  # the main table's buffer: a second 1 GiB locked buffer is one difference less
                reference=reference,
            )
        main_defaults = {
            (side, op): v
            for side, m in (
                ("dsio", "dsio io_uring, locked buffer"),
                ("DeepSpeed", "DeepSpeed aio_handle, locked"),
            )
            for op, case in (("write", "write_new"), ("read", "read"))
            if (v := med(res, m, case)) is not None
        }
        md += report_tuned(tuned, size, main_defaults)
        res["tuned"] = tuned  # type: ignore[assignment]
    for r in runners.values():
        r.close()
    unlink(seq_path)
    kind = "io" + (f"-{args.label}" if args.label else "")
    out = result_path(kind)
    with open(out, "w") as f:
        f.write(md)
    with open(result_path(kind, "json"), "w") as f:
        json.dump({"meta": meta, "cold": COLD["ok"], "results": res}, f, indent=1)
    plot(res, result_path(kind, "png"))
    print(md)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
