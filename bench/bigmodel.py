"""A model bigger than the machine: a >= 4B-parameter GPT, bf16, parameters + optimizer state on NVMe,
built under ``dstrain.zero.Init``, trained on this 2-core / 24 GiB box (issue 23's moonshot).

    python bench/bigmodel.py --nvme-dir /data/swap                  # the real run (sized to the disk)
    python bench/bigmodel.py --nvme-dir /data/swap --layers 24 --dim 1024 --steps 3 --label smoke
    python bench/bigmodel.py --quick      # seconds (make bench): 2 layers of 128, 2 steps, label "quick"

Default: one rank. Why one and not two on this machine: a rank's swap I/O already runs on dsio's
worker threads (the disk, not the process count, is the limit), and two data-parallel ranks would
each gather every unit whole through gloo twice per step (2 B x P more memory traffic per pass on
two cores that also do the matmuls and Adam). ``torchrun --nproc_per_node 2 bench/bigmodel.py ...``
runs two ranks (each holds half of every shard) if you want to compare.

Before building, the bench sizes the model to the disk: the swap files need
``(2 bf16 shard + 4 fp32 master + 8 Adam m, v + 4 fp32 gradient) = 18 B`` per parameter (plus the
transient Init file, whose blocks are punched out as initialize adopts each unit), and the run
refuses (or, without ``--layers``, shrinks the model, saying so) when the free space cannot hold
them with 10% to spare. It reports the state on disk against the machine's RAM (the issue's target:
>= 2.3x).

Default shape: dim 3072, 24 heads, vocab 32000, 35 layers = 4.06B parameters (fewer layers when the
disk cannot hold them), seq 64, batch 1, ``offload_pinned_bytes`` 1.5 GiB (2 swap buffers of the embedding's shard).

Measured in the same run: the disk's GB/s (a dsio O_DIRECT write + read probe in the swap directory,
before training), then ``--steps`` timed steps after one warm-up step, each with its bytes swapped
(dstrain's swap counters by kind). Reported: step time beside the I/O floor (bytes read per step at
the probe's read GB/s plus bytes written at its write GB/s; target step <= 1.3x floor), peak RSS per rank (target <= 4 GiB),
tokens/s, the first losses, and bytes swapped per step per parameter beside DeepSpeed's for the same
configuration, with the formulas. A tqdm bar shows the steps and the swap GB/s.
Writes ``bigmodel-<date>[-<label>].{md,json}`` under ``$DSIO_BENCH_RESULTS``, else bench/results
(bench/_common.py's ``RESULTS``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import RESULTS, machine, rss, scratch_dir  # noqa: E402

GIB = 1 << 30
#: Swap-file bytes per parameter: bf16 shard + fp32 master + Adam m, v + fp32 gradient.
DISK_BYTES_PER_PARAM = 2 + 4 + 8 + 4
SPARE = 0.10
RAM_RATIO_TARGET = 2.3
STEP_FLOOR_TARGET = 1.3
RSS_TARGET = 4 * GIB
QUICK_HELP = "seconds (make bench): 2 layers of dim 128, 2 timed steps, a 16 MiB disk probe, label 'quick'"


def gpt_numel(layers: int, dim: int, vocab: int, seq: int) -> int:
    """Parameters of `build`'s GPT: per block 12 d^2 + 13 d (qkv, proj, 4x MLP, biases, 2 norms)."""
    return layers * (12 * dim * dim + 13 * dim) + vocab * dim + seq * dim + 2 * dim


def build(layers: int, dim: int, heads: int, vocab: int, seq: int) -> Any:
    """A GPT-2-style model whose every module initializes itself in its own ``__init__`` (so
    ``zero.Init`` partitions initialized values: a post-hoc ``for m in model.modules(): init(m)``
    would write into placeholders)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import dstrain

    class Linear(nn.Linear):
        def reset_parameters(self) -> None:  # GPT-2: N(0, 0.02), zero bias
            nn.init.normal_(self.weight, std=0.02)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    class Embedding(nn.Embedding):
        def reset_parameters(self) -> None:
            nn.init.normal_(self.weight, std=0.02)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = Linear(dim, 3 * dim)
            self.proj = Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, heads, C // heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(dim)
            self.fc = Linear(dim, 4 * dim)
            self.out = Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))  # (B, T, C)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = Embedding(vocab, dim)
            self.wpe = Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            # the head is tied to wte and used in this forward, outside wte's: ZeRO-3 gathers it here too
            dstrain.zero.register_external_parameter(self, self.wte.weight)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V): the head tied to wte
            return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    return GPT()


def size_model(args: argparse.Namespace, free: int, world: int) -> tuple[int, str]:
    """The layer count to build and a note on how it was chosen (the disk may force fewer)."""
    fits = lambda n: gpt_numel(n, args.dim, args.vocab, args.seq) * DISK_BYTES_PER_PARAM <= free * (1 - SPARE)  # noqa: E731
    if args.layers:
        if not fits(args.layers):
            need = gpt_numel(args.layers, args.dim, args.vocab, args.seq) * DISK_BYTES_PER_PARAM
            raise SystemExit(
                f"bigmodel: {args.layers} layers need {need / 1e9:.1f} GB of swap files under "
                f"{args.nvme_dir}, {free / 1e9:.1f} GB are free (keeping {SPARE:.0%} spare): "
                "use fewer --layers or another --nvme-dir"
            )
        return args.layers, f"{args.layers} layers as asked"
    target = 1  # the smallest layer count reaching --params
    while gpt_numel(target, args.dim, args.vocab, args.seq) < args.params:
        target += 1
    n = target
    while n > 1 and not fits(n):
        n -= 1
    if n < target:
        return n, (
            f"the disk forces a smaller model: {target} layers ({gpt_numel(target, args.dim, args.vocab, args.seq) / 1e9:.2f}B "
            f"params) need {gpt_numel(target, args.dim, args.vocab, args.seq) * DISK_BYTES_PER_PARAM / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB free: {n} layers"
        )
    return n, f"{n} layers: the smallest GPT of dim {args.dim} with >= {args.params / 1e9:.1f}B params"


def expected(params: int, grads_on_nvme: bool = True) -> dict[str, Any]:
    """Bytes swapped per step per parameter (one micro-step, both directions, all ranks), dstrain
    and DeepSpeed 0.19.8 for this configuration (bf16 ZeRO-3, offload_param + offload_optimizer nvme)."""
    dstrain = {
        "param bf16 shard: read for the forward and the backward gathers, written after the step": 3 * 2,
        "fp32 master (its own file): read and written by the step": 2 * 4,
        "Adam m, v fp32: read and written by the step": 2 * 8,
    }
    if grads_on_nvme:  # offload_pinned_bytes cannot hold this rank's fp32 gradient shards
        dstrain["fp32 gradient shard: written in backward, read by the step"] = 2 * 4
    deepspeed = {
        "param fp16/bf16 partition: read for the forward and backward fetches, written after the step": 3 * 2,
        "optimizer swapper: fp32 master + m + v + fp32 gradient, read and written per sub-group": 2 * 16,
    }
    return {
        "dstrain": dstrain,
        "dstrain_per_param": sum(dstrain.values()),
        "deepspeed": deepspeed,
        "deepspeed_per_param": sum(deepspeed.values()),
        "params": params,
    }


def config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    nvme = {"device": "nvme", "nvme_path": args.nvme_dir}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "train_batch_size": args.batch * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 4 * args.dim * args.dim,
            "stage3_max_live_parameters": 3 * 4 * args.dim * args.dim,
            "sub_group_size": 1 << 24,
            "offload_param": dict(nvme, buffer_count=4),
            "offload_optimizer": dict(nvme, buffer_count=4),
            "offload_pinned_bytes": args.pinned_mib << 20,
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 32,
            "intra_op_parallelism": 2,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 10**9,
    }


def _swapped(engine: Any, optimizer: Any) -> dict[str, float]:
    from bench.offload_worker import offload_counters

    return offload_counters(engine.zero.store, optimizer) or {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-dir", default=os.path.join(scratch_dir(), "bigmodel"))
    ap.add_argument("--params", type=float, default=4.0e9, help="target parameter count (default 4e9)")
    ap.add_argument("--layers", type=int, default=0, help="layers (default: sized to --params and the disk)")
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=24)
    # 32000 (LLaMA's): the embedding is the largest unit, and its shard must fit a pinned swap buffer
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument(
        "--pinned-mib",
        type=int,
        default=1536,
        help="offload_pinned_bytes per rank, MiB (the parameter pool's half must hold the embedding's shard)",
    )
    ap.add_argument("--probe-mib", type=int, default=1024, help="bytes of the disk probe, MiB")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    ap.add_argument("--label", default="")
    ap.add_argument("--keep", action="store_true", help="keep the swap directory's files")
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    if args.quick:  # the same path (zero.Init, params + optimizer on NVMe, probe, steps), a toy's size
        args.layers, args.dim, args.heads, args.vocab, args.seq = 2, 128, 4, 1000, 32
        args.steps, args.pinned_mib, args.probe_mib = 2, 16, 16
        args.label = args.label or "quick"

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    import dstrain
    from bench.offload import disk_probe

    dstrain.init_distributed()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    os.makedirs(args.nvme_dir, exist_ok=True)
    free = shutil.disk_usage(args.nvme_dir).free
    layers, sizing = size_model(args, free, world)
    params = gpt_numel(layers, args.dim, args.vocab, args.seq)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    disk_state = params * DISK_BYTES_PER_PARAM
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"bigmodel: {params / 1e9:.2f}B params ({sizing}); state on disk {disk_state / GIB:.1f} GiB = "
        f"{disk_state / ram:.2f}x RAM ({ram / GIB:.0f} GiB; target >= {RAM_RATIO_TARGET}x); {free / GIB:.0f} GiB free",
        flush=True,
    )
    probe = disk_probe(args.nvme_dir, args.probe_mib << 20) if rank == 0 else {}
    say(f"disk probe: {probe}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    cfg = config(args, world)
    base_rss = rss()[0]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with dstrain.zero.Init(config_dict_or_path=cfg) as zi:
        model = build(layers, args.dim, args.heads, args.vocab, args.seq)
    t_build = time.perf_counter() - t0
    init_stats = zi.statistics()
    say(
        f"built under zero.Init in {t_build:.0f} s: largest module {init_stats.largest_module_numel / 1e6:.0f}M "
        f"elements, peak RSS {rss()[1] / GIB:.2f} GiB",
        flush=True,
    )
    t0 = time.perf_counter()
    engine, optimizer = dstrain.initialize(model=model, config=cfg)[:2]
    t_init = time.perf_counter() - t0
    say(f"initialize (adopting the shards) in {t_init:.0f} s, peak RSS {rss()[1] / GIB:.2f} GiB", flush=True)

    g = torch.Generator().manual_seed(1234)
    steps = args.steps + 1  # the first is a warm-up (read-ahead order recorded, files first touched)
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=steps, desc="bigmodel", unit="step", disable=rank != 0)
    for step in range(steps):
        idx = torch.randint(0, args.vocab, (args.batch * world, args.seq), generator=g)  # (B, T)
        targets = torch.roll(idx, -1, dims=1)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        optimizer.drain()
        before = _swapped(engine, optimizer)
        start = time.perf_counter()
        loss = engine(idx[mine], targets[mine])
        engine.backward(loss)
        engine.step()
        optimizer.drain()
        took = time.perf_counter() - start
        after = _swapped(engine, optimizer)
        moved = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in after
            if k.endswith("_bytes") and k != "pinned_bytes"
        }
        total = sum(moved.values())
        if dist.is_initialized():
            t = torch.tensor([total, loss.item()], dtype=torch.float64)
            dist.all_reduce(t)
            total, mean_loss = float(t[0]), float(t[1]) / world
        else:
            mean_loss = loss.item()
        rd = sum(v for k, v in moved.items() if k.endswith("_read_bytes")) * world  # ranks move alike
        row = {"step": step, "seconds": took, "loss": mean_loss, "swapped_bytes": total, "by_kind": moved}
        rows.append(dict(row, read_bytes=rd, written_bytes=total - rd))
        bar.set_postfix(loss=f"{mean_loss:.3f}", swap=f"{total / took / 1e9:.2f} GB/s", step_s=f"{took:.0f}")
        bar.update(1)
    bar.close()
    peak = rss()[1]
    peaks = torch.tensor([peak], dtype=torch.float64)
    all_peaks = [peak]
    if dist.is_initialized():
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, peaks)
        all_peaks = [int(x.item()) for x in gathered]
    grads_on_nvme = engine.zero.store.grads is not None
    engine.close()
    optimizer.close()
    if rank != 0:
        return
    timed = rows[1:]
    step_s = statistics.median(r["seconds"] for r in timed)
    swapped = statistics.median(r["swapped_bytes"] for r in timed)
    reads = statistics.median(r["read_bytes"] for r in timed)
    writes = statistics.median(r["written_bytes"] for r in timed)
    # reads and writes share the disk: the floor is each direction's bytes at the probe's rate for it
    floor = float("nan")
    if "read_gbps" in probe:
        floor = reads / (probe["read_gbps"] * 1e9) + writes / (probe["write_gbps"] * 1e9)
    exp = expected(params, grads_on_nvme)
    result = {
        "machine": machine(),
        "load_1m": os.getloadavg()[0],
        "world": world,
        "layers": layers,
        "dim": args.dim,
        "params": params,
        "sizing": sizing,
        "disk_state_bytes": disk_state,
        "ram_bytes": ram,
        "disk_over_ram": disk_state / ram,
        "probe": probe,
        "build_s": t_build,
        "initialize_s": t_init,
        "steps": rows,
        "median_step_s": step_s,
        "median_swapped_bytes": swapped,
        "median_read_bytes": reads,
        "median_written_bytes": writes,
        "swapped_per_param": swapped / params,
        "io_floor_s": floor,
        "step_over_floor": step_s / floor if floor == floor else float("nan"),
        "tokens_per_s": args.batch * world * args.seq / step_s,
        "peak_rss_bytes": all_peaks,
        "baseline_rss_bytes": base_rss,
        "expected": exp,
    }
    md = render(result, args)
    stamp = datetime.date.today().isoformat()
    name = f"bigmodel-{stamp}" + (f"-{args.label}" if args.label else "")
    os.makedirs(RESULTS, exist_ok=True)
    out = Path(RESULTS) / name
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}.md and .json")
    if not args.keep:
        for f in os.listdir(args.nvme_dir):
            if f.startswith(("dstrain-swap", "zero_init")):
                os.unlink(os.path.join(args.nvme_dir, f))


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    exp = r["expected"]
    load = r["load_1m"]
    label = f"under load (load {load:.1f})" if load > 2.5 else f"quiet (load {load:.1f})"
    lines = [
        f"# bigmodel: {r['params'] / 1e9:.2f}B-parameter GPT, bf16, params + optimizer on NVMe, zero.Init — {label}",
        "",
        f"{r['machine']['date']}, {r['machine']['cpu']}, {r['machine']['memory']} RAM; {r['world']} rank(s) "
        "(one by default: the disk is the limit and dsio's workers already run its swap I/O in parallel; "
        "two would gather every unit through gloo twice per step on the same two cores); "
        f"{r['layers']} layers x dim {r['dim']}, seq {args.seq}, batch {args.batch} per rank; {r['sizing']}.",
        "",
        "| metric | value | target |",
        "| --- | --- | --- |",
        f"| state on disk / RAM | {r['disk_state_bytes'] / GIB:.1f} GiB / {r['ram_bytes'] / GIB:.0f} GiB = "
        f"{r['disk_over_ram']:.2f}x | >= {RAM_RATIO_TARGET}x |",
        f"| disk probe (dsio O_DIRECT, same run) | write {r['probe'].get('write_gbps', float('nan')):.2f} GB/s, "
        f"read {r['probe'].get('read_gbps', float('nan')):.2f} GB/s | |",
        f"| median step | {r['median_step_s']:.1f} s | |",
        f"| I/O floor (bytes read / read GB/s + bytes written / write GB/s, per step) | {r['io_floor_s']:.1f} s "
        f"({r['median_read_bytes'] / 1e9:.1f} GB read, {r['median_written_bytes'] / 1e9:.1f} GB written) | |",
        f"| step / floor | {r['step_over_floor']:.2f}x | <= {STEP_FLOOR_TARGET}x |",
        f"| peak RSS per rank | {', '.join(f'{p / GIB:.2f} GiB' for p in r['peak_rss_bytes'])} "
        f"(baseline {r['baseline_rss_bytes'] / GIB:.2f} GiB) | <= 4 GiB |",
        f"| tokens/s | {r['tokens_per_s']:.2f} | |",
        f"| build under zero.Init / initialize | {r['build_s']:.0f} s / {r['initialize_s']:.0f} s | |",
        "",
        "First losses: "
        + ", ".join(f"{s['loss']:.4f}" for s in r["steps"][:6])
        + " (step 0 is the warm-up, untimed).",
        "",
        "## Bytes swapped per step per parameter",
        "",
        f"Measured (dstrain's swap counters, median timed step, all ranks): "
        f"{r['swapped_per_param']:.2f} B/param = {r['median_swapped_bytes'] / 1e9:.2f} GB for {r['params']:,} params.",
        "",
        f"dstrain's formula: {exp['dstrain_per_param']} B/param",
        *[f"- {k}: {v} B" for k, v in exp["dstrain"].items()],
        "",
        f"DeepSpeed 0.19.8, same configuration (formula; its optimizer swapper moves the gradient and master "
        f"with m and v, measured on the 110M GPT in bench/offload.py): {exp['deepspeed_per_param']} B/param",
        *[f"- {k}: {v} B" for k, v in exp["deepspeed"].items()],
        "",
        "Per step: "
        + "; ".join(
            f"{s['step']}: {s['seconds']:.1f} s, {s['swapped_bytes'] / 1e9:.2f} GB" for s in r["steps"]
        ),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
