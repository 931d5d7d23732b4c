"""ZeRO-Infinity on one GPU: a ~1.1B-parameter GPT with parameters and optimizer state on NVMe.

dstrain ZeRO-3, bf16, CUDA tensors (the GPT of bench/train.py, imported), ``offload_param`` and
``offload_optimizer`` both ``nvme`` under ``--nvme-path``, swapped through dsio. Records tokens/s,
the swap GB/s read and written (dstrain's own counters over the timed steps) and the disk's own GB/s
measured in the same run (dsio O_DIRECT write + read of a ``--probe-gib`` file in the same folder,
before and after training), into ``--out``.json and .md.

    python bench/offload_gpu.py                                  # the H200 run (1 GPU, world 1)
    torchrun --standalone --nproc_per_node 2 bench/offload_gpu.py     # 2 GPUs: world 2 on NCCL
    python bench/offload_gpu.py --device cpu --tiny              # CPU dry run of the same code path
    python bench/offload_gpu.py --quick       # make bench: that dry run, files offload-gpu-<date>-quick

Files: ``--out``, else ``$OUT/offload-gpu-<date>`` (the device machine's result folder), else under
``$DSIO_BENCH_RESULTS`` or bench/results (bench/_common.py's ``RESULTS``). The report ends with issue
32's target lines that one run can judge (step vs the I/O floor of the disk probes); the side-by-side
with DeepSpeed is bench/offload_gpu_table.py's.

Sizing (the defaults): 20 layers, d=2048, 16 heads, vocab 32000, seq 1024, micro batch 4: 1.07B
parameters. Per step dstrain moves about 8 B/param of Adam m+v in, 8 B out, and the bf16 shards in for
the forward and backward gathers and out once (~6 B/param): ~23 GB, about 12 s per step when the disk
reads and writes ~1 GB/s each at once, so 20 steps take ~4-5 minutes plus ~1 minute to build, place
and write the initial state; compute is ~0.1 s per step on an H200. ``--time-budget-s`` (default 330)
stops the steps early if the disk is slower than that, and the report says so. GPU memory: bf16
weights 2 GiB, the fp32 master 4 GiB, activations ~6 GiB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
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

from bench._common import RESULTS  # noqa: E402


class GpuBenchError(RuntimeError):
    """The run cannot start as asked (no CUDA for --device cuda, an unusable --nvme-path)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--tiny", action="store_true", help="a 0.2M-parameter GPT, 3 steps, 16 MiB probe (dry run)"
    )
    p.add_argument(
        "--quick", action="store_true", help="seconds (make bench): --device cpu --tiny, files *-quick"
    )
    p.add_argument("--nvme-path", default=None, help="swap folder on the disk under test (default /var/tmp)")
    p.add_argument(
        "--offload",
        default="both",
        choices=("both", "param", "optimizer", "cpu"),
        help="what goes to NVMe: parameters and optimizer state (default), or one of them; cpu: the "
        "optimizer state on the CPU (ZeRO-Offload), nothing on NVMe",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="micro batch per rank")
    p.add_argument("--pinned-gib", type=float, default=4.0, help="dstrain offload_pinned_bytes per rank, GiB")
    p.add_argument("--sub-group", type=int, default=100_000_000, help="zero_optimization.sub_group_size")
    p.add_argument("--probe-gib", type=float, default=1.0, help="size of the disk probe's file")
    p.add_argument("--time-budget-s", type=float, default=330.0, help="stop the steps after this long")
    p.add_argument(
        "--out", default=None, help="result stem (default $OUT/offload-gpu-<date>, else $DSIO_BENCH_RESULTS)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.tiny = "cpu", True
    if args.tiny:
        args.layers, args.dim, args.heads, args.vocab, args.seq, args.batch = 2, 64, 4, 512, 32, 2
        args.steps, args.warmup, args.pinned_gib, args.sub_group, args.probe_gib = 3, 1, 1 / 16, 16384, 1 / 64
    for name in ("steps", "layers", "dim", "heads", "vocab", "seq", "batch", "sub_group"):
        if getattr(args, name) <= 0:
            raise GpuBenchError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.warmup < 0 or args.warmup >= args.steps:
        raise GpuBenchError(f"--warmup: must be in [0, --steps), got {args.warmup}")
    return args


def check_device(device: str) -> str:
    """The device's name; a clear error before anything is built when CUDA is asked for and missing."""
    import torch

    if device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise GpuBenchError(
            f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'}); run this on the GPU machine, or use --device cpu --tiny for the "
            "CPU dry run"
        )
    return torch.cuda.get_device_name()


def check_nvme_path(path: str) -> str:
    """Create ``path`` and return its filesystem type; refuse tmpfs (no O_DIRECT, and it is RAM)."""
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise GpuBenchError(f"--nvme-path {path}: not writable")
    fs = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        raise GpuBenchError(f"--nvme-path {path} is on {fs} (memory, no O_DIRECT): give a folder on the disk")
    return fs or "?"


def disk_probe(directory: str, nbytes: int) -> dict[str, float]:
    """GB/s of a fresh-file write (fsync'ed) and a read of ``nbytes`` through dsio with O_DIRECT."""
    import dsio
    from dsio._bridge import run_sync
    from dsio.pool import PinnedPool

    path = os.path.join(directory, "disk-probe.bin")

    async def probe() -> dict[str, float]:
        pool = PinnedPool(nbytes, nbytes)
        lease = pool.try_acquire()
        assert lease is not None  # a fresh pool of one buffer
        try:
            t = lease.tensor
            t.fill_(7)
            async with dsio.AsyncIOHandle(dsio.IOConfig(queue_depth=32)) as h:
                t0 = time.perf_counter()
                await h.pwrite(t, path, fsync=True)
                w = time.perf_counter() - t0
                t0 = time.perf_counter()
                await h.pread(t, path)
                r = time.perf_counter() - t0
        finally:
            lease.release()
            pool.close()
            if os.path.exists(path):
                os.unlink(path)
        return {"write_gbps": nbytes / w / 1e9, "read_gbps": nbytes / r / 1e9, "bytes": nbytes}

    return run_sync(probe(), timeout=600)


def _swap_counters(sources: tuple[Any, ...]) -> dict[str, float]:
    from bench.offload_worker import offload_counters

    return offload_counters(*sources) or {}


def host_peak_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def train(args: argparse.Namespace, nvme_dir: str) -> dict[str, Any]:
    """Build, initialize and train; the measured numbers of this rank."""
    import torch
    import torch.distributed as dist

    from bench.train import _import_dstrain, build_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model = build_model(args).to(device)
    params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t0
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group,
            "offload_pinned_bytes": int(args.pinned_gib * 2**30),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 2, "overlap_events": True},
    }
    nvme = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
    if args.offload in ("both", "optimizer"):
        cfg["zero_optimization"]["offload_optimizer"] = dict(nvme)
    if args.offload in ("both", "param"):
        cfg["zero_optimization"]["offload_param"] = dict(nvme)
    if args.offload == "cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    dstrain = _import_dstrain()
    t0 = time.perf_counter()
    engine, optimizer, _, _ = dstrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    sources = (optimizer, engine, getattr(getattr(engine, "zero", None), "store", None))
    g = torch.Generator().manual_seed(1234 + rank)
    times: list[float] = []
    losses: list[float] = []
    c0: dict[str, float] = {}
    timed_start = 0.0
    start = time.perf_counter()
    stopped = ""
    try:
        for i in range(args.steps):
            if i == args.warmup:
                _sync(args.device)
                c0, timed_start = _swap_counters(sources), time.perf_counter()
            b = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)  # (B, T+1)
            t = time.perf_counter()
            loss = engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())  # (B, T) each
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()))
            _sync(args.device)
            times.append(time.perf_counter() - t)
            if time.perf_counter() - start > args.time_budget_s and i + 1 < args.steps:
                stopped = f"stopped after {i + 1} of {args.steps} steps: --time-budget-s {args.time_budget_s:.0f} spent"
                break
        _sync(args.device)
        timed_s = time.perf_counter() - timed_start if timed_start else 0.0
        c1 = _swap_counters(sources)
    finally:
        for obj in (engine, optimizer):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
    timed = times[args.warmup :]
    moved = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if k.endswith(("_read_bytes", "_written_bytes"))}
    read = sum(v for k, v in moved.items() if k.endswith("_read_bytes"))
    written = sum(v for k, v in moved.items() if k.endswith("_written_bytes"))
    out: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "params": params,
        "build_s": build_s,
        "init_s": init_s,
        "steps_s": times,
        "losses": losses,
        "timed_steps": len(timed),
        "stopped": stopped,
        "tokens_per_s": (len(timed) * args.batch * args.seq * world / timed_s) if timed and timed_s else None,
        "swap_bytes": moved,
        "swap_read_gbps": read / timed_s / 1e9 if timed_s else None,
        "swap_write_gbps": written / timed_s / 1e9 if timed_s else None,
        "stall_s": c1.get("stall_s", 0.0) - c0.get("stall_s", 0.0),
        "prefetch_hits": c1.get("hits", 0) - c0.get("hits", 0),
        "prefetch_misses": c1.get("misses", 0) - c0.get("misses", 0),
        "pinned_bytes": c1.get("pinned_bytes", 0),
    }
    if args.device == "cuda":
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["gpu_bytes_per_param"] = torch.cuda.max_memory_allocated(device) / params
    out["host_peak_mib"] = host_peak_mib()
    if world > 1:
        dist.destroy_process_group()
    return out


_WHAT = {
    "both": "parameters and optimizer state on NVMe",
    "param": "parameters on NVMe",
    "optimizer": "optimizer state on NVMe",
    "cpu": "optimizer state on the CPU",
}


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def render(meta: dict[str, Any], result: dict[str, Any]) -> str:
    lines = [f"# ZeRO-Infinity on {meta['gpu']} ({meta['host']}), {meta['date']}", ""]
    if "error" in result:
        return (
            "\n".join([*lines, f"**Failed**: `{result['error']}`", "", f"Command: `{meta['command']}`"])
            + "\n"
        )
    a, probes = meta["args"], meta["probes"]
    tps = result["tokens_per_s"]
    lines += [
        f"dstrain ZeRO-3, bf16, world {result['world']} on {meta['device']}: GPT of bench/train.py, "
        f"{result['params'] / 1e6:,.1f}M parameters ({a['layers']} layers, d={a['dim']}, {a['heads']} heads, vocab "
        f"{a['vocab']}, seq {a['seq']}), micro batch {a['batch']}; {_WHAT[a['offload']]} "
        f"({meta['nvme_path']}, {meta['fs']}), pinned budget {a['pinned_gib']:g} GiB per rank.",
        "",
        "| tokens/s | step s (median) | timed steps | swap read GB/s | swap write GB/s | swapped per step | stall s/step | "
        "prefetch hits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    timed = result["steps_s"][a["warmup"] :]
    med = sorted(timed)[len(timed) // 2] if timed else float("nan")
    per_step = sum(result["swap_bytes"].values()) / max(1, result["timed_steps"])
    hits, misses = result["prefetch_hits"], result["prefetch_misses"]
    lines.append(
        f"| {tps:,.0f} | {med:.2f} | {result['timed_steps']} | {result['swap_read_gbps'] or 0:.2f} | "
        f"{result['swap_write_gbps'] or 0:.2f} | {_bytes(per_step)} | "
        f"{result['stall_s'] / max(1, result['timed_steps']):.2f} | "
        f"{hits / (hits + misses):.0%} |"
        if tps is not None and hits + misses
        else f"| {tps} | {med:.2f} | {result['timed_steps']} | | | {_bytes(per_step)} | | |"
    )
    lines += ["", "Disk in the same run (dsio, O_DIRECT, fresh file, fsync'ed):", ""]
    for name, p in probes.items():
        lines.append(
            f"- {name}: write {p['write_gbps']:.2f} GB/s, read {p['read_gbps']:.2f} GB/s ({p['bytes'] / 2**30:g} GiB)"
        )
    lines += [
        "",
        "Swap GB/s: bytes dstrain's swappers moved over the timed steps / their wall time (compute included). "
        "Swapped by kind over the timed steps: "
        + ", ".join(f"{k.replace('_', ' ')} {_bytes(v)}" for k, v in result["swap_bytes"].items()),
        f"Build {result['build_s']:.0f} s, initialize {result['init_s']:.0f} s, steps {sum(result['steps_s']):.0f} s"
        + (
            f"; GPU peak {result['gpu_peak_gib']:.1f} GiB ({result['gpu_bytes_per_param']:.2f} B/param)"
            if "gpu_peak_gib" in result
            else ""
        )
        + f"; host peak {result['host_peak_mib']:,.0f} MiB"
        + ".",
    ]
    if result["stopped"]:
        lines += ["", f"**{result['stopped']}**"]
    lines += ["", "Targets (issue 32):", "", *targets(meta, result)]
    lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def targets(meta: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """Issue 32's lines one run can judge, met / MISSED: the median step against the I/O floor (this
    run's swapped bytes per step at the disk probes' median GB/s; on the GPU compute is far below it),
    with the stall fraction and prefetch hits beside it. The comparison with DeepSpeed (tokens/s,
    GPU peak) needs its run beside this one: bench/offload_gpu_table.py."""
    a, probes = meta["args"], list(meta["probes"].values())
    timed = result["steps_s"][a["warmup"] :]
    k = max(1, result["timed_steps"])
    out = []
    if a["offload"] == "cpu" or not result["swap_bytes"]:
        out.append("- step vs the I/O floor: nothing is swapped to NVMe in this mode")
    elif not timed or not probes:
        out.append("- step vs the I/O floor: not measured (no timed step or no disk probe)")
    else:
        step = statistics.median(timed)
        rd = sum(v for n, v in result["swap_bytes"].items() if n.endswith("_read_bytes")) / k
        wr = sum(v for n, v in result["swap_bytes"].items() if n.endswith("_written_bytes")) / k
        r_gbps = statistics.median(p["read_gbps"] for p in probes)
        w_gbps = statistics.median(p["write_gbps"] for p in probes)
        floor = rd / (r_gbps * 1e9) + wr / (w_gbps * 1e9)
        ratio = step / floor if floor > 0 else float("inf")
        stall = result["stall_s"] / k / step if step > 0 else 0.0
        hits, misses = result["prefetch_hits"], result["prefetch_misses"]
        out.append(
            f"- step {step:.2f} s = {ratio:.2f}x the I/O floor {floor:.2f} s ({_bytes(rd)} read at "
            f"{r_gbps:.2f} GB/s + {_bytes(wr)} written at {w_gbps:.2f} GB/s per step) (target <= 1.1x: "
            f"{'met' if ratio <= 1.1 else 'MISSED'}); stall fraction {stall:.2f}, prefetch hits "
            + (f"{hits / (hits + misses):.0%}" if hits + misses else "-")
        )
    out.append(
        "- dstrain >= 1.5x DeepSpeed's tokens/s with a lower GPU peak, GPU bytes per parameter beside "
        "DeepSpeed's: not judged by this run (DeepSpeed in the same run: bench/offload_gpu_h200.sh, "
        "bench/offload_gpu_table.py)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = check_device(args.device)  # fail fast, before building anything
    base = args.nvme_path or os.environ.get("DSIO_BENCH_DIR") or "/var/tmp"
    fs = check_nvme_path(base)
    rank = int(os.environ.get("RANK", "0"))
    nvme_dir = tempfile.mkdtemp(prefix=f"offload-gpu-r{rank}-", dir=base)
    probe_bytes = int(args.probe_gib * 2**30) // 4096 * 4096
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "gpu": gpu,
        "device": args.device,
        "nvme_path": base,
        "fs": fs,
        "args": vars(args),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "probes": {},
    }
    result: dict[str, Any] = {"error": "interrupted before training"}
    try:
        meta["probes"]["before training"] = disk_probe(nvme_dir, probe_bytes)
        result = train(args, nvme_dir)
        meta["probes"]["after training"] = disk_probe(nvme_dir, probe_bytes)
    except BaseException as e:  # recorded in the result files, then re-raised
        where = "" if "error" in result else "after training: "
        result = {**result, "error": f"{where}{type(e).__name__}: {e}"}
        raise
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if rank == 0:
            _write(args, meta, result)
    return 0


def default_stem(args: argparse.Namespace, env: Mapping[str, str], results: str = RESULTS) -> str:
    """Where a run without ``--out`` writes: ``$OUT/offload-gpu-<date>`` on the device machine, else
    ``<results>/offload-gpu-<date>[-quick]``."""
    name = f"offload-gpu-{datetime.date.today()}"
    if env.get("OUT"):
        return os.path.join(env["OUT"], name)
    return os.path.join(results, name + ("-quick" if args.quick else ""))


def _write(args: argparse.Namespace, meta: dict[str, Any], result: dict[str, Any]) -> None:
    stem = args.out or default_stem(args, os.environ)
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".json").write_text(json.dumps({"meta": meta, "result": result}, indent=1))
    text = render(meta, result)
    Path(stem + ".md").write_text(text)
    print(text)
    print(f"wrote {stem}.md and {stem}.json", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GpuBenchError as e:
        print(f"offload_gpu: {e}", file=sys.stderr)
        sys.exit(2)
