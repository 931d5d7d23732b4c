"""MoE benchmark: dstrain's MoE vs DeepSpeed's MoE (same model, data, routing) vs a dense MLP of the same
active FLOPs, world size 2 on gloo (CPU), expert parallelism over all-to-all.

Model: Linear(d, d) -> tanh -> MoE(E experts, each Linear(d, f) GELU Linear(f, d), top-k, ep_size) ->
residual -> Linear(d, d); MSE loss + 0.01 l_aux; AdamW (torch's, in both frameworks), ZeRO stage 1.
Routing is deterministic (use_rts=False, top2_2nd_expert_sampling=False) and identical in both
frameworks, capacity_factor 1.0 with token dropping. The dense baseline replaces the MoE by one MLP
Linear(d, k*f) GELU Linear(k*f, d): the per-token FLOPs of k experts, no gate, no all-to-all.

Every (method, rep) runs in fresh processes launched by torchrun; methods are interleaved rep by rep.
Per run we record the median step time (forward + backward + step) after warm-up, tokens/s over both
ranks, all-to-all bytes per step and the dropped-route fraction (dstrain: its counters; DeepSpeed: the
same quantities computed from its exp_counts and capacity, which its layer exposes).

    python bench/moe.py                                 # defaults below; writes bench/results/moe-<date>.{md,json}
    python bench/moe.py --reps 1 --steps 5 --label quick
    python bench/moe.py --quick                         # seconds (make bench): tiny shape, dstrain MoE only, 1 rep

DeepSpeed's interpreter: ``--ds-python``, else bench/_common.deepspeed_python()'s default.

On GPUs (one per rank, NCCL): ``--device cuda --backend nccl`` (optionally ``--bf16``). DeepSpeed is not
installed on the GPU machine, so there the comparison is dstrain's MoE vs the dense MLP only (the report
says so), e.g. a realistic layer on 2x H200:

    python bench/moe.py --device cuda --backend nccl --bf16 --d 2048 --ffn 8192 --experts 8 --k 2 \
        --tokens 8192 --steps 20 --reps 3 --output "$OUT/moe-h200x2-nccl"
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
METHODS = ("dstrain-moe", "deepspeed-moe", "dstrain-dense")
_SHAPE = ("d", "ffn", "experts", "k", "ep", "tokens", "steps", "warmup", "device", "backend", "bf16")


# -- worker (runs on each rank under torchrun) --------------------------------------------------------


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    d, f, e, k, ep, tokens = a.d, a.ffn, a.experts, a.k, a.ep, a.tokens
    device = torch.device("cpu")
    if a.device == "cuda":  # one GPU per rank; the engine also puts the model there under NCCL
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if a.worker == "deepspeed-moe":
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        deepspeed.init_distributed(dist_backend="gloo")
        init = deepspeed.initialize
    else:
        sys.path.insert(0, str(ROOT))
        import dstrain
        from dstrain.moe import MoE
        from dstrain.moe import split_params_into_different_moe_groups_for_optimizer as split

        dstrain.init_distributed(a.backend)
        init = dstrain.initialize
    rank, world = dist.get_rank(), dist.get_world_size()

    def mlp(hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(d, d)
            if a.worker == "dstrain-dense":
                self.ffn: nn.Module = mlp(k * f)
            else:
                self.moe = MoE(
                    d,
                    mlp(f),
                    num_experts=e,
                    ep_size=ep,
                    k=k,
                    capacity_factor=1.0,
                    min_capacity=4,
                    use_rts=False,
                    top2_2nd_expert_sampling=False,
                )
            self.out = nn.Linear(d, d)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            if a.worker == "dstrain-dense":
                return F.mse_loss(self.out(h + self.ffn(h)), y)
            m, l_aux, counts = self.moe(h)
            self.counts = counts
            return F.mse_loss(self.out(h + m), y) + 0.01 * l_aux

    net = Net()
    cfg = {
        "train_micro_batch_size_per_gpu": tokens,
        "gradient_accumulation_steps": 1,
        "train_batch_size": tokens * world,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    if a.bf16:
        cfg["bf16"] = {"enabled": True}
    params = split({"params": list(net.parameters()), "name": "p"})
    engine, _, _, _ = init(model=net, model_parameters=params, config=cfg)
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(tokens, d, generator=g).to(device), torch.randn(tokens, d, generator=g).to(device))
        for _ in range(4)
    ]
    times, dropped, routes = [], 0, 0
    for step in range(a.warmup + a.steps):
        x, y = batches[step % len(batches)]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
            if a.worker != "dstrain-dense":
                cap = _capacity(tokens, e, k)
                counts = net.counts.long()
                dropped += int((counts - cap).clamp(min=0).sum())
                routes += int(counts.sum())
    step_s = statistics.median(times)
    res: dict[str, Any] = {"method": a.worker, "rank": rank, "step_s": step_s, "loss": float(loss)}
    if a.worker != "dstrain-dense":
        cap = _capacity(tokens, e, k)
        res["capacity"] = cap
        # 2 all-to-alls forward, 2 backward, of the compute dtype
        res["a2a_bytes_per_step_formula"] = 4 * e * cap * d * (2 if a.bf16 else 4)
        res["dropped_fraction"] = dropped / routes if routes else 0.0
    if a.worker == "dstrain-moe":
        st = net.moe.statistics()
        res["a2a_bytes_per_step"] = st.exchange.all_to_all_bytes / (a.warmup + a.steps)
        res["a2a_seconds_per_step"] = st.exchange.all_to_all_seconds / (a.warmup + a.steps)
        res["dropped_fraction_counted"] = st.dropped_fraction
    t = torch.tensor([step_s], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["step_s_max_rank"] = float(t)
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()


def _capacity(tokens: int, experts: int, k: int) -> int:
    """DeepSpeed's and dstrain's capacity at capacity_factor 1, min_capacity 4 (float32 product)."""
    import torch

    c = torch.ceil(
        torch.tensor(tokens / experts, dtype=torch.float32) * torch.tensor(float(k), dtype=torch.float32)
    )
    return max(int(c), 4)


# -- orchestrator -------------------------------------------------------------------------------------


def _launch(method: str, a: argparse.Namespace) -> dict[str, Any]:
    py = a.ds_python if method == "deepspeed-moe" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if a.ds_python:  # DeepSpeed's JIT ops, where bench/baselines/setup_deepspeed.sh built them
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(a.ds_python).parent.parent / "torch_extensions"))
    args = [
        py,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        "--worker",
        method,
    ]
    # the worker's settings travel in the environment: torchrun abbreviation-matches options like --d
    env["MOE_BENCH_ARGS"] = json.dumps({key: getattr(a, key) for key in _SHAPE})
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=a.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(
        f"{method} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def _med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=METHODS)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ds-python", default=None, help="DeepSpeed's interpreter (see bench/_common.py)")
    p.add_argument(
        "--quick", action="store_true", help="seconds (make bench): tiny shape, dstrain MoE only, 1 rep"
    )
    p.add_argument("--label", default="", help="appended to the result file names (e.g. run-under-load)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: rank r on cuda:r")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (the engine's bf16 section)")
    p.add_argument(
        "--output", default="", help="result path prefix (default bench/results/moe-<date>[-label])"
    )
    a = p.parse_args()
    if a.worker:
        for key, value in json.loads(os.environ.get("MOE_BENCH_ARGS", "{}")).items():
            setattr(a, key, value)
        _worker(a)
        return
    if a.quick:
        a.d, a.ffn, a.tokens, a.steps, a.warmup, a.reps = 32, 64, 64, 2, 1, 1
        a.methods, a.label = "dstrain-moe", a.label or "quick"  # one torchrun job: ~25 s under load
    if (a.device == "cuda") != (a.backend == "nccl"):
        p.error("--device cuda goes with --backend nccl (and cpu with gloo)")
    methods = [m for m in a.methods.split(",") if m]
    notes: list[str] = []
    if a.device == "cuda" and "deepspeed-moe" in methods:
        methods.remove("deepspeed-moe")
        notes.append(
            "DeepSpeed is not run on the GPU machine (not installed there): dstrain MoE vs dense MLP only"
        )
    if "deepspeed-moe" in methods:
        sys.path.insert(0, str(ROOT))
        from bench._common import deepspeed_python

        a.ds_python = deepspeed_python(a.ds_python)
        if a.ds_python is None:  # deepspeed_python() said why
            methods.remove("deepspeed-moe")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    started = time.time()
    for rep in range(a.reps):  # interleaved: rep 1 of every method, then rep 2, ...
        for m in methods:
            r = _launch(m, a)
            runs[m].append(r)
            print(f"rep {rep + 1} {m}: step {r['step_s_max_rank'] * 1e3:.1f} ms", flush=True)
    wall = time.time() - started
    tokens_per_step = 2 * a.tokens
    summary: dict[str, Any] = {}
    for m, rs in runs.items():
        steps = [r["step_s_max_rank"] for r in rs]
        med, lo, hi = _med(steps)
        summary[m] = {
            "step_ms": [med * 1e3, lo * 1e3, hi * 1e3],
            "tokens_per_s": [tokens_per_step / med, tokens_per_step / hi, tokens_per_step / lo],
            "per_rep_step_ms": [s * 1e3 for s in steps],
        }
        for key in ("a2a_bytes_per_step", "a2a_bytes_per_step_formula", "dropped_fraction", "capacity"):
            if key in rs[0]:
                summary[m][key] = rs[0][key]
    ratios = {}
    if "dstrain-moe" in runs:
        ours = [r["step_s_max_rank"] for r in runs["dstrain-moe"]]
        for other in ("deepspeed-moe", "dstrain-dense"):
            if other in runs:
                theirs = [r["step_s_max_rank"] for r in runs[other]]
                per_rep = [t / o for o, t in zip(ours, theirs, strict=True)]
                ratios[f"speed_vs_{other}"] = {"median": statistics.median(per_rep), "per_rep": per_rep}
    date = datetime.date.today().isoformat()
    name = f"moe-{date}" + (f"-{a.label}" if a.label else "")
    sys.path.insert(0, str(ROOT))
    from bench._common import RESULTS

    out_dir = Path(RESULTS)
    if a.output:
        out_dir, name = Path(a.output).parent, Path(a.output).name
        out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "moe",
        "date": date,
        "label": a.label,
        "config": {
            k: getattr(a, k)
            for k in ("d", "ffn", "experts", "k", "ep", "tokens", "steps", "warmup", "reps", "bf16")
        },
        "world": 2,
        "backend": a.backend,
        "device": a.device,
        "notes": notes,
        "wall_seconds": wall,
        "load_average_at_end": os.getloadavg(),
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# MoE benchmark {date}{' (' + a.label + ')' if a.label else ''}",
        "",
        f"2 {a.backend} ranks ({'one GPU each' if a.device == 'cuda' else 'CPU'}"
        f"{', bf16' if a.bf16 else ', fp32'}), d={a.d}, expert ffn={a.ffn}, E={a.experts}, k={a.k}, ep_size={a.ep}, "
        f"{a.tokens} tokens/rank/step, ZeRO 1, AdamW; {a.reps} interleaved reps x {a.steps} steps "
        f"(+{a.warmup} warm-up); step time = the slower rank's median. Load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}. Command: `python bench/moe.py {' '.join(sys.argv[1:])}`"
        f" ({wall:.0f} s).",
        "",
        "| method | step ms (median, min-max) | tokens/s (median) | all-to-all bytes/step/rank | dropped routes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m, s in summary.items():
        med, lo, hi = s["step_ms"]
        a2a = s.get("a2a_bytes_per_step", s.get("a2a_bytes_per_step_formula"))
        a2a_txt = (
            "-"
            if a2a is None
            else f"{a2a / 2**20:.2f} MiB" + ("" if "a2a_bytes_per_step" in s else " (formula)")
        )
        drop = s.get("dropped_fraction")
        lines.append(
            f"| {m} | {med:.1f} ({lo:.1f}-{hi:.1f}) | {s['tokens_per_s'][0]:.0f} | {a2a_txt} | "
            f"{'-' if drop is None else f'{drop:.1%}'} |"
        )
    lines.append("")
    lines += [f"- {n}" for n in notes]
    for key, r in ratios.items():
        lines.append(
            f"- dstrain MoE {key.replace('_', ' ')}: {r['median']:.2f}x (their step time / ours, per rep: "
            f"{', '.join(f'{x:.2f}' for x in r['per_rep'])})"
        )
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
