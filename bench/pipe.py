"""Pipeline parallelism: dstrain PP=2 vs DeepSpeed PipelineEngine PP=2 vs DDP, on 2 gloo ranks.

    .venv/bin/python bench/pipe.py [--reps 3] [--steps 6] [--dim 1024] [--layers 8] [--micro 16] [--gas 4,8]
    .venv/bin/python bench/pipe.py --record-ds-losses tests/dstrain/pipe/pipe_ds_losses.json
    .venv/bin/python bench/pipe.py --quick      # seconds (make bench): tiny model, dstrain and DDP, 1 rep

Each rep runs every method (interleaved: rep 1 of all, then rep 2, ...) as its own ``torchrun`` job, DeepSpeed's
in DeepSpeed's venv (``--ds-python``, else bench/_common.deepspeed_python()'s default). Same model (``layers`` x (Linear(dim,
dim) + Tanh) and a Linear(dim, 8) head, seeded), same data, same Adam, micro-batch ``micro``, ``gas`` micro-batches
per step. Reported per method and micro-batch count: median step time (first step dropped) with min-max, peak
RSS growth per stage during training, and for dstrain the measured bubble (1 - compute time / step time of the
busiest stage) next to (S-1)/(M+S-1), bytes saved for backward per stage, and p2p payload bytes per step. DDP
runs the whole model on both ranks with half the micro-batches each (the same global batch).

``--record-ds-losses`` runs DeepSpeed's pipeline engine on the anchor's model (../shared/anchors/ds_pipe_cpu.py,
with Adam weight decay pinned to 0) for 10 steps and writes its per-step losses: the fixture
tests/dstrain/pipe/test_pipe_train.py compares dstrain against (within 1e-5).

Worker modes (``--worker ds|dstrain|ddp``) run inside torchrun and import only what their framework needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OUR_PYTHON = sys.executable

from bench._common import rss  # noqa: E402

# -- the shared model and data (imported by every worker) ------------------------------------------------


def make_layers(dim: int, n: int, out: int = 8, seed: int = 0) -> list[Any]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[Any] = []
    for _ in range(n):
        layers += [nn.Linear(dim, dim), nn.Tanh()]
    layers.append(nn.Linear(dim, out))
    return layers


def make_data(n: int, micro: int, dim: int, seed: int = 1) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(micro, dim, generator=g), torch.randint(0, 8, (micro,), generator=g)) for _ in range(n)
    ]


def _rss_kib() -> int:
    """This rank's peak RSS (VmHWM), KiB, as the other drivers read it. (getrusage's ru_maxrss, read
    before, also keeps the peak of the process that exec'ed this one: a child of a 300 MiB parent
    reads 321,156 KiB where its VmHWM is 13,604; under torchrun, whose process is smaller than a
    rank's, the two agree.)"""
    return rss()[1] // 1024


def _optimizer_cfg() -> dict[str, Any]:
    return {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}


# -- workers ----------------------------------------------------------------------------------------------


def worker_ds(a: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    layers = make_layers(a.dim, a.layers)
    pipe = PipelineModule(
        layers=layers, loss_fn=torch.nn.CrossEntropyLoss(), num_stages=2, partition_method="uniform"
    )
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": a.gas,
        "steps_per_print": 10**6,
        "optimizer": _optimizer_cfg(),
        "pipeline": {"activation_checkpoint_interval": 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=list(pipe.parameters()), config=cfg)
    per = _time_ds_instructions(engine)
    it = iter(make_data(a.steps * a.gas, a.micro, a.dim))
    rss0 = _rss_kib()
    losses, times, phases = [], [], []
    for _ in range(a.steps):
        torch.distributed.barrier()
        per.clear()
        t = time.perf_counter()
        losses.append(engine.train_batch(data_iter=it).item())
        times.append(time.perf_counter() - t)
        phases.append(dict(per))
    return {
        "rank": rank,
        "losses": losses,
        "times": times,
        "phases": phases,
        "rss_growth_kib": _rss_kib() - rss0,
    }


_DS_STEP = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")


def _time_ds_instructions(engine: Any) -> dict[str, float]:
    """Wrap DeepSpeed's instruction handlers (its ``_INSTRUCTION_MAP``, on this engine only) to sum the seconds
    of each instruction kind, as dstrain's timeline does; the end-of-batch reductions and optimizer step are
    summed as "step". Returns the dict the wrappers add to (cleared by the caller per step)."""
    per: dict[str, float] = {}
    table = dict(type(engine)._INSTRUCTION_MAP)
    for cls, fn in table.items():
        name = "step" if cls.__name__ in _DS_STEP else cls.__name__

        def timed(self: Any, *args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                per[_name] = per.get(_name, 0.0) + time.perf_counter() - t0

        table[cls] = timed
    engine._INSTRUCTION_MAP = table  # an instance attribute: _exec_schedule looks it up on self
    return per


def worker_dstrain(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    import dstrain
    from dstrain.pipe.module import PipelineModule

    dstrain.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    layers = make_layers(a.dim, a.layers)
    pipe = PipelineModule(
        layers, num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform"
    )
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": a.gas,
        "steps_per_print": 10**6,
        "optimizer": _optimizer_cfg(),
    }
    engine, _, _, _ = dstrain.initialize(model=pipe, config=cfg)
    engine.runner.trace = True  # per-instruction timeline: where each step's time goes on this stage
    it = iter(make_data(a.steps * a.gas, a.micro, a.dim))
    rss0 = _rss_kib()
    losses, times, compute, phases = [], [], [], []
    for _ in range(a.steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        losses.append(engine.train_batch(it).item())
        times.append(time.perf_counter() - t)
        compute.append(engine.runner.statistics().compute_seconds)
        per: dict[str, float] = {}
        for e in engine.runner.timeline():
            per[e.what] = per.get(e.what, 0.0) + e.seconds
        phases.append(per)
    st = engine.runner.statistics()
    p2p = sum(s.payload_bytes for s in (st.send_activation, st.send_grad) if s is not None)
    engine.close()
    return {
        "rank": rank,
        "losses": losses,
        "times": times,
        "compute": compute,
        "phases": phases,
        "rss_growth_kib": _rss_kib() - rss0,
        "saved_bytes_peak": st.peak_activation_bytes,
        "p2p_sent_bytes_per_step": p2p / a.steps,
        "recv_wait_seconds": sum(s.wait_seconds for s in (st.recv_activation, st.recv_grad) if s is not None),
    }


def worker_ddp(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.Sequential(*make_layers(a.dim, a.layers))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = make_data(a.steps * a.gas, a.micro, a.dim)
    loss_fn = nn.CrossEntropyLoss()
    per_rank = a.gas // world
    rss0 = _rss_kib()
    times = []
    for s in range(a.steps):
        dist.barrier()
        t = time.perf_counter()
        for m in range(per_rank):
            x, y = data[s * a.gas + m * world + rank]
            if m < per_rank - 1:
                with ddp.no_sync():
                    (loss_fn(ddp(x), y) / per_rank).backward()
            else:
                (loss_fn(ddp(x), y) / per_rank).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return {"rank": rank, "times": times, "rss_growth_kib": _rss_kib() - rss0}


WORKERS = {"ds": worker_ds, "dstrain": worker_dstrain, "ddp": worker_ddp}


# -- orchestration ----------------------------------------------------------------------------------------


def run_job(method: str, a: argparse.Namespace, gas: int, steps: int, out_dir: Path) -> list[dict[str, Any]]:
    """One torchrun job of ``method``; returns each rank's result."""
    python = a.ds_python if method == "ds" else OUR_PYTHON
    torchrun = str(Path(python).parent / "torchrun")
    out = out_dir / f"{method}-{gas}-{time.monotonic_ns()}"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "" if method == "ds" else str(ROOT),
    }
    if method == "ds":  # DeepSpeed's JIT ops, where bench/baselines/setup_deepspeed.sh built them
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(python).parent.parent / "torch_extensions"))
    cmd = [
        torchrun, "--standalone", "--nproc_per_node", "2", __file__, "--worker", method, "--out", str(out),
        "--dim", str(a.dim), "--layers", str(a.layers), "--micro", str(a.micro), "--gas", str(gas),
        "--steps", str(steps),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{method} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return [json.loads((out.parent / f"{out.name}.{r}.json").read_text()) for r in range(2)]


def _med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _phases(reps: list[list[dict[str, Any]]], rank: int, steps: int) -> dict[str, float]:
    """Median ms per step spent in each timeline entry (instruction kind or end-of-batch phase) on ``rank``,
    step 0 dropped; "other" is the step time the timeline does not cover."""
    per: dict[str, list[float]] = {}
    for r in reps:
        res = r[rank]
        if "phases" not in res:
            return {}
        for i in range(1, steps):
            ph = dict(res["phases"][i])
            ph["other"] = res["times"][i] - sum(ph.values())
            for k, v in ph.items():
                per.setdefault(k, []).append(v * 1e3)
    return {k: statistics.median(v) for k, v in per.items()}


def record_ds_losses(path: Path, args: argparse.Namespace) -> None:
    """DeepSpeed's per-step losses on the anchor model (dim 64, 3 hidden layers, mbs 4, gas 4, 10 steps)."""
    a = argparse.Namespace(dim=64, layers=3, micro=4, ds_python=args.ds_python)
    with tempfile.TemporaryDirectory() as d:
        res = run_job("ds", a, gas=4, steps=10, out_dir=Path(d))
    losses = res[0]["losses"]
    assert all(abs(x - y) == 0 for x, y in zip(losses, res[1]["losses"], strict=True))
    path.write_text(
        json.dumps(
            {
                "produced_by": "bench/pipe.py --record-ds-losses (DeepSpeed PipelineEngine, 2 gloo ranks)",
                "deepspeed_python": a.ds_python,
                "model": {"dim": 64, "hidden_layers": 3, "micro_batch": 4, "gas": 4, "steps": 10},
                "optimizer": _optimizer_cfg(),
                "losses": losses,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {path}: {losses}")


def bench(a: argparse.Namespace) -> None:
    gases = [int(g) for g in a.gas_list.split(",")]
    methods = a.methods.split(",")
    if "dstrain" not in methods or not set(methods) <= set(WORKERS):
        sys.exit(f"--methods must include dstrain and name only {sorted(WORKERS)}")
    raw: dict[str, list[list[dict[str, Any]]]] = {f"{m}-{g}": [] for g in gases for m in methods}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.reps):
            for g in gases:
                for m in methods:
                    print(f"rep {rep + 1}/{a.reps} {m} gas={g}", flush=True)
                    raw[f"{m}-{g}"].append(run_job(m, a, g, a.steps, Path(d)))
    S = 2
    rows = []
    for g in gases:
        for m in methods:
            reps = raw[f"{m}-{g}"]
            # a step's time is the slower rank's; drop step 0 (warm-up)
            step_times = [max(r[0]["times"][i], r[1]["times"][i]) for r in reps for i in range(1, a.steps)]
            med, lo, hi = _med(step_times)
            row: dict[str, Any] = {
                "method": m,
                "gas": g,
                "step_s_median": med,
                "step_s_min": lo,
                "step_s_max": hi,
                "rss_growth_mib_per_rank": [
                    statistics.median(r[k]["rss_growth_kib"] for r in reps) / 1024 for k in range(2)
                ],
            }
            row["phases_ms_per_stage"] = [_phases(reps, k, a.steps) for k in range(2)]
            if m == "dstrain":
                bubbles = []
                for r in reps:
                    for i in range(1, a.steps):
                        busiest = max(r[k]["compute"][i] for k in range(2))
                        bubbles.append(1 - busiest / max(r[0]["times"][i], r[1]["times"][i]))
                row["bubble_measured_median"] = statistics.median(bubbles)
                row["bubble_theory"] = (S - 1) / (g + S - 1)
                row["saved_for_backward_mib_per_stage"] = [
                    reps[0][k]["saved_bytes_peak"] / 2**20 for k in range(2)
                ]
                row["p2p_payload_mib_per_step"] = (
                    sum(reps[0][k]["p2p_sent_bytes_per_step"] for k in range(2)) / 2**20
                )
            rows.append(row)
    for g in gases:
        base = next(r for r in rows if r["method"] == "dstrain" and r["gas"] == g)["step_s_median"]
        for r in rows:
            if r["gas"] == g:
                r["dstrain_speedup_vs_this"] = r["step_s_median"] / base
    date = time.strftime("%Y-%m-%d")
    from bench._common import RESULTS

    stem = Path(RESULTS) / f"pipe-{date}{a.suffix}"
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_start": a.load_start,
        "load_avg_end": os.getloadavg(),
        "label": a.label,
        "args": {k: v for k, v in vars(a).items() if k not in ("worker", "out")},
    }
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1) + "\n"
    )
    lines = [
        f"# Pipeline benchmark {date} ({a.label})",
        "",
        f"2 gloo ranks (torchrun), model {a.layers} x (Linear({a.dim},{a.dim}) + Tanh) + Linear({a.dim},8), "
        f"micro-batch {a.micro}, Adam; {a.reps} interleaved reps x {a.steps - 1} timed steps. "
        f"Load average at start {a.load_start}, end {tuple(round(x, 1) for x in os.getloadavg())}.",
        "",
        "| M | method | step s median (min-max) | vs dstrain | RSS growth MiB r0 / r1 | bubble measured / theory | "
        "saved-for-backward MiB s0 / s1 | p2p MiB/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        bub = f"{r['bubble_measured_median']:.2f} / {r['bubble_theory']:.2f}" if "bubble_theory" in r else "-"
        saved = (
            " / ".join(f"{x:.1f}" for x in r["saved_for_backward_mib_per_stage"])
            if "saved_for_backward_mib_per_stage" in r
            else "-"
        )
        p2p = f"{r['p2p_payload_mib_per_step']:.2f}" if "p2p_payload_mib_per_step" in r else "-"
        lines.append(
            f"| {r['gas']} | {r['method']} | {r['step_s_median']:.4f} ({r['step_s_min']:.4f}-{r['step_s_max']:.4f}) "
            f"| {r['dstrain_speedup_vs_this']:.2f}x | "
            + " / ".join(f"{x:.1f}" for x in r["rss_growth_mib_per_rank"])
            + f" | {bub} | {saved} | {p2p} |"
        )
    cols = ("ForwardPass", "BackwardPass", "RecvActivation", "RecvGrad", "SendActivation", "SendGrad")
    cols += ("LoadMicroBatch", "status", "drain", "step", "other")
    phase_rows = [r for r in rows if r.get("phases_ms_per_stage") and r["phases_ms_per_stage"][0]]
    if phase_rows:
        lines += [
            "",
            "Where the step time goes, per stage: median ms per step in each instruction kind (dstrain: its "
            "per-instruction timeline, `runner.trace`; DeepSpeed: its instruction handlers timed the same way, its "
            "ReduceGrads/ReduceTiedGrads/OptimizerStep summed as step). A receive includes its wait; dstrain's "
            "sends only post, DeepSpeed's block until received. status = dstrain's batch-status all-reduce; "
            "other = step time not covered by any instruction.",
            "",
            "| M | method | stage | " + " | ".join(cols) + " |",
            "| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |",
        ]
        for r in phase_rows:
            for k, ph in enumerate(r["phases_ms_per_stage"]):
                cells = " | ".join(f"{ph[c]:.1f}" if c in ph else "-" for c in cols)
                lines.append(f"| {r['gas']} | {r['method']} | {k} | {cells} |")
    lines += [
        "",
        "vs dstrain = this method's median step time / dstrain's (above 1: dstrain is faster). Bubble measured = "
        "1 - (forward+backward time of the busier stage) / step time, dstrain only. RSS growth = peak RSS after the "
        "steps minus before (activations, gradients, optimizer state allocated during training).",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--out")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--gas", type=int, default=4, help="worker mode: micro-batches per step")
    p.add_argument("--gas-list", default="4,8", help="bench mode: micro-batch counts to compare")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--methods", default="dstrain,ds,ddp", help="bench mode: methods to interleave")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--label", default="under load: other jobs running on this 2-core machine")
    p.add_argument("--suffix", default="", help="appended to the result file names")
    p.add_argument("--record-ds-losses", type=Path)
    p.add_argument("--ds-python", default=None, help="DeepSpeed's interpreter (see bench/_common.py)")
    p.add_argument(
        "--quick", action="store_true", help="seconds (make bench): tiny model, dstrain and DDP, 1 rep"
    )
    a = p.parse_args()
    if a.worker:
        res = WORKERS[a.worker](a)
        Path(f"{a.out}.{res['rank']}.json").write_text(json.dumps(res))
        import torch.distributed as dist

        if dist.is_initialized():  # torch's DDP baseline has no close: a live gloo group at interpreter
            dist.barrier()  # exit can abort ("terminate called without an active exception", seen in
            dist.destroy_process_group()  # 1 of 4 --quick runs); dstrain's own exit hook does this itself
        return
    sys.path.insert(0, str(ROOT))  # the orchestrator imports bench._common
    from bench._common import deepspeed_python

    if a.quick:
        a.dim, a.layers, a.micro, a.gas_list, a.steps, a.reps = 64, 2, 4, "4", 2, 1
        a.methods, a.suffix = "dstrain,ddp", a.suffix or "-quick"
    if a.record_ds_losses or "ds" in a.methods.split(","):
        a.ds_python = deepspeed_python(a.ds_python)
        if a.ds_python is None or shutil.which(str(Path(a.ds_python).parent / "torchrun")) is None:
            sys.exit("bench/pipe: no DeepSpeed venv with torchrun (see above, or --methods dstrain,ddp)")
    if a.record_ds_losses:
        record_ds_losses(a.record_ds_losses, a)
        return
    a.load_start = tuple(round(x, 1) for x in os.getloadavg())
    bench(a)


if __name__ == "__main__":
    main()
