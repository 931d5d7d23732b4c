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
    python bench/offload_gpu.py --fit-disk --dim 2560 --heads 20   # the largest GPT the disk holds (~3B)

Files: ``--out``, else ``$OUT/offload-gpu-<date>`` (the device machine's result folder), else under
``$DSIO_BENCH_RESULTS`` or bench/results (bench/_common.py's ``RESULTS``). The report ends with issue
32's target lines that one run can judge (step vs the I/O floor of the disk probes); the side-by-side
with DeepSpeed is bench/offload_gpu_table.py's.

Sizing (the defaults): 20 layers, d=2048, 16 heads, vocab 32000, seq 1024, micro batch 4: 1.07B
parameters. Per step dstrain moves about 8 B/param of Adam m+v in, 8 B out, and the bf16 shards in for
the forward and backward gathers and out once (~6 B/param): ~23 GB, about 12 s per step when the disk
reads and writes ~1 GB/s each at once, so 20 steps take ~4-5 minutes plus ~1 minute to build, place
and write the initial state; compute is ~0.1 s per step on an H200. ``--time-budget-s`` (default 330)
stops the steps early if the disk is slower than that (before a step the last one says would end
past it), and the report says so; SIGTERM (``timeout``) ends the run with its JSON written, the steps
done so far in it. The model is built on the training device (as DeepSpeed's twin does); the GPU
peak is reported twice: over the training steps (``gpu_peak_gib``, the peak memory stats reset after
``initialize``; what the offload modes are compared by) and over the whole run (``gpu_peak_run_gib``:
the fp32 model before ``initialize`` partitions it included). Where the fp32 master, the gradient
partitions and the shards live (device, host memory and whether page-locked, a file) is recorded
(``placement``): ZeRO-Offload (``--offload cpu``) keeps the master and gradients in host memory.

``--fit-disk``: more layers, up to ``--max-params``, as many as the free bytes under ``--nvme-path``
hold at 18 swap bytes a parameter with 10% spare (bench/bigmodel.py's sizing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
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
    """The run cannot start as asked (no CUDA for --device cuda, an unusable --nvme-path, a disk too
    small for ``--fit-disk``)."""


class BudgetKilled(Exception):
    """SIGTERM (the driver's ``timeout``): the run ends here, its JSON written with what was measured."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise BudgetKilled(f"killed by signal {signum} (the driver's time budget)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The GPT of the GPU comparison (1.07B at these defaults): one definition for dstrain's driver,
    DeepSpeed's baseline and the profile experiment, so the side by side trains the same model."""
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="micro batch per rank")


def add_gather_args(p: argparse.ArgumentParser) -> None:
    """The gathered-parameter cap of the comparison: one flag for dstrain's driver and DeepSpeed's twin,
    which both put `max_live_params` into their config."""
    p.add_argument(
        "--max-live-params",
        type=float,
        default=None,
        help="zero_optimization.stage3_max_live_parameters of both dstrain and DeepSpeed (default with the "
        "parameters on NVMe: the embedding plus one transformer layer, vocab*d + 12*d*d elements; else "
        "unset, DeepSpeed's 1e9)",
    )


def max_live_params(args: argparse.Namespace) -> int | None:
    """``zero_optimization.stage3_max_live_parameters`` of the run: ``--max-live-params``; else, with the
    parameters on NVMe (``--offload both`` / ``param``), the embedding plus one transformer layer
    (``vocab*d + 12*d*d`` elements, 115.9M on the 1.07B GPT: the tied embedding stays gathered through
    backward, and one layer's units prefetched beside it is what overlap needs: each gather copies its
    shard from a read-ahead buffer, which the store's own read-ahead keeps reading ahead whatever the
    gather prefetch depth); else None (unset: DeepSpeed's 1e9, where a world-1 pass binds the
    parameters to the resident shards and gathers no copies). Prefetching up to 1e9 kept 1.85 GiB of
    gathered copies on the GPU at the 1.07B GPT's peak (bench/results/offload-gpu-h200-2026-12-01-s9-call2.md).
    DeepSpeed's twin gets the same value (a no-op there with its ``stage3_prefetch_bucket_size`` 0:
    DeepSpeed counts it only when prefetching)."""
    if args.max_live_params is not None:
        return int(args.max_live_params)
    if args.offload in ("both", "param"):
        return args.vocab * args.dim + 12 * args.dim * args.dim
    return None


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
    p.add_argument("--steps", type=int, default=None, help="steps in all (default 20; --tiny: 3)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    add_model_args(p)
    add_gather_args(p)
    p.add_argument("--pinned-gib", type=float, default=4.0, help="dstrain offload_pinned_bytes per rank, GiB")
    p.add_argument("--sub-group", type=int, default=100_000_000, help="zero_optimization.sub_group_size")
    p.add_argument("--probe-gib", type=float, default=1.0, help="size of the disk probe's file")
    p.add_argument("--time-budget-s", type=float, default=330.0, help="stop the steps after this long")
    p.add_argument(
        "--fit-disk",
        action="store_true",
        help="as many layers (up to --max-params) as the free bytes under --nvme-path hold (18 B/param, 10%% spare)",
    )
    p.add_argument("--max-params", type=float, default=3.2e9, help="--fit-disk's upper bound")
    p.add_argument(
        "--memory-breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA: record the allocator's history during initialize and one extra step after the "
        "timed ones, and report the GPU memory at that step's peak by allocation site (bench/gpu_memory.py)",
    )
    p.add_argument(
        "--out", default=None, help="result stem (default $OUT/offload-gpu-<date>, else $DSIO_BENCH_RESULTS)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.tiny = "cpu", True
    if args.tiny:
        args.layers, args.dim, args.heads, args.vocab, args.seq, args.batch = 2, 64, 4, 512, 32, 2
        args.warmup, args.pinned_gib, args.sub_group, args.probe_gib = 1, 1 / 16, 16384, 1 / 64
        args.steps = 3 if args.steps is None else args.steps
    if args.steps is None:
        args.steps = 20
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


def block_bytes(path: str) -> tuple[int, int] | None:
    """(bytes read, bytes written) so far by the block device holding ``path`` (its
    ``/sys/dev/block/<major>:<minor>/stat`` sectors: the whole machine's I/O to it, so a bench that
    runs alone on it can count what a library moved without its cooperation); None where there is no
    such device (overlay, tmpfs)."""
    st = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}/stat") as f:
            fields = f.read().split()
    except OSError:
        return None
    return int(fields[2]) * 512, int(fields[6]) * 512


def budget_stop(times: list[float], steps: int, warmup: int, spent: float, budget: float) -> str:
    """Why to stop before the next step ('' to go on): it would end past ``budget`` seconds of steps,
    the last step's time saying how long one takes; never before a step after the warm-up is timed.
    (DeepSpeed's twin, bench/baselines/deepspeed_offload_gpu.py, stops by the same rule.)"""
    done = len(times)
    if done >= steps or done <= warmup or spent + times[-1] <= budget:
        return ""
    return (
        f"stopped after {done} of {steps} steps: --time-budget-s {budget:.0f} would be passed by another "
        f"{times[-1]:.0f} s step"
    )


def _swap_counters(sources: tuple[Any, ...]) -> dict[str, float]:
    from bench.offload_worker import offload_counters

    return offload_counters(*sources) or {}


def _drain(optimizer: Any) -> None:
    """Let the offloaded optimizer's swap transfers in flight finish, so the swap counters (counted
    when a transfer completes) between two such points count exactly the steps between them: a
    sub-group's m and v are written behind its step (on the step thread, maybe after `step()`
    returns), so a window closed without this missed the last sub-group's write now and then while
    the one before it had landed (one 16384-element sub-group short in the --quick run, under load)."""
    from dstrain.offload import OffloadAdam

    if isinstance(optimizer, OffloadAdam):
        optimizer.drain()


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


def fit_layers(args: argparse.Namespace, free: int) -> tuple[int, str]:
    """``--fit-disk``: the most layers (at least ``--layers``, at most ``--max-params`` parameters) whose
    swap files fit ``free`` bytes with bench/bigmodel.py's margin; and how they were chosen."""
    from bench.bigmodel import DISK_BYTES_PER_PARAM, SPARE, gpt_numel

    def numel(n: int) -> int:
        return gpt_numel(n, args.dim, args.vocab, args.seq)

    def fits(n: int) -> bool:
        return numel(n) * DISK_BYTES_PER_PARAM <= free * (1 - SPARE)

    if not fits(args.layers):
        raise GpuBenchError(
            f"--fit-disk: {args.layers} layers of d={args.dim} need "
            f"{numel(args.layers) * DISK_BYTES_PER_PARAM / 1e9:.1f} GB of swap files, {free / 1e9:.1f} GB are "
            f"free under --nvme-path (keeping {SPARE:.0%} spare)"
        )
    n = args.layers
    while fits(n + 1) and numel(n + 1) <= args.max_params:
        n += 1
    limit = "the disk" if not fits(n + 1) else f"--max-params {args.max_params:.3g}"
    return n, (
        f"{n} layers ({numel(n) / 1e9:.2f}B params, {numel(n) * DISK_BYTES_PER_PARAM / 1e9:.1f} GB of swap files at "
        f"{DISK_BYTES_PER_PARAM} B/param; {free / 1e9:.1f} GB free, {SPARE:.0%} kept spare): limited by {limit}"
    )


def placement(engine: Any) -> dict[str, str]:
    """Where a ZeRO-3 engine's fp32 master, gradient partitions and shards live: ``cuda``, ``cpu``
    (``cpu pinned`` when page-locked), ``file`` (swapped), or ``-`` (none). ZeRO-Offload keeps the
    master and gradients in host memory (`dstrain.offload.param.host_master`)."""
    import torch

    zero = engine.zero
    groups = zero.groups

    def where(t: Any) -> str:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
            return "file"  # a storage-less placeholder (views keep the shapes): the values are in a file
        return t.device.type + (" pinned" if t.device.type == "cpu" and t.is_pinned() else "")

    def kinds(ts: list[Any]) -> str:
        return ", ".join(sorted({where(t) for t in ts})) or "-"

    on_file = zero.store.grads is not None
    return {
        "store": type(zero.store).__name__,
        "master": kinds([g.master for g in groups]),
        "grads": "file" if on_file else kinds([g.master_grad for g in groups]),
        "shards": kinds([g.shards for g in groups]),
    }


def config(args: argparse.Namespace, nvme_dir: str | None = None) -> dict[str, Any]:
    """The DeepSpeed-style config this driver trains with: ZeRO-3, bf16, AdamW, ``--offload`` to
    ``nvme_dir`` (or the optimizer on the CPU), ``--batch``, ``--sub-group``, ``--pinned-gib``. One copy:
    bench/experiments/zero_offload_profile.py trains with it too."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(args.sub_group),
            "offload_pinned_bytes": int(args.pinned_gib * 2**30),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 2, "overlap_events": True},
    }
    if nvme_dir is None and args.offload != "cpu":
        raise GpuBenchError(f"--offload {args.offload} swaps to NVMe: a swap folder is needed")
    nvme = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
    if args.offload in ("both", "optimizer"):
        cfg["zero_optimization"]["offload_optimizer"] = dict(nvme)
    if args.offload in ("both", "param"):
        cfg["zero_optimization"]["offload_param"] = dict(nvme)
    if args.offload == "cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    live = max_live_params(args)
    if live is not None:
        cfg["zero_optimization"]["stage3_max_live_parameters"] = live
    return cfg


def gpu_memory(engine: Any, history: bool, step: Any, device: Any) -> dict[str, Any]:
    """The GPU memory breakdown (bench/gpu_memory.py): ``known`` bytes always (zero off CUDA); with
    ``history``, one more ``step()`` recorded and its peak broken down (``at_peak``), with torch's
    allocator counters; an error is recorded, never raised (the run's numbers are kept)."""
    import torch

    from bench.gpu_memory import known_bytes, peak_breakdown

    out: dict[str, Any] = {"known": known_bytes(engine)}
    if not history:
        return out
    try:
        stats = torch.cuda.memory_stats(device)
        out["allocator"] = {
            k: stats.get(k, 0)
            for k in (
                "allocated_bytes.all.peak",
                "reserved_bytes.all.peak",
                "active_bytes.all.peak",
                "requested_bytes.all.peak",
                "inactive_split_bytes.all.peak",
            )
        }
        baseline = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        try:
            out["extra_step"] = True
            step()
        finally:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        out["at_peak"] = peak_breakdown(snap, baseline)
    except Exception as e:  # noqa: BLE001 - the breakdown is extra; the run's numbers stay
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def train(args: argparse.Namespace, nvme_dir: str, progress: dict[str, Any]) -> dict[str, Any]:
    """Build, initialize and train; the measured numbers of this rank. ``progress`` holds what was
    measured so far (step times, losses) for a run that ends early (SIGTERM, an error)."""
    import torch
    import torch.distributed as dist

    from bench.train import build_model, import_dstrain

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    with device:  # built where it trains (faster than on the host and a copy; DeepSpeed's twin does the same)
        model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t0
    progress.update(params=params, build_s=build_s, world=world, rank=rank)
    cfg = config(args, nvme_dir)
    # (None: unset, DeepSpeed's default 1e9)
    progress["max_live_params"] = cfg["zero_optimization"].get("stage3_max_live_parameters")
    dstrain = import_dstrain()
    history = args.device == "cuda" and args.memory_breakdown
    if history:  # the shards and buffers initialize makes carry their allocation sites
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    t0 = time.perf_counter()
    engine, optimizer, _, _ = dstrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model  # (the engine holds the module; the fp32 tensors it replaced are freed)
    init_s = time.perf_counter() - t0
    if history:
        torch.cuda.memory._record_memory_history(enabled=None)  # off for the timed steps
    if args.device == "cuda":
        init_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # from here: the training steps' peak
    where = placement(engine)
    progress.update(init_s=init_s, placement=where)
    print(f"offload_gpu: initialized in {init_s:.1f} s; {where}", flush=True)
    from dstrain.zero.units import HoldsShards

    # the offloaded optimizer, the engine, and stage 3's shard store report counters
    sources = (optimizer, engine, engine.zero.store if isinstance(engine.zero, HoldsShards) else None)
    g = torch.Generator().manual_seed(1234 + rank)
    times: list[float] = progress.setdefault("steps_s", [])
    losses: list[float] = progress.setdefault("losses", [])
    c0: dict[str, float] = {}
    b0 = b1 = None
    timed_start = 0.0
    start = time.perf_counter()
    stopped = ""

    def one_step(i: int) -> None:
        b = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)  # (B, T+1)
        t = time.perf_counter()
        loss = engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())  # (B, T) each
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
        _sync(args.device)
        times.append(time.perf_counter() - t)
        print(f"offload_gpu: step {i + 1}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)

    memory: dict[str, Any] = {}
    peak = 0
    try:
        for i in range(args.steps):
            if i == args.warmup:
                _sync(args.device)
                _drain(optimizer)  # the warm-up steps' writes behind: counted before the window
                c0, b0, timed_start = _swap_counters(sources), block_bytes(nvme_dir), time.perf_counter()
            one_step(i)
            stopped = budget_stop(
                times, args.steps, args.warmup, time.perf_counter() - start, args.time_budget_s
            )
            if stopped:
                break
        _sync(args.device)
        _drain(optimizer)  # the timed steps' writes behind (their time in the window: they are theirs)
        timed_s = time.perf_counter() - timed_start if timed_start else 0.0
        c1, b1 = _swap_counters(sources), block_bytes(nvme_dir)
        if args.device == "cuda":
            peak = torch.cuda.max_memory_allocated(device)  # the timed steps' (before the extra one)
        done = len(times)
        # (within the time budget, by the steps' own rule: the driver's timeout would end the run there)
        room = not stopped and bool(times) and time.perf_counter() - start + times[-1] <= args.time_budget_s
        memory = gpu_memory(engine, history and room, lambda: one_step(done), device)
        del times[done:], losses[done:]  # the recorded extra step is not one of the measured ones
    finally:
        engine.close()  # (closes the optimizer it steps with: its swap files and pinned buffers)
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
        "placement": where,
        "max_live_params": progress["max_live_params"],
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
        "stepped_in_backward": c1.get("in_backward", 0) - c0.get("in_backward", 0),
        "pinned_bytes": c1.get("pinned_bytes", 0),
    }
    if b0 is not None and b1 is not None and timed_s:  # the disk's own counters (the whole machine's)
        out["block_read_gbps"] = (b1[0] - b0[0]) / timed_s / 1e9
        out["block_write_gbps"] = (b1[1] - b0[1]) / timed_s / 1e9
    out["gpu_memory"] = memory
    if args.device == "cuda":
        out["gpu_peak_gib"] = peak / 2**30
        out["gpu_bytes_per_param"] = peak / params
        out["gpu_peak_run_gib"] = max(peak, init_peak) / 2**30
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


def _live(n: int | None) -> str:
    return "unset (1e9)" if n is None else f"{n / 1e6:,.1f}M"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def render(meta: dict[str, Any], result: dict[str, Any]) -> str:
    lines = [f"# ZeRO-Infinity on {meta['gpu']} ({meta['host']}), {meta['date']}", ""]
    if "error" in result:
        done = result.get("steps_s") or []
        steps = f" after {len(done)} steps ({', '.join(f'{t:.2f}' for t in done)} s)" if done else ""
        return (
            "\n".join(
                [*lines, f"**Failed**{steps}: `{result['error']}`", "", f"Command: `{meta['command']}`"]
            )
            + "\n"
        )
    a, probes = meta["args"], meta["probes"]
    tps = result["tokens_per_s"]
    lines += [
        f"dstrain ZeRO-3, bf16, world {result['world']} on {meta['device']}: GPT of bench/train.py, "
        f"{result['params'] / 1e6:,.1f}M parameters ({a['layers']} layers, d={a['dim']}, {a['heads']} heads, vocab "
        f"{a['vocab']}, seq {a['seq']}), micro batch {a['batch']}; {_WHAT[a['offload']]} "
        f"({meta['nvme_path']}, {meta['fs']}), pinned budget {a['pinned_gib']:g} GiB per rank, "
        f"stage3_max_live_parameters {_live(result.get('max_live_params'))}.",
        "",
        "| tokens/s | step s (median) | timed steps | swap read GB/s | swap write GB/s | swapped per step | stall s/step | "
        "prefetch hits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    timed = result["steps_s"][a["warmup"] :]
    med = sorted(timed)[len(timed) // 2] if timed else float("nan")
    per_step = sum(result["swap_bytes"].values()) / max(1, result["timed_steps"])
    hits, misses = result["prefetch_hits"], result["prefetch_misses"]
    tps_text = f"{tps:,.0f}" if tps is not None else "-"
    lines.append(
        f"| {tps_text} | {med:.2f} | {result['timed_steps']} | {result['swap_read_gbps'] or 0:.2f} | "
        f"{result['swap_write_gbps'] or 0:.2f} | {_bytes(per_step)} | "
        f"{result['stall_s'] / max(1, result['timed_steps']):.2f} | "
        f"{hits / (hits + misses):.0%} |"
        if tps is not None and hits + misses
        else f"| {tps_text} | {med:.2f} | {result['timed_steps']} | | | {_bytes(per_step)} | | |"
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
            f"; GPU peak over the steps {result['gpu_peak_gib']:.1f} GiB ({result['gpu_bytes_per_param']:.2f} "
            f"B/param), over the whole run {result.get('gpu_peak_run_gib', float('nan')):.1f} GiB"
            if "gpu_peak_gib" in result
            else ""
        )
        + f"; host peak {result['host_peak_mib']:,.0f} MiB"
        + ".",
    ]
    if "placement" in result:
        pl = result["placement"]
        lines += [
            "",
            f"Placement ({pl['store']}): fp32 master {pl['master']}, gradient partitions {pl['grads']}, "
            f"shards {pl['shards']}; sub-groups stepped during backward: {result.get('stepped_in_backward', 0)}.",
        ]
    from bench.gpu_memory import memory_lines

    lines += memory_lines(result.get("gpu_memory") or {}, result["params"])
    if meta.get("sizing"):
        lines += ["", f"Sized to the disk (--fit-disk): {meta['sizing']}."]
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
    sizing = ""
    if args.fit_disk:
        args.layers, sizing = fit_layers(args, shutil.disk_usage(base).free)
        print(f"offload_gpu: --fit-disk: {sizing}", flush=True)
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
        "sizing": sizing,
        "cpus": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "probes": {},
    }
    progress: dict[str, Any] = {}
    result: dict[str, Any] = {"error": "interrupted before training"}
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        meta["probes"]["before training"] = disk_probe(nvme_dir, probe_bytes)
        result = train(args, nvme_dir, progress)
        meta["probes"]["after training"] = disk_probe(nvme_dir, probe_bytes)
    except BaseException as e:  # recorded in the result files (with the steps done), then re-raised
        where = "" if "error" in result else "after training: "
        base_result = result if "error" not in result else progress
        result = {**base_result, "error": f"{where}{type(e).__name__}: {e}", "stopped": ""}
        result.setdefault("host_peak_mib", host_peak_mib())
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
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
