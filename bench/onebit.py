"""1-bit Adam and 0/1 Adam benchmark: dstrain OneBitAdam and ZeroOneAdam vs Adam (ZeRO stage 0), same
GPT-like model, 2 ranks.

Per method and rep (fresh torchrun processes, methods interleaved rep by rep), over the timed steps
after the warm-up: mean step time, bytes this rank put on the wire per step (the gradient all-reduce
from the engine's comm statistics, plus the compressed all-reduce's own counters), and the time spent
in that communication. Means, not medians, because 0/1 Adam's steps differ: after its variance
freeze it synchronises only every ``--local-interval`` steps (``local_step_scaler=1``,
``local_step_clipper=--local-interval``: the interval doubles each frozen step up to that, untimed),
and the mean over a whole number of intervals is its cost per step. The modelled step at a stated link
speed replaces the measured communication time by bytes / link (e.g. 10 GbE between nodes,
1.25 GB/s), where compression is meant to win.

    python bench/onebit.py --layers 2 --dim 256 --vocab 8000          # gloo on this machine (CPU)
    python bench/onebit.py --device cuda --backend nccl               # two GPUs
    python bench/onebit.py --quick        # seconds (make bench): 2 layers of 64, 4 timed steps, 1 rep

Writes ``onebit-<date>-<device>-<backend>[-quick].{md,json}`` under ``$DSIO_BENCH_RESULTS``, else
bench/results (bench/_common.py's ``RESULTS``); ``--output STEM`` names the files instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHODS = ("adam", "onebit", "zeroone")


def warmup_steps(method: str, freeze: int, local_interval: int) -> int:
    """Untimed steps: 1-bit Adam's freeze_step; 0/1 Adam's var_freeze_step, the step that freezes,
    and the frozen steps until the local interval has doubled up to ``local_interval``."""
    if method == "zeroone":
        return freeze + 1 + max(local_interval - 1, 0).bit_length()
    return freeze


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import dstrain
    from bench.train import build_model
    from dstrain.onebit import OneBitAdam, ZeroOneAdam

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args).to(device)
    nparam = sum(p.numel() for p in model.parameters())
    if args.method == "adam":
        opt: dict[str, Any] = {"type": "Adam", "params": {"lr": 1e-4}}
    elif args.method == "onebit":
        opt = {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": args.freeze}}
    else:
        opt = {
            "type": "ZeroOneAdam",
            "params": {
                "lr": 1e-4,
                "var_freeze_step": args.freeze,
                "local_step_scaler": 1,
                "local_step_clipper": args.local_interval,
            },
        }
    warm = warmup_steps(args.method, args.freeze, args.local_interval)
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.batch * world,
        "optimizer": opt,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": args.device == "cuda"},
    }
    engine, _, _, _ = dstrain.initialize(model=model, config=cfg)
    # the compressed all-reduce of 1-bit / 0/1 Adam (Adam has none: its gradients go through engine.comm)
    backend = engine.optimizer.backend if isinstance(engine.optimizer, OneBitAdam | ZeroOneAdam) else None
    if backend is not None:
        backend.time_collectives = True  # exact collective time on CUDA (synchronizes around them)
    g = torch.Generator().manual_seed(1 + rank)
    times, bytes_, comms = [], [], []
    for step in range(warm + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
        c0 = engine.comm.statistics()
        s0 = backend.statistics().wire_bytes if backend is not None else 0
        w0 = c0.wait_seconds
        t_c0 = backend.statistics().collective_seconds if backend is not None else 0.0
        dist.barrier()
        t = time.perf_counter()
        loss = engine(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        c1 = engine.comm.statistics()
        if step >= warm:
            times.append(dt)
            # a ring all-reduce sends 2 (w-1)/w of its input; the compressed all-reduce counts its own
            grad_bytes = int(2 * (world - 1) / world * (c1.all_reduce_bytes - c0.all_reduce_bytes))
            comm_s = c1.wait_seconds - w0
            if backend is not None:
                grad_bytes += backend.statistics().wire_bytes - s0
                comm_s += backend.statistics().collective_seconds - t_c0
            bytes_.append(grad_bytes)
            comms.append(comm_s)
    engine.close()
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "step_s": statistics.fmean(times),
                    "wire_bytes": statistics.fmean(bytes_),
                    "comm_s": statistics.fmean(comms),
                    "params": nparam,
                    "warmup_steps": warm,
                    "step_times": times,
                    "step_wire_bytes": bytes_,
                }
            )
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--steps", type=int, default=8, help="timed steps after the warm-up (a multiple of --local-interval)"
    )
    p.add_argument(
        "--freeze", type=int, default=2, help="1-bit Adam's freeze_step, 0/1 Adam's var_freeze_step (untimed)"
    )
    p.add_argument("--local-interval", type=int, default=4, help="0/1 Adam's local_step_clipper (H)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--link-gbps", type=float, default=10.0, help="modelled inter-node link, Gbit/s")
    p.add_argument("--output", default=None, help="result stem (default: under $DSIO_BENCH_RESULTS)")
    p.add_argument(
        "--quick", action="store_true", help="seconds (make bench): 2 layers of 64, 4 timed steps, 1 rep"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:  # every method, the same path, a toy's size
        args.reps, args.steps, args.freeze, args.local_interval = 1, 4, 2, 4
        args.layers, args.dim, args.heads, args.vocab, args.seq = 2, 64, 4, 1000, 32
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    passthrough = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in (
            "steps",
            "freeze",
            "local-interval",
            "layers",
            "dim",
            "heads",
            "vocab",
            "seq",
            "batch",
            "device",
            "backend",
        )
    ]
    if args.steps % args.local_interval:
        p.error(
            "--steps must be a multiple of --local-interval (0/1 Adam's cost per step is over whole intervals)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for m in METHODS:  # interleaved rep by rep
                out = Path(tmp) / f"{m}-{rep}.json"
                cmd = [
                    torchrun,
                    "--standalone",
                    "--nproc_per_node",
                    "2",
                    __file__,
                    "--worker",
                    f"--method={m}",
                    f"--out={out}",
                    *passthrough,
                ]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                results[m].append(json.loads(out.read_text()))
                print(f"rep {rep} {m}: {results[m][-1]}", flush=True)
    link = args.link_gbps * 1e9 / 8
    rows = {}
    for m, rs in results.items():
        step = statistics.median(r["step_s"] for r in rs)
        comm = statistics.median(r["comm_s"] for r in rs)
        wire = statistics.median(r["wire_bytes"] for r in rs)
        rows[m] = {
            "step_s": step,
            "step_min": min(r["step_s"] for r in rs),
            "step_max": max(r["step_s"] for r in rs),
            "comm_s": comm,
            "wire_bytes": wire,
            "modelled_step_s": step - comm + wire / link,
        }
    stamp = datetime.datetime.now(datetime.timezone.utc)
    dev = f"{args.device}-{args.backend}"
    from bench._common import RESULTS

    os.makedirs(RESULTS, exist_ok=True)
    default = Path(RESULTS) / f"onebit-{stamp:%Y-%m-%d}-{dev}{'-quick' if args.quick else ''}"
    base = Path(args.output) if args.output else default
    data = {
        "date": stamp.isoformat(),
        "host": platform.node(),
        "args": vars(args),
        "params": results["adam"][0]["params"],
        "results": rows,
        "raw": results,
    }
    base.with_suffix(".json").write_text(json.dumps(data, indent=1))
    a = rows["adam"]
    load = os.getloadavg()
    lines = [
        f"# 1-bit Adam and 0/1 Adam vs Adam, {stamp:%Y-%m-%d %H:%M} UTC ({dev})",
        "",
        f"GPT-like model, {data['params'] / 1e6:.1f}M parameters, {args.layers} layers, d={args.dim}, seq {args.seq}, "
        f"micro batch {args.batch}, 2 ranks, ZeRO stage 0; {args.reps} interleaved reps in fresh processes, "
        f"{args.steps} timed steps after the warm-up (1-bit Adam: freeze_step {args.freeze}; 0/1 Adam: "
        f"var_freeze_step {args.freeze}, then local intervals doubling to {args.local_interval}). Per rep the mean "
        f"over the timed steps; across reps the median (min-max). Load average at the end: "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) on {os.cpu_count()} CPUs.",
        "",
        f"| method | step, s | comm in step, s | wire bytes/step/rank | modelled step at {args.link_gbps:g} Gbit/s, s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m, r in rows.items():
        lines.append(
            f"| {m} | {r['step_s']:.3f} ({r['step_min']:.3f}-{r['step_max']:.3f}) | {r['comm_s']:.3f} | "
            f"{r['wire_bytes']:,.0f} | {r['modelled_step_s']:.3f} |"
        )
    lines.append("")
    for m in ("onebit", "zeroone"):
        o = rows[m]
        lines += [
            f"- {m}: wire bytes per step / Adam's = 1/{a['wire_bytes'] / max(o['wire_bytes'], 1):.1f} (target <= 1/28); "
            f"measured step {o['step_s'] / a['step_s']:.2f}x Adam's; modelled at {args.link_gbps:g} Gbit/s "
            f"{o['modelled_step_s'] / a['modelled_step_s']:.2f}x",
        ]
    lines += [
        "- comm in step: time inside the collectives (Adam: the gradient all-reduce waits; 1-bit: the all-to-all and "
        "all-gathers of the compressed momentum; 0/1 Adam: those of its synchronisation steps, none on local steps). "
        "modelled step = measured step - comm + wire bytes / link speed: "
        "compute and the compression arithmetic (packing, scales, error feedback) stay as measured. Adam's all-reduce "
        "is modelled as fully exposed; dstrain overlaps bucketed reductions with backward, so the model favours 1-bit "
        "Adam where compute can hide the transfer.",
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
