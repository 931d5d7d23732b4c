"""DeepSpeed ZeRO-Infinity / ZeRO-Offload on one GPU: the GPT and config shape of bench/offload_gpu.py.

Run with DeepSpeed importable (on the GPU machine: ``source bench/baselines/deepspeed_device.sh install``):

    python3 bench/baselines/deepspeed_offload_gpu.py --offload both --nvme-path /var/tmp/ds --out ds.json
    python3 bench/baselines/deepspeed_offload_gpu.py --offload cpu --out ds-cpu.json

``both``: parameters and optimizer state on NVMe (``max_in_cpu: 0`` so the parameters really go there,
and ``stage3_prefetch_bucket_size: 0``: with prefetching DeepSpeed's parameter swapper asserts "Not
enough buffers" with ``max_in_cpu: 0``, shared/anchors); ``optimizer``: optimizer state on NVMe;
``cpu``: optimizer state on the CPU (ZeRO-Offload). bf16, ZeRO-3, AdamW lr 1e-4, micro batch 4.
Writes one JSON: tokens/s over the timed steps, step times, losses, GPU peak (bytes/parameter too),
host peak RSS (VmHWM) and the bytes the process read and wrote at the block layer during the timed
steps (/proc/self/io), so swap GB/s = those bytes / the timed wall time. A failure is written too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.offload_gpu import host_peak_mib  # noqa: E402  (dstrain's run reads its peak the same way)


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offload", default="both", choices=("both", "optimizer", "cpu"))
    p.add_argument("--nvme-path", default="/var/tmp/ds-offload")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--time-budget-s", type=float, default=240.0, help="stop the steps after this long")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res: dict = {"impl": "deepspeed", "offload": a.offload}
    try:
        res.update(_run(a))
    except BaseException as e:  # recorded, then re-raised
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
        raise
    finally:
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "traceback"}), flush=True)
    return 0


def _run(a: argparse.Namespace) -> dict:
    import deepspeed
    import torch

    from bench.train import build_model

    torch.cuda.set_device(0)
    t0 = time.perf_counter()
    model = build_model(a).cuda()
    params = sum(q.numel() for q in model.parameters())
    nv = {"device": "nvme", "nvme_path": a.nvme_path, "pin_memory": True}
    zero: dict = {"stage": 3}
    if a.offload in ("both", "optimizer"):
        os.makedirs(a.nvme_path, exist_ok=True)
        zero["offload_optimizer"] = dict(nv)
    else:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if a.offload == "both":
        zero["offload_param"] = dict(nv, buffer_count=8, buffer_size=int(1.5e8), max_in_cpu=0)
        zero["stage3_prefetch_bucket_size"] = 0
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
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1234)
    times, losses = [], []
    io0, start, t_timed = _io(), time.perf_counter(), None
    stopped = ""
    for i in range(a.steps):
        if i == a.warmup:
            torch.cuda.synchronize()
            io0, t_timed = _io(), time.perf_counter()
        b = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).cuda()  # (B, T+1)
        t = time.perf_counter()
        loss = engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())  # (B, T) each
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        print(f"deepspeed {a.offload} step {i + 1}: {times[-1]:.2f} s loss {losses[-1]:.4f}", flush=True)
        if time.perf_counter() - start > a.time_budget_s and i + 1 < a.steps:
            stopped = f"stopped after {i + 1} of {a.steps} steps (--time-budget-s {a.time_budget_s:.0f})"
            break
    io1, end = _io(), time.perf_counter()
    timed = times[a.warmup :]
    wall = end - t_timed if t_timed is not None else 0.0
    peak = torch.cuda.max_memory_allocated()
    rd, wr = io1["read_bytes"] - io0["read_bytes"], io1["write_bytes"] - io0["write_bytes"]
    return {
        "params": params,
        "init_s": init_s,
        "steps_s": times,
        "losses": losses,
        "timed_steps": len(timed),
        "stopped": stopped,
        "tokens_per_s": len(timed) * a.batch * a.seq / wall if timed and wall else None,
        "gpu_peak_gib": peak / 2**30,
        "gpu_bytes_per_param": peak / params,
        "host_peak_mib": host_peak_mib(),
        "disk_read_bytes": rd,
        "disk_written_bytes": wr,
        "swap_read_gbps": rd / wall / 1e9 if wall else None,
        "swap_write_gbps": wr / wall / 1e9 if wall else None,
    }


if __name__ == "__main__":
    sys.exit(main())
