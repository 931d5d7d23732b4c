"""Does the step thread slow a CPU run? Two engines in one process, step thread on and off, stepped in turn.

Issue 32 item 2 (`dstrain.offload.optimizer.step_thread`): on a GPU the host Adam of the sub-groups
stepped during backward moves off the backward thread; on a CPU run both threads compete for the same
cores, so the question is only whether it costs anything there. One process, world size 1, ZeRO-3 with
the optimizer offloaded (``--optimizer cpu`` or ``nvme``), a shape of bench/offload_methods.py; both
engines built from the same seed and fed the same batches, stepped alternately (A B A B ...) so load
drifts hit both alike; per engine the median step after ``--warmup``, and the ratio. The two runs'
losses must be equal (the thread is bitwise the serial early step): a mismatch exits 1.

    .venv/bin/python bench/experiments/step_thread_ab.py --shape gpt110m --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.offload_methods import SHAPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mlp", choices=sorted(SHAPES))
    p.add_argument("--optimizer", default="cpu", choices=("cpu", "nvme"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from bench.train import import_dstrain

    dstrain = import_dstrain()
    shape = SHAPES[a.shape]
    swap = tempfile.mkdtemp(prefix="step-thread-ab-", dir=os.environ.get("DSIO_BENCH_DIR", "/var/tmp"))
    engines = {}
    batch_of = loss_of = None
    for name, thread in (("thread", True), ("serial", False)):
        model, batch_of, loss_of = shape.build()
        offload = {"device": a.optimizer, "step_thread": thread}
        if a.optimizer == "nvme":
            offload |= {"nvme_path": swap}
        cfg = {
            "train_micro_batch_size_per_gpu": shape.micro_batch,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": shape.sub_group,
                "offload_pinned_bytes": shape.pinned,
                "offload_optimizer": offload,
            },
        }
        engines[name] = dstrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    assert batch_of is not None and loss_of is not None
    times: dict[str, list[float]] = {n: [] for n in engines}
    losses: dict[str, list[float]] = {n: [] for n in engines}
    try:
        for i in range(a.steps):
            for name, engine in engines.items():
                b = batch_of(torch.Generator().manual_seed(i))
                t = time.perf_counter()
                loss = loss_of(engine, b)
                engine.backward(loss)
                engine.step()
                times[name].append(time.perf_counter() - t)
                losses[name].append(float(loss.item()))
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(swap, ignore_errors=True)
    med = {n: statistics.median(t[a.warmup :]) for n, t in times.items()}
    out = {
        "shape": a.shape,
        "optimizer": a.optimizer,
        "steps": a.steps,
        "warmup": a.warmup,
        "threads": a.threads,
        "load_avg": os.getloadavg(),
        "median_s": med,
        "min_s": {n: min(t[a.warmup :]) for n, t in times.items()},
        "thread_over_serial": med["thread"] / med["serial"],
        "losses_equal": losses["thread"] == losses["serial"],
        "steps_s": times,
    }
    print(json.dumps(out))
    return 0 if out["losses_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
