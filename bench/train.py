"""Training benchmark: dstrain ZeRO stages 0-3 vs PyTorch DDP, FSDP2 ``fully_shard`` and DeepSpeed.

A GPT-like model (~110M parameters by default), world size 2 on gloo (CPU), same model, data and
seed for every method. Every (method, rep) runs in fresh processes launched by torchrun, methods
interleaved rep by rep (rep 1 of every method, then rep 2, ...), so the machine's drift hits all
methods alike. Per rank we record the median step time and the training-phase peak RSS (VmHWM after
resetting it through /proc/self/clear_refs once the model is built and one warm-up step ran).

    python bench/train.py                          # all methods, writes bench/results/train-<date>.md
    python bench/train.py --methods ddp,dstrain0 --reps 1 --steps 2 --layers 2   # quick look

DeepSpeed runs only when its interpreter can ``import deepspeed``: ``--ds-python``, else
``$DSIO_DEEPSPEED_PYTHON``, else ``$DSIO_DEEPSPEED_VENV/bin/python`` (default venv ``<checkout>/.venv-deepspeed``,
what ``bench/baselines/setup_deepspeed.sh`` builds); a missing one is reported and its methods skipped.
Per-rank result files go to a temporary folder under ``$DSIO_BENCH_DIR`` (default ``<checkout>/.bench-tmp``).

Every method gets the same ``gradient_clipping`` (``--gradient-clipping``, default 0: none), written into
the DeepSpeed-style config and applied to DDP/FSDP2 with ``clip_grad_norm_``: DeepSpeed 0.19.8 clips at
1.0 when the key is absent (see bench/results/train-deepspeed-divergence-2026-11-30.md).
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

from bench._common import RESULTS, deepspeed_python, reset_peak, rss, scratch_dir  # noqa: E402

DSTRAIN_METHODS = [f"dstrain{s}" for s in range(4)]
DS_METHODS = [f"deepspeed{s}" for s in range(4)]
ALL_METHODS = ["ddp", "fsdp2", *DSTRAIN_METHODS, *DS_METHODS]


# -- model -------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from demo.model import Block  # the demo's transformer block: one definition for both

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args.dim
            self.wte = nn.Embedding(args.vocab, d)
            self.wpe = nn.Embedding(args.seq, d)
            self.blocks = nn.ModuleList(Block(d, args.heads) for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, args.vocab, bias=False)
            self.head.weight = self.wte.weight  # tied, as in GPT-2

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))  # (B, T, V)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    model = GPT()
    for m in model.modules():  # GPT-2 initialisation
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
    return model


# -- one (method, rep) inside a torchrun rank --------------------------------------------------


def import_dstrain() -> Any:
    """dstrain, from this checkout (the drivers run from the tree, installed or not)."""
    sys.path.insert(0, str(ROOT))
    import dstrain

    if dstrain.__spec__ is None or dstrain.__spec__.origin is None:
        # a stale editable install can map dstrain to an empty namespace package (no __init__.py, so
        # no origin): load the package from the tree
        import importlib.util

        del sys.modules["dstrain"]
        spec = importlib.util.spec_from_file_location(
            "dstrain", ROOT / "dstrain" / "__init__.py", submodule_search_locations=[str(ROOT / "dstrain")]
        )
        assert spec is not None and spec.loader is not None
        dstrain = importlib.util.module_from_spec(spec)
        sys.modules["dstrain"] = dstrain
        spec.loader.exec_module(dstrain)
    return dstrain


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    lr = 3e-4
    method = args.method
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        # every method steps torch's fused AdamW (one pass per tensor; 5.5x the default loop on CPU here)
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "fused": True}},
        # written out: DeepSpeed 0.19.8 clips at 1.0 when the key is absent, the others at nothing
        "gradient_clipping": args.gradient_clipping,
        # the same ZeRO settings for dstrain and DeepSpeed; 1e7-element buckets are close to DDP's 25 MB
        "zero_optimization": {
            "stage": int(method[-1]) if method[-1].isdigit() else 0,
            "overlap_comm": True,
            "reduce_bucket_size": 10_000_000,
            "allgather_bucket_size": 10_000_000,
        },
        "steps_per_print": 10**9,
    }
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0, fused=True)

        def step(idx: torch.Tensor, tgt: torch.Tensor) -> float:
            loss = net(idx, tgt)
            loss.backward()
            if args.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), args.gradient_clipping)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    elif method == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)

        def step(idx: torch.Tensor, tgt: torch.Tensor) -> float:
            loss = model(idx, tgt)
            loss.backward()
            if args.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.gradient_clipping)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    elif method.startswith(("dstrain", "deepspeed")):
        if method.startswith("dstrain"):
            lib = import_dstrain()
        else:
            import deepspeed as lib  # type: ignore[import-not-found,no-redef]

            ds_config["optimizer"]["params"]["torch_adam"] = True
        engine, _, _, _ = lib.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

        def step(idx: torch.Tensor, tgt: torch.Tensor) -> float:
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            return loss.item()

    else:
        raise SystemExit(f"unknown method {method}")

    g = torch.Generator().manual_seed(1234 + rank)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps + 1)
    ]
    step(batches[0][:, :-1], batches[0][:, 1:])  # warm-up (allocates optimizer state)
    reset_peak(required=True)  # the peak of the training phase, not of building the model
    times, losses = [], []
    for b in batches[1:]:
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(b[:, :-1], b[:, 1:]))
        times.append(time.perf_counter() - start)
    result = {
        "method": method,
        "rank": rank,
        "world": world,
        "params": n_params,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "peak_rss_mib": rss()[1] / 2**20,
        "losses": losses,
    }
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- orchestration -----------------------------------------------------------------------------


def _ds_available(python: str | None) -> bool:
    if python is None:
        return False  # deepspeed_python() said why
    probe = subprocess.run(
        [python, "-c", "import deepspeed"], capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}
    )
    return probe.returncode == 0


def _launch(python: str, method: str, out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.world),
        str(Path(__file__).resolve()),
        "--worker",
        "--method",
        method,
        "--out",
        str(out),
    ]
    for key in ("layers", "dim", "heads", "vocab", "seq", "batch", "steps", "gradient_clipping"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        print(f"  {method} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return []
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(args.world)]


def _fmt(values: list[float], spec: str) -> str:
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def report(
    results: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace, skipped: list[str]
) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    first = next(r for reps in results.values() for rep in reps for r in rep)
    lines = [
        f"# Training benchmark, {now:%Y-%m-%d %H:%M} UTC",
        "",
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, Python {platform.python_version()}, "
        f"torch {__import__('torch').__version__}.",
        f"Model: GPT-like, {args.layers} layers, d={args.dim}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
        f"tied head: {first['params'] / 1e6:.1f}M parameters, fp32, torch's fused AdamW for every method, "
        f"gradient clipping {args.gradient_clipping or 'none'} for every method. World size {args.world} (gloo, one thread "
        f"per rank), micro batch {args.batch} per rank, {args.steps} timed steps after 1 warm-up, {args.reps} reps "
        "interleaved (each in fresh processes).",
        "",
        "A step's time is the slowest rank's (ranks meet at a barrier before each step). Other jobs share this "
        "machine, so single steps get slowed from outside: *best* is the fastest step over all reps (what the "
        "method costs undisturbed; the targets below are judged on it), *median* the median over reps of each "
        "rep's median step, with the reps' min-max in parentheses. Peak RSS: training-phase high-water mark "
        "(VmHWM reset after the warm-up step), max over ranks, median over reps.",
        "",
        "| method | best step, s | vs DDP | median step, s | vs DDP | peak RSS per rank, MiB | vs DDP |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    med: dict[str, tuple[float, float, float]] = {}
    for method, reps in results.items():
        if not reps:
            continue
        per_step = [[max(ts) for ts in zip(*(r["step_s"] for r in rep), strict=True)] for rep in reps]
        best = min(min(steps) for steps in per_step)
        medians = [statistics.median(steps) for steps in per_step]
        peaks = [max(r["peak_rss_mib"] for r in rep) for rep in reps]
        med[method] = (best, statistics.median(medians), statistics.median(peaks))
        base = med.get("ddp")
        ratios = [f"{med[method][i] / base[i]:.2f}x" if base else "-" for i in range(3)]
        lines.append(
            f"| {method} | {best:.3f} | {ratios[0]} | {_fmt(medians, '.3f')} | {ratios[1]} "
            f"| {_fmt(peaks, '.0f')} | {ratios[2]} |"
        )
    pairs = [
        ("dstrain0", "ddp", 1.05, "stage 0 within 5% of DDP"),
        ("dstrain3", "fsdp2", 1.15, "stage 3 within 15% of FSDP2"),
    ]
    pairs += [
        (f"dstrain{s}", f"deepspeed{s}", 1.0, f"stage {s} at least as fast as DeepSpeed's") for s in range(4)
    ]
    lines += ["", "Targets (issue 6), on best step time (median-step ratio in parentheses):", ""]
    for ours, theirs, limit, text in pairs:
        if ours in med and theirs in med:
            r = med[ours][0] / med[theirs][0]
            verdict = "met" if r <= limit else "NOT met"
            lines.append(f"- {text}: {r:.3f}x ({med[ours][1] / med[theirs][1]:.3f}x) -> {verdict}")
        else:
            lines.append(f"- {text}: not measured")
    for s in range(4):
        if f"dstrain{s}" in med and f"deepspeed{s}" in med:
            r = med[f"dstrain{s}"][2] / med[f"deepspeed{s}"][2]
            lines.append(f"- stage {s} memory vs DeepSpeed's: {r:.3f}x -> {'met' if r <= 1.0 else 'NOT met'}")
    if skipped:
        lines += ["", f"Not run: {', '.join(skipped)}."]
    losses = {m: reps[0][0]["losses"][:3] for m, reps in results.items() if reps}
    lines += ["", "First timed losses of rank 0, rep 1 (same data and init everywhere; a sanity check):", ""]
    lines += [f"- {m}: {', '.join(f'{x:.4f}' for x in v)}" for m, v in losses.items()]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[list[dict[str, Any]]]], path: Path) -> bool:
    """Bar charts of best step time and peak RSS per method; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    methods = [m for m, reps in results.items() if reps]
    best = [
        min(min(max(ts) for ts in zip(*(r["step_s"] for r in rep), strict=True)) for rep in results[m])
        for m in methods
    ]
    peaks = [statistics.median(max(r["peak_rss_mib"] for r in rep) for rep in results[m]) for m in methods]
    colors = [
        "tab:gray" if m in ("ddp", "fsdp2") else "tab:blue" if m.startswith("dstrain") else "tab:orange"
        for m in methods
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, values, title in (
        (axes[0], best, "best step time, s"),
        (axes[1], peaks, "peak RSS per rank, MiB"),
    ):
        ax.bar(methods, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(ALL_METHODS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--gradient-clipping", type=float, default=0.0, help="for every method (0: none)")
    p.add_argument(
        "--ds-python",
        default=None,
        help="DeepSpeed's interpreter (default $DSIO_DEEPSPEED_PYTHON, else $DSIO_DEEPSPEED_VENV/bin/python, "
        "else <checkout>/.venv-deepspeed/bin/python)",
    )
    p.add_argument("--output", default=None, help="markdown path (default bench/results/train-<date>.md)")
    p.add_argument("--from-json", default=None, help="re-render the report of an earlier run's .json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument(
        "--quick",
        action="store_true",
        help="seconds (make bench): DDP and dstrain ZeRO-0, 2 layers of 128, 1 rep",
    )
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.methods, args.reps, args.steps = "ddp,dstrain0", 1, 2
        args.layers, args.dim, args.heads, args.vocab, args.seq = 2, 128, 4, 1024, 32
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        if "results" not in saved:  # an earlier version stored the results alone
            saved = {"results": saved, "skipped": []}
        out = Path(args.output) if args.output else Path(args.from_json).with_suffix(".md")
        out.write_text(report(saved["results"], args, saved["skipped"]))
        plot(saved["results"], out.with_suffix(".png"))
        print(f"wrote {out}")
        return
    methods = [m for m in args.methods.split(",") if m]
    skipped = []
    ds_python = deepspeed_python(args.ds_python) if any(m in DS_METHODS for m in methods) else None
    if any(m in DS_METHODS for m in methods) and not _ds_available(ds_python):
        skipped = [m for m in methods if m in DS_METHODS]
        skipped_note = f"{', '.join(skipped)} (no importable DeepSpeed at {ds_python or 'the default path'})"
        methods = [m for m in methods if m not in DS_METHODS]
        skipped = [skipped_note]
    results: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in methods}
    os.makedirs(scratch_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as tmp:
        for rep in range(args.reps):
            for method in methods:
                python = ds_python if method in DS_METHODS and ds_python else sys.executable
                start = time.time()
                out = _launch(python, method, Path(tmp) / f"{method}-{rep}", args)
                if out:
                    results[method].append(out)
                    t = max(r["median_step_s"] for r in out)
                    m = max(r["peak_rss_mib"] for r in out)
                    print(
                        f"rep {rep + 1} {method}: step {t:.3f}s, peak RSS {m:.0f} MiB ({time.time() - start:.0f}s)",
                        flush=True,
                    )
    text = report(results, args, skipped)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    default = Path(RESULTS) / f"train-{date}{'-quick' if args.quick else ''}.md"
    path = Path(args.output) if args.output else default
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps({"results": results, "skipped": skipped}))
    if plot(results, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
