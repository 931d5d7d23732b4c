"""How long a checkpoint blocks a ZeRO-3 run whose parameters *and* optimizer state are on NVMe (the
fp32 master lives only in the shard file, or at bf16 in its own master file): synchronous save vs
async save, where the save streams the master and Adam's m, v from their swap files while the next
forward and backward run.

    .venv/bin/python bench/ckpt_blocked_stage3.py                      # 3 reps, ~3 min on 2 cores
    .venv/bin/python bench/ckpt_blocked_stage3.py --reps 1 --dim 512   # smoke run

One process (world size 1), an MLP of ``layers`` x Linear(dim, dim), Adam. Per rep, every method
runs once (interleaved):

- ``sync``: ``engine.save_checkpoint(d)``; blocked = its wall time (the reference).
- ``async, whole-staging fence``: the next optimizer step waits for the whole staging (the engine's
  per-sub-group gate switched off).
- ``async``: as the engine does it: the step waits, sub-group by sub-group, only until the save has
  read the bytes that sub-group's step rewrites (its master range; m, v too unless the optimizer's
  swapper writes around a pinned version).

Async blocked = ``EngineStatistics.checkpoint_blocked_seconds`` over the call and the
``steps_after`` steps that follow; the commit wait after them is reported apart. Results:
bench/results/ckpt-blocked-stage3-<date>[-label].{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import RESULTS, fmt, fs_of, machine, scratch_dir  # noqa: E402

METHODS = ("sync", "async, whole-staging fence", "async")


def _model(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def config(swap: str, *, bf16: bool, sub_group: int = 1 << 22) -> dict[str, Any]:
    """Stage 3 with parameters and optimizer state on NVMe under ``swap``."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": sub_group,
            "offload_param": {"device": "nvme", "nvme_path": swap},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        },
        "steps_per_print": 1_000_000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine: Any, x: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace, root: str, bf16: bool) -> dict[str, Any]:
    import dstrain
    import dstrain.engine as engine_module
    from dstrain.checkpoint.store import DsioStore

    swap = os.path.join(root, f"swap-{'bf16' if bf16 else 'fp32'}")
    os.makedirs(swap, exist_ok=True)
    engine, _, _, _ = dstrain.initialize(model=_model(args.dim, args.layers), config=config(swap, bf16=bf16))
    assert engine.zero.store.holds_master, "the master must live in the swap files"
    assert isinstance(engine.store, DsioStore), "this bench needs dsio's native core"
    engine.store.keep_last = 1  # one directory per method, kept open across reps; old steps go
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(args.batch, args.dim, dtype=dtype)
    _train(engine, x, 2)  # warm-up
    lend = engine_module.lend_gate
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    try:
        # rep 0 is not measured: it creates each directory's Checkpointer (handle, lock, staging region)
        for rep in range(args.reps + 1):
            for i, method in enumerate(METHODS):
                d = os.path.join(root, f"ck-{'bf16' if bf16 else 'fp32'}-{i}")
                before = _train(engine, x, args.steps_before)
                engine_module.lend_gate = (lambda *a: False) if method.endswith("fence") else lend
                b0 = engine.statistics().checkpoint_blocked_seconds
                t0 = time.perf_counter()
                engine.save_checkpoint(d, async_save=method != "sync")
                call = time.perf_counter() - t0
                during = _train(engine, x, args.steps_after) if method != "sync" else []
                blocked = engine.statistics().checkpoint_blocked_seconds - b0
                t1 = time.perf_counter()
                engine.wait_checkpoint()
                commit_wait = time.perf_counter() - t1
                engine_module.lend_gate = lend
                if rep > 0:
                    rows[method].append(
                        {
                            "blocked_s": blocked if method != "sync" else call,
                            "call_s": call,
                            "commit_wait_s": commit_wait,
                            "step_before_s": statistics.mean(before),
                            "step_during_s": statistics.mean(during) if during else float("nan"),
                        }
                    )
    finally:
        engine_module.lend_gate = lend
        engine.close()
        shutil.rmtree(swap, ignore_errors=True)
    numel = sum(g.total for g in engine.zero.groups)
    sync = [r["blocked_s"] for r in rows["sync"]]
    ratios = {m: [r["blocked_s"] / s for r, s in zip(rows[m], sync, strict=True)] for m in METHODS[1:]}
    return {
        "precision": "bf16" if bf16 else "fp32",
        "master_bytes": 4 * numel,
        "state_bytes": 12 * numel,  # master, m, v (fp32): what the checkpoint streams
        "rows": rows,
        "ratios": ratios,
    }


def report(results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, str]) -> str:
    lines = [
        f"# Checkpoint of a ZeRO-3 run with parameters and optimizer state on NVMe: time training is blocked "
        f"({info['date']}{', ' + args.label if args.label else ''})",
        "",
        f"Machine: {info['cpu']}, {info['memory']}, kernel {info['kernel']}; scratch {args.where} "
        f"({fs_of(args.where)}); load average at start {args.load_start}. One process, ZeRO stage 3, "
        f"offload_param and offload_optimizer on NVMe (the master only in the swap files), MLP {args.layers} x "
        f"Linear({args.dim}, {args.dim}), batch {args.batch}, Adam; {args.reps} reps after one unmeasured, methods "
        "interleaved rep by rep; median (min-max), seconds. Async blocked = time inside save_checkpoint + the "
        f"waits of the next optimizer step ({args.steps_after} steps run after each async save); ratio = async "
        "blocked / the same rep's synchronous save.",
        "",
        "| precision | master + m + v | method | blocked (s) | blocked / sync save | commit wait after the steps (s) "
        "| of which in the call (s) | step before (s) | step during the save (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for m in METHODS:
            rows = r["rows"][m]
            ratio = fmt([100 * x for x in r["ratios"][m]], 1) + " %" if m != "sync" else "100 %"
            lines.append(
                f"| {r['precision']} | {r['state_bytes'] / 2**20:.0f} MiB | {m} "
                f"| {fmt([x['blocked_s'] for x in rows], 3)} | {ratio} "
                f"| {fmt([x['commit_wait_s'] for x in rows], 3)} | {fmt([x['call_s'] for x in rows], 3)} "
                f"| {fmt([x['step_before_s'] for x in rows], 3)} "
                f"| {fmt([x['step_during_s'] for x in rows], 3) if m != 'sync' else '-'} |"
            )
    lines += ["", "Target (issue 11): async save blocks training <= 5% of a synchronous save's time."]
    for r in results:
        med = statistics.median(r["ratios"]["async"])
        whole = statistics.median(r["ratios"]["async, whole-staging fence"])
        lines.append(
            f"- {r['precision']}: {100 * med:.1f}% ({'met' if med <= 0.05 else 'MISSED'}); "
            f"whole-staging fence: {100 * whole:.1f}%"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps-before", type=int, default=2)
    ap.add_argument("--steps-after", type=int, default=3)
    ap.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--label", default="", help="suffix of the result files, e.g. under-load")
    args = ap.parse_args()
    args.where = scratch_dir()
    args.load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    os.makedirs(args.where, exist_ok=True)
    root = os.path.join(args.where, f"ckpt-blocked-stage3-{os.getpid()}")
    os.makedirs(root)
    info = machine()
    try:
        results = [run(args, root, p == "bf16") for p in args.precision.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    stem = os.path.join(RESULTS, f"ckpt-blocked-stage3-{day}{'-' + args.label if args.label else ''}")
    os.makedirs(RESULTS, exist_ok=True)
    text = report(results, args, info)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
