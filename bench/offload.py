"""Offload benchmark: dstrain vs DeepSpeed with optimizer state (and parameters) in memory, on CPU, on NVMe.

ZeRO-3, fp32, AdamW, world size 2 on gloo, two shapes (bench/offload_methods.py): the anchors' 16.8M-
parameter MLP (``mlp``) and the ~110M GPT of bench/train.py (``gpt110m``). Every (shape, method, rep)
runs in fresh torchrun processes (bench/offload_worker.py), methods interleaved rep by rep, and a dsio
disk probe (fresh-file write and read through O_DIRECT) runs before each rep, so the I/O floor is
measured in the same time window as the steps it bounds.

    python bench/offload.py                                   # both shapes, every method, 3 reps
    python bench/offload.py --shapes mlp --methods dstrain-nvme,deepspeed-nvme --reps 1
    python bench/offload.py --tiny                            # seconds: tiny models, dstrain only
    python bench/offload.py --quick     # make bench: tiny models, the methods issue 32's targets need

Writes ``<out>.md``, ``.json`` and ``.png``; by default ``offload-<date>[-quick]`` under
``$DSIO_BENCH_RESULTS``, else bench/results (bench/_common.py's ``RESULTS``).

Per row: step time, peak RSS per rank, bytes swapped per step (dstrain's counters by kind and
direction; DeepSpeed's from its processes' /proc/<pid>/io) beside the formula they should equal, the
I/O floor (those bytes at the probe's GB/s), stall fraction and prefetch hit rate; then the issue-11
target lines (issue 11's, then issue 32's for parameters + optimizer state on NVMe, each met / MISSED)
and the per-step loss agreement with DeepSpeed.
DeepSpeed runs only where its interpreter imports deepspeed (``--ds-python``, ``$DSIO_DEEPSPEED_PYTHON``
or ``$DSIO_DEEPSPEED_VENV/bin/python``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import RESULTS, deepspeed_python, scratch_dir  # noqa: E402
from bench.offload_methods import DEFAULT_METHODS, METHODS, SHAPES  # noqa: E402
from bench.offload_report import plot, render, summarize  # noqa: E402

WORKER = Path(__file__).resolve().parent / "offload_worker.py"
UNDER_LOAD = 2.5
"""1-minute load average between runs above which the report is labelled as run under load (the
benchmark's own two ranks have just left; the rest is other jobs)."""


QUICK_METHODS = ("dstrain-cpu", "dstrain-nvme", "dstrain-paramopt-nvme")
"""What ``--quick`` runs: the rows the target lines of issues 11 and 32 compare (dstrain's only)."""


class BenchError(RuntimeError):
    """Bad arguments to the benchmark (an unknown shape or method, a scratch folder that cannot be used)."""


def disk_probe(directory: str, nbytes: int) -> dict[str, Any]:
    """GB/s of one fresh-file write (fsync'ed) and one read of ``nbytes`` through dsio (O_DIRECT)."""
    code = f"""
import json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
import dsio
from dsio._bridge import run_sync
from dsio.pool import PinnedPool
async def main():
    path = os.path.join({directory!r}, "probe.bin")
    pool = PinnedPool({nbytes}, {nbytes})
    lease = pool.try_acquire(); t = lease.tensor; t.fill_(7)
    try:
        async with dsio.AsyncIOHandle(dsio.IOConfig(queue_depth=32)) as h:
            t0 = time.perf_counter(); await h.pwrite(t, path, fsync=True); w = time.perf_counter() - t0
            t0 = time.perf_counter(); await h.pread(t, path); r = time.perf_counter() - t0
    finally:
        if os.path.exists(path):
            os.unlink(path)
        lease.release(); pool.close()
    return {{"write_gbps": {nbytes} / w / 1e9, "read_gbps": {nbytes} / r / 1e9}}
print(json.dumps(run_sync(main(), timeout=300)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=330)
    if out.returncode:
        return {"error": out.stderr[-800:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker run: ``base`` with one thread per rank, DeepSpeed on CPU, and the
    checkout first on PYTHONPATH, followed by whatever ``base``'s PYTHONPATH already held (on the GPU
    machine the wheels are installed with ``--target`` and live there)."""
    path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
    return dict(base, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=path)


def run_one(args: argparse.Namespace, shape: str, method: str, python: str, nvme_dir: str) -> dict[str, Any]:
    """One (shape, method) run in fresh torchrun processes; its ranks' results or its error output."""
    impl = METHODS[method].impl
    env = worker_env(os.environ)
    if impl == "deepspeed":
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(python).parent.parent / "torch_extensions"))
    shutil.rmtree(nvme_dir, ignore_errors=True)
    os.makedirs(nvme_dir)
    sh = SHAPES[shape].tiny() if args.tiny else SHAPES[shape]
    cmd = [
        python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
        "--shape", shape, "--method", method, "--steps", str(args.steps or sh.steps),
        "--nvme-dir", nvme_dir, "--pinned", str(args.pinned or sh.pinned_for(METHODS[method])),
    ]  # fmt: skip
    if args.tiny:
        cmd.append("--tiny")
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\nTimeoutExpired: run exceeded {args.timeout} s", -1
    wall = time.perf_counter() - t0
    shutil.rmtree(nvme_dir, ignore_errors=True)
    base = {"shape": shape, "method": method, "wall_s": wall, "loadavg_before": os.getloadavg()[0]}
    for line in text.splitlines():
        if line.startswith("RESULT ") and rc == 0:
            return {**base, "ranks": json.loads(line[7:])}
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return {**base, "error": text[-4000:]}


def _ds_ok(python: str | None) -> bool:
    if python is None:
        return False
    probe = subprocess.run(
        [python, "-c", "import deepspeed"], capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}
    )
    return probe.returncode == 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--methods", default=None, help=f"comma-separated, of {', '.join(METHODS)} (default: all)")
    p.add_argument("--reps", type=int, default=None, help="interleaved reps (default 3; 1 with --tiny)")
    p.add_argument(
        "--steps", type=int, default=None, help="steps per run, 2 warm-up included (default per shape)"
    )
    p.add_argument(
        "--pinned", type=int, default=None, help="dstrain offload_pinned_bytes per rank (default per shape)"
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny models, dstrain methods only unless --methods says"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="seconds (make bench): --tiny, both shapes, " + ", ".join(QUICK_METHODS) + ", 1 rep; "
        "files offload-<date>-quick",
    )
    p.add_argument(
        "--nvme-dir", default=None, help="scratch folder on the disk under test (default $DSIO_BENCH_DIR)"
    )
    p.add_argument("--ds-python", default=None, help="DeepSpeed's interpreter (see bench/_common.py)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--label", default="", help="appended to the report's title")
    p.add_argument(
        "--out", default=None, help="result file stem (default $DSIO_BENCH_RESULTS/offload-<date>[-quick])"
    )
    p.add_argument("--from-json", default=None, help="re-render the report and PNG of an earlier run's .json")
    args = p.parse_args(argv)
    if args.quick:
        args.tiny = True
        args.methods = args.methods or ",".join(QUICK_METHODS)
    args.shape_list = [s for s in args.shapes.split(",") if s]
    bad = [s for s in args.shape_list if s not in SHAPES]
    if bad or not args.shape_list:
        raise BenchError(f"--shapes: unknown {bad or 'empty'}; known: {', '.join(SHAPES)}")
    if args.methods is None:
        args.method_list = [m for m in DEFAULT_METHODS if not (args.tiny and m.startswith("deepspeed"))]
    else:
        args.method_list = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.method_list if m not in METHODS]
    if bad or not args.method_list:
        raise BenchError(f"--methods: unknown {bad or 'empty'}; known: {', '.join(METHODS)}")
    if args.reps is None:
        args.reps = 1 if args.tiny else 3
    for name in ("reps", "steps", "pinned", "timeout"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise BenchError(f"--{name}: must be positive, got {v}")
    if args.steps is not None and args.steps < 3:
        raise BenchError(f"--steps: at least 3 (2 warm-up + 1 timed), got {args.steps}")
    return args


def default_stem(args: argparse.Namespace, results: str = RESULTS) -> str:
    """``<results>/offload-<date>[-quick]``: where a run without ``--out`` writes its files."""
    return os.path.join(results, f"offload-{datetime.date.today()}{'-quick' if args.quick else ''}")


def write(stem: str, meta: dict[str, Any], runs: list[dict[str, Any]], probes: list[dict[str, Any]]) -> str:
    summary = summarize(runs, probes)
    text = render({**meta, "runs": runs}, summary)
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".md").write_text(text)
    Path(stem + ".json").write_text(
        json.dumps({"meta": meta, "runs": runs, "probes": probes, "summary": summary}, indent=1)
    )
    plot(summary, Path(stem + ".png"))
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        stem = args.out or str(Path(args.from_json).with_suffix(""))
        print(write(stem, saved["meta"], saved["runs"], saved["probes"]))
        return 0
    methods = list(args.method_list)
    skipped: list[str] = []
    ds_py = deepspeed_python(args.ds_python) if any(m.startswith("deepspeed") for m in methods) else None
    if any(m.startswith("deepspeed") for m in methods) and not _ds_ok(ds_py):
        skipped = [m for m in methods if m.startswith("deepspeed")]
        print(f"DeepSpeed not importable with {ds_py}: skipping {', '.join(skipped)}", file=sys.stderr)
        methods = [m for m in methods if m not in skipped]
    base = args.nvme_dir or scratch_dir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="offload-bench-", dir=base)
    runs: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    loads: list[float] = []
    probe_mib = 16 if args.tiny else 256
    try:
        from tqdm import tqdm

        bar: Any = tqdm(total=args.reps * len(methods) * len(args.shape_list), unit="run", file=sys.stderr)
    except ImportError:
        bar = None
    try:
        for rep in range(args.reps):
            loads.append(os.getloadavg()[0])
            probes.append(disk_probe(work, probe_mib << 20))
            for shape in args.shape_list:
                for m in methods:
                    py = ds_py if METHODS[m].impl == "deepspeed" and ds_py else sys.executable
                    r = run_one(args, shape, m, py, os.path.join(work, "swap"))
                    r["rep"] = rep
                    runs.append(r)
                    loads.append(r["loadavg_before"])
                    brief = (
                        f"{max(x['median_step_s'] for x in r['ranks']):.3f} s/step"
                        if "ranks" in r
                        else "FAILED " + r["error"].strip().splitlines()[-1][:160]
                    )
                    msg = f"rep {rep + 1} {shape} {m}: {brief} (wall {r['wall_s']:.0f} s)"
                    if bar is not None:
                        bar.write(msg)
                        bar.update(1)
                    else:
                        print(msg, flush=True)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "label": args.label,
        "reps": args.reps,
        "steps": args.steps,
        "pinned": args.pinned,
        "tiny": args.tiny,
        "quick": args.quick,
        "shapes": args.shape_list,
        "methods": methods,
        "skipped": skipped,
        "probe_mib": probe_mib,
        "loadavg": loads,
        "under_load": bool(loads) and sorted(loads)[len(loads) // 2] > UNDER_LOAD,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    stem = args.out or default_stem(args)
    print(write(stem, meta, runs, probes))
    print(f"wrote {stem}.md, {stem}.json, {stem}.png")
    # a mode the library refuses (NotImplementedConfigError) is a row of the report, not a failed bench
    broken = [r for r in runs if "ranks" not in r and "NotImplementedConfigError" not in r["error"]]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
