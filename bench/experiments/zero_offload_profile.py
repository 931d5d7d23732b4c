"""Where ZeRO-Offload's step goes on one GPU (issue 32): the pieces of ``offload_optimizer.device: cpu``.

One device call. Prints one JSON line per measurement (and writes them to ``--out``):

- ``adam``: torch's fused AdamW over host fp32 tensors of ``--params`` elements in sub-groups of
  ``--sub-group`` (what `OffloadAdam` runs on the CPU), at the process's thread count;
- ``d2h`` / ``h2d``: a bf16 CUDA tensor of ``--params`` elements to host memory, pageable (``.to``) and
  into a page-locked buffer (``copy_(non_blocking=True)``), and back;
- ``add`` / ``cast``: fp32 += bf16 (the gradient accumulation on the host), fp32 -> bf16 (the cast after
  the step);
- ``train``: the GPT of bench/train.py under dstrain ZeRO-3 bf16 with the optimizer on the CPU, forward,
  backward and step timed apart (CUDA synchronised between), with ``step_in_backward`` on and off.

    python bench/experiments/zero_offload_profile.py --out /tmp/prof.jsonl            # the H200 call
    python bench/experiments/zero_offload_profile.py --params 2e6 --layers 2 --dim 128 --device cpu  # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _emit(out: str | None, rec: dict[str, Any]) -> None:
    print(json.dumps(rec), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _time(fn: Any, reps: int, sync: Any) -> list[float]:
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return ts


def pieces(args: argparse.Namespace) -> None:
    import torch

    n, sg = int(args.params), int(args.sub_group)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    threads = torch.get_num_threads()
    master = torch.randn(n) * 0.02
    grad = torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    step = torch.tensor(1.0)
    chunks = [(i, min(n, i + sg)) for i in range(0, n, sg)]

    def adam() -> None:
        for lo, hi in chunks:
            torch._fused_adamw_(
                [master[lo:hi]], [grad[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [step],
                lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
            )  # fmt: skip

    ts = _time(adam, 3, sync)
    _emit(
        args.out,
        {"what": "adam", "threads": threads, "params": n, "s": ts, "gbps_28B": 28 * n / min(ts) / 1e9},
    )
    half = torch.empty(n, dtype=torch.bfloat16)
    ts = _time(lambda: grad.add_(half, alpha=0.5), 3, sync)
    _emit(args.out, {"what": "add fp32 += bf16 (host)", "s": ts})
    ts = _time(lambda: half.copy_(master), 3, sync)
    _emit(args.out, {"what": "cast fp32 -> bf16 (host)", "s": ts})
    if not cuda:
        return
    dev = torch.randn(n, device="cuda").to(torch.bfloat16)
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    ts = _time(lambda: dev.to("cpu"), 3, sync)
    _emit(args.out, {"what": "d2h bf16 pageable .to('cpu')", "s": ts, "gbps": 2 * n / min(ts) / 1e9})
    ts = _time(lambda: pinned.copy_(dev, non_blocking=True), 3, sync)
    _emit(args.out, {"what": "d2h bf16 into pinned", "s": ts, "gbps": 2 * n / min(ts) / 1e9})
    sgd = [(lo, hi) for lo, hi in chunks]
    ts = _time(lambda: [dev[lo:hi].to("cpu") for lo, hi in sgd], 3, sync)
    _emit(args.out, {"what": "d2h bf16 pageable per sub-group", "s": ts})
    ts = _time(lambda: dev.copy_(pinned, non_blocking=True), 3, sync)
    _emit(args.out, {"what": "h2d bf16 from pinned", "s": ts, "gbps": 2 * n / min(ts) / 1e9})
    ts = _time(lambda: dev.copy_(master.to(torch.bfloat16)), 3, sync)
    _emit(args.out, {"what": "h2d cast on host then pageable copy", "s": ts})


def train(args: argparse.Namespace, step_in_backward: bool) -> None:
    import torch

    from bench.offload_gpu import config
    from bench.train import build_model, import_dstrain

    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with device:
        model = build_model(args)
    cfg = config(argparse.Namespace(**{**vars(args), "offload": "cpu"}))  # the driver's --offload cpu
    cfg["zero_optimization"]["offload_optimizer"]["step_in_backward"] = step_in_backward
    dstrain = import_dstrain()
    engine, _, _, _ = dstrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.steps):
        b = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        loss = engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()
        sync()
        t3 = time.perf_counter()
        rows.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "loss": loss.item()})
    engine.close()
    _emit(
        args.out,
        {
            "what": "train",
            "step_in_backward": step_in_backward,
            "threads": torch.get_num_threads(),
            "steps": rows,
        },
    )
    del engine
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    from bench.offload_gpu import add_model_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--params", type=float, default=1.0748e9)
    p.add_argument("--sub-group", type=float, default=1e8)
    add_model_args(p)
    p.add_argument(
        "--pinned-gib", type=float, default=4.0, help="offload_pinned_bytes, GiB (as bench/offload_gpu.py)"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--parts", default="pieces,train-on,train-off")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    parts = args.parts.split(",")
    if "pieces" in parts:
        pieces(args)  # (its tensors are freed on return)
        if args.device == "cuda":
            import torch

            torch.cuda.empty_cache()
    if "train-on" in parts:
        train(args, True)
    if "train-off" in parts:
        train(args, False)


if __name__ == "__main__":
    main()
