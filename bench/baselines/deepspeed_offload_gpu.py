"""DeepSpeed ZeRO-Infinity / ZeRO-Offload on one GPU: the GPT and config shape of bench/offload_gpu.py.

Run with DeepSpeed importable (on the GPU machine: ``source bench/baselines/deepspeed_device.sh install``):

    python3 bench/baselines/deepspeed_offload_gpu.py --offload both --nvme-path /var/tmp/ds --out ds.json
    python3 bench/baselines/deepspeed_offload_gpu.py --offload cpu --out ds-cpu.json

``both``: parameters and optimizer state on NVMe (``max_in_cpu: 0`` so the parameters really go there,
``stage3_prefetch_bucket_size: 0``: with prefetching DeepSpeed's parameter swapper asserts "Not
enough buffers" with ``max_in_cpu: 0``, shared/anchors; ``stage3_max_reuse_distance: 0`` and 16 buffers of
7e7 elements, env DS_PARAM_BUFFER_COUNT / DS_PARAM_BUFFER_SIZE / DS_MAX_REUSE_DISTANCE;
``stage3_max_live_parameters`` as dstrain's driver sets it, ``--max-live-params`` or
bench/offload_gpu.py's `max_live_params` default: DeepSpeed counts it only when it prefetches, so with
the prefetch bucket 0 it changes nothing there, and the two configs say the same); ``optimizer``: optimizer state on NVMe;
``cpu``: optimizer state on the CPU (ZeRO-Offload). bf16, ZeRO-3, AdamW lr 1e-4, micro batch 4.
Writes one JSON: tokens/s over the timed steps, step times, losses, GPU peak (bytes/parameter too;
over the training steps, the peak stats reset after ``deepspeed.initialize``, and over the whole run),
host peak RSS (VmHWM) and the bytes the process read and wrote at the block layer during the timed
steps (/proc/self/io), so swap GB/s = those bytes / the timed wall time. A failure is written too, with
its traceback and the steps done before it; so is SIGTERM (the driver's ``timeout``). The model is
built on the training device, as bench/offload_gpu.py builds dstrain's. ``--device cpu`` (DeepSpeed's
CPU accelerator, ``DS_ACCELERATOR=cpu``) is the dry run of the same code on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.offload_gpu import (  # noqa: E402  (as dstrain's)
    BudgetKilled,
    add_gather_args,
    add_model_args,
    block_bytes,
    budget_stop,
    host_peak_mib,
    max_live_params,
)


def _on_sigterm(signum: int, frame: object) -> None:
    raise BudgetKilled(f"killed by signal {signum} (the driver's time budget)")


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offload", default="both", choices=("both", "optimizer", "cpu"))
    p.add_argument("--nvme-path", default="/var/tmp/ds-offload")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    add_model_args(p)
    add_gather_args(p)
    p.add_argument("--time-budget-s", type=float, default=240.0, help="stop the steps after this long")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the dry run")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main() -> int:
    a = parse_args()
    res: dict = {"impl": "deepspeed", "offload": a.offload, "argv": sys.argv[1:]}
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _run(a, res)
    except BaseException as e:  # recorded (with the steps done so far), then re-raised
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
        res.setdefault("host_peak_mib", host_peak_mib())
        raise
    finally:
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "traceback"}), flush=True)
    return 0


def ds_config(a: argparse.Namespace) -> dict:
    """DeepSpeed's config of the run (``a``: `parse_args`'s), the shape of bench/offload_gpu.py's `config`."""
    nv = {"device": "nvme", "nvme_path": a.nvme_path, "pin_memory": True}
    zero: dict = {"stage": 3}
    if a.offload in ("both", "optimizer"):
        zero["offload_optimizer"] = dict(nv)
    else:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if a.offload == "both":
        # the same pinned bytes as the 8 x 1.5e8 that asserted on the H200 (2026-12-01), in more, smaller
        # buffers (one holds the largest partition, the 65.5M-element embedding) and with parameters released
        # after use (`stage3_max_reuse_distance` 0: with its default 1e9 the second step's forward keeps
        # swapped-in parameters live until every buffer is held: "Not enough buffers 0 for swapping 1")
        count = int(os.environ.get("DS_PARAM_BUFFER_COUNT", "16"))
        size = int(float(os.environ.get("DS_PARAM_BUFFER_SIZE", "7e7")))
        zero["offload_param"] = dict(nv, buffer_count=count, buffer_size=size, max_in_cpu=0)
        zero["stage3_prefetch_bucket_size"] = 0
        zero["stage3_max_reuse_distance"] = int(float(os.environ.get("DS_MAX_REUSE_DISTANCE", "0")))
    live = max_live_params(a)  # dstrain's value (bench/offload_gpu.py): the same config on both sides
    if live is not None:
        zero["stage3_max_live_parameters"] = live
    cfg = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 2, "overlap_events": True,
                "single_submit": False},
    }  # fmt: skip
    return cfg


def _run(a: argparse.Namespace, res: dict) -> None:
    """Train; the numbers go into ``res`` as they are measured (so a failure keeps the steps done)."""
    import deepspeed
    import torch

    from bench.train import build_model

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    with torch.device("cuda" if cuda else "cpu"):  # built where it trains, as dstrain's twin
        model = build_model(a)
    params = sum(q.numel() for q in model.parameters())
    if a.offload in ("both", "optimizer"):
        os.makedirs(a.nvme_path, exist_ok=True)
    cfg = ds_config(a)
    res.update(params=params, build_s=time.perf_counter() - t0, config=cfg, deepspeed=deepspeed.__version__)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    res["init_s"] = time.perf_counter() - t0
    init_peak = 0
    if cuda:
        init_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()  # from here: the training steps' peak
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(1234)
    times: list[float] = res.setdefault("steps_s", [])
    losses: list[float] = res.setdefault("losses", [])
    swap_dir = a.nvme_path if os.path.isdir(a.nvme_path) else "."
    io0, blk0, start, t_timed = _io(), None, time.perf_counter(), None
    stopped = ""
    for i in range(a.steps):
        if i == a.warmup:
            sync()
            io0, blk0, t_timed = _io(), block_bytes(swap_dir), time.perf_counter()
        b = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(engine.device)  # (B, T+1)
        t = time.perf_counter()
        loss = engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())  # (B, T) each
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
        sync()
        times.append(time.perf_counter() - t)
        print(f"deepspeed {a.offload} step {i + 1}: {times[-1]:.2f} s loss {losses[-1]:.4f}", flush=True)
        stopped = budget_stop(times, a.steps, a.warmup, time.perf_counter() - start, a.time_budget_s)
        if stopped:
            break
    io1, blk1, end = _io(), block_bytes(swap_dir), time.perf_counter()
    timed = times[a.warmup :]
    wall = end - t_timed if t_timed is not None else 0.0
    rd, wr = io1["read_bytes"] - io0["read_bytes"], io1["write_bytes"] - io0["write_bytes"]
    res.update(
        timed_steps=len(timed),
        stopped=stopped,
        tokens_per_s=len(timed) * a.batch * a.seq / wall if timed and wall else None,
        host_peak_mib=host_peak_mib(),
        disk_read_bytes=rd,
        disk_written_bytes=wr,
        swap_read_gbps=rd / wall / 1e9 if wall else None,
        swap_write_gbps=wr / wall / 1e9 if wall else None,
    )
    if blk0 is not None and blk1 is not None and wall:  # the disk's own counters (the whole machine's)
        res.update(
            block_read_gbps=(blk1[0] - blk0[0]) / wall / 1e9,
            block_write_gbps=(blk1[1] - blk0[1]) / wall / 1e9,
        )
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        res.update(
            gpu_peak_gib=peak / 2**30,
            gpu_bytes_per_param=peak / params,
            gpu_peak_run_gib=max(peak, init_peak) / 2**30,
        )


if __name__ == "__main__":
    sys.exit(main())
