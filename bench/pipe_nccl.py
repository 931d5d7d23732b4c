"""Pipeline parallelism on 2 GPUs (NCCL): dstrain PP=2 vs DDP on a GPT of a few hundred million parameters.

    python bench/pipe_nccl.py --layers 24 --dim 1024 --heads 16 --seq 1024 --micro 4 --gas-list 4,8 \\
        --steps 6 --reps 2 --output /tmp/out/pipe-h200x2-nccl

Model: token + position embedding, ``layers`` pre-LN transformer blocks (causal SDPA attention, 4x GELU MLP),
LayerNorm and an untied head over ``vocab`` (24 x 1024 with vocab 50304: ~355 M parameters). bf16 compute
(dstrain's bf16 section: bf16 weights, fp32 master in the optimizer; DDP: fp32 weights under bf16 autocast),
Adam. Each (method, micro-batch count, rep) is its own torchrun job; methods are interleaved rep by rep.

Reported per method and micro-batch count ``M``: median step time (first step dropped) with min-max, tokens/s,
peak CUDA memory per rank; for dstrain the measured bubble (1 - host-side compute time / step time of the busiest
stage; an upper bound on a GPU, where kernels run asynchronously)
next to (S-1)/(M+S-1) and p2p payload bytes per step. DDP runs the whole model on both GPUs with M/2
micro-batches each (the same global batch). DeepSpeed is not installed on the GPU machine: not compared here.
The pipeline's messages use dstrain's default NCCL transport (`dstrain.pipe.transport`, "staged": tagged
messages over a gloo group of the pipeline ranks, CUDA payloads through host memory); method
``dstrain-pp2-native`` uses the native one (``"transport": "nccl"``: CUDA tensors over NCCL p2p, receives
posted just in time). The result records which.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_ARGS = ("layers", "dim", "heads", "seq", "vocab", "micro", "gas", "steps")


def _model_parts(a: argparse.Namespace) -> tuple[Any, Any]:
    """(layer list, loss fn) of the GPT."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(a.vocab, a.dim)
            self.pos = nn.Embedding(a.seq, a.dim)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
            self.qkv, self.proj = nn.Linear(a.dim, 3 * a.dim), nn.Linear(a.dim, a.dim)
            self.mlp = nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(), nn.Linear(4 * a.dim, a.dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, a.heads, c // a.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(a.dim)
            self.out = nn.Linear(a.dim, a.vocab, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.ln(x))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, a.vocab), labels.reshape(-1))

    return [Embed()] + [Block() for _ in range(a.layers)] + [Head()], loss_fn


def _data(a: argparse.Namespace, device: Any) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(a.gas * a.steps):
        idx = torch.randint(0, a.vocab, (a.micro, a.seq + 1), generator=g)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers, loss_fn = _model_parts(a)
    res: dict[str, Any] = {"method": a.worker}
    if a.worker.startswith("dstrain-pp2"):
        sys.path.insert(0, str(ROOT))
        import dstrain
        from dstrain.pipe.module import PipelineModule

        dstrain.init_distributed("nccl")
        pipe = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, partition_method="parameters")
        cfg = {
            "train_micro_batch_size_per_gpu": a.micro,
            "gradient_accumulation_steps": a.gas,
            "steps_per_print": 10**6,
            "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        }
        if a.worker == "dstrain-pp2-native":  # CUDA tensors over NCCL p2p instead of host-staged gloo
            cfg["pipeline"] = {"transport": "nccl", "p2p_timeout": 120}
        engine, _, _, _ = dstrain.initialize(model=pipe, config=cfg)
        res["stage_params"] = sum(p.numel() for p in pipe.parameters())

        def step(it: Any) -> float:
            return float(engine.train_batch(it).float().item())
    else:
        dist.init_process_group("nccl")
        model = torch.nn.Sequential(*layers).to(device)
        res["stage_params"] = sum(p.numel() for p in model.parameters())
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        world, rank = dist.get_world_size(), dist.get_rank()
        per_rank = a.gas // world

        def step(it: Any) -> float:
            batch = [next(it) for _ in range(a.gas)][rank::world]
            total = 0.0
            for m, (x, y) in enumerate(batch):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_fn(ddp(x), y) / per_rank
                if m < per_rank - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                total += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total

    rank = dist.get_rank()
    it = iter(_data(a, device))
    torch.cuda.reset_peak_memory_stats(device)
    times, compute, losses = [], [], []
    for _ in range(a.steps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(it))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if a.worker.startswith("dstrain-pp2"):
            compute.append(engine.runner.statistics().compute_seconds)
    res.update(rank=rank, times=times, losses=losses, peak_mem_bytes=torch.cuda.max_memory_allocated(device))
    if a.worker.startswith("dstrain-pp2"):
        st = engine.runner.statistics()
        sent = sum(s.payload_bytes for s in (st.send_activation, st.send_grad) if s is not None)
        res["p2p_sent_bytes_per_step"] = sent / a.steps
        t = engine.runner.transport  # staged through host memory (the default) or native NCCL
        res["transport"] = {
            "wire": str(t.device),
            "tagged": t.tagged,
            "split_directions": t.forward is not t.backward,
        }
        res["p2p_recv_wait_seconds"] = sum(
            s.wait_seconds for s in (st.recv_activation, st.recv_grad) if s is not None
        )
        # per step: the runner's host-side time in forward/backward (kernels are asynchronous, so on a GPU this
        # undercounts compute whenever the host runs ahead: the bubble below is an upper bound)
        res["compute_seconds"] = compute
        engine.close()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _launch(method: str, a: argparse.Namespace, gas: int) -> list[dict[str, Any]]:
    # the checkout first, then whatever PYTHONPATH already holds (the GPU machine's wheels live there)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="4", PYTHONPATH=path)
    env["PIPE_NCCL_BENCH_ARGS"] = json.dumps({**{k: getattr(a, k) for k in _ARGS}, "gas": gas})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    proc = subprocess.run(
        cmd + ["--worker", method], env=env, capture_output=True, text=True, timeout=a.timeout
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(
        f"{method} M={gas} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def _summarise(
    a: argparse.Namespace, runs: dict[str, list[list[dict[str, Any]]]], gas: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tokens = gas * a.micro * a.seq
    for method, reps in runs.items():
        steps = [max(statistics.median(r["times"][1:]) for r in ranks) for ranks in reps]  # slower rank
        med = statistics.median(steps)
        s: dict[str, Any] = {
            "step_ms": [med * 1e3, min(steps) * 1e3, max(steps) * 1e3],
            "tokens_per_s": tokens / med,
            "per_rep_step_ms": [x * 1e3 for x in steps],
            "peak_mem_gib_per_rank": [r["peak_mem_bytes"] / 2**30 for r in reps[0]],
            "params_per_rank": [r["stage_params"] for r in reps[0]],
            "losses_rank_last": reps[0][-1]["losses"],
        }
        if method.startswith("dstrain-pp2"):
            bubbles = []
            for ranks in reps:
                per_rank = []
                for r in ranks:
                    c = r["compute_seconds"]
                    per_rank.append(1 - statistics.median(c[1:]) / statistics.median(r["times"][1:]))
                bubbles.append(min(per_rank))  # the busiest stage
            s["bubble_measured"] = statistics.median(bubbles)
            s["bubble_ideal"] = 1 / (gas + 1)
            s["p2p_sent_bytes_per_step"] = [r["p2p_sent_bytes_per_step"] for r in reps[0]]
            s["transport"] = reps[0][0].get("transport")
        out[method] = s
    if "dstrain-pp2" in runs and "ddp" in runs:
        ours, theirs = out["dstrain-pp2"]["per_rep_step_ms"], out["ddp"]["per_rep_step_ms"]
        per = [t / o for o, t in zip(ours, theirs, strict=True)]
        out["speed_vs_ddp"] = {"median": statistics.median(per), "per_rep": per}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=("dstrain-pp2", "dstrain-pp2-native", "ddp"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--gas", type=int, default=4, help="worker mode: micro-batches per step")
    p.add_argument("--gas-list", default="4,8", help="micro-batch counts to compare")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--methods",
        default="dstrain-pp2,ddp",
        help="any of dstrain-pp2 (staged p2p), dstrain-pp2-native, ddp",
    )
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--output", default="", help="result path prefix (default bench/results/pipe-nccl-<date>)")
    a = p.parse_args()
    if a.worker:
        for key, value in json.loads(os.environ.get("PIPE_NCCL_BENCH_ARGS", "{}")).items():
            setattr(a, key, value)
        _worker(a)
        return
    methods = [m for m in a.methods.split(",") if m]
    gas_list = [int(g) for g in a.gas_list.split(",")]
    for g in gas_list:
        if g % 2:
            p.error(f"--gas-list: {g} is odd (DDP splits the micro-batches over 2 ranks)")
    started = time.time()
    runs: dict[int, dict[str, list[Any]]] = {g: {m: [] for m in methods} for g in gas_list}
    for rep in range(a.reps):
        for g in gas_list:
            for m in methods:
                r = _launch(m, a, g)
                runs[g][m].append(r)
                print(
                    f"rep {rep + 1} M={g} {m}: {max(statistics.median(x['times'][1:]) for x in r) * 1e3:.1f} ms"
                )
    summary = {str(g): _summarise(a, runs[g], g) for g in gas_list}
    date = datetime.date.today().isoformat()
    prefix = Path(a.output) if a.output else ROOT / "bench" / "results" / f"pipe-nccl-{date}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "pipe-nccl",
        "date": date,
        "config": {k: getattr(a, k) for k in _ARGS if k != "gas"} | {"gas_list": gas_list, "reps": a.reps},
        "wall_seconds": time.time() - started,
        "summary": summary,
        "runs": {str(g): v for g, v in runs.items()},
    }
    Path(f"{prefix}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Pipeline on 2 GPUs (NCCL) {date}",
        "",
        f"GPT {a.layers} x {a.dim} (heads {a.heads}, seq {a.seq}, vocab {a.vocab}), bf16, Adam, micro-batch "
        f"{a.micro}; {a.reps} interleaved reps x {a.steps} steps (first dropped); step = slower rank's median. "
        f"Command: `python bench/pipe_nccl.py {' '.join(sys.argv[1:])}`. DeepSpeed not installed there.",
        "",
        "| M | method | step ms (median, min-max) | tokens/s | peak GiB per rank | bubble (ideal) | p2p MiB/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g, s in summary.items():
        for m in methods:
            x = s[m]
            med, lo, hi = x["step_ms"]
            bub = f"{x['bubble_measured']:.2f} ({x['bubble_ideal']:.2f})" if "bubble_measured" in x else "-"
            p2p = (
                "/".join(f"{b / 2**20:.0f}" for b in x["p2p_sent_bytes_per_step"])
                if m.startswith("dstrain-pp2")
                else "-"
            )
            mem = "/".join(f"{v:.1f}" for v in x["peak_mem_gib_per_rank"])
            lines.append(
                f"| {g} | {m} | {med:.1f} ({lo:.1f}-{hi:.1f}) | {x['tokens_per_s']:.0f} | {mem} | {bub} | {p2p} |"
            )
        if "speed_vs_ddp" in s:
            r = s["speed_vs_ddp"]
            lines.append(f"| {g} | PP=2 speed vs DDP | {r['median']:.2f}x | | | | |")
    Path(f"{prefix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
