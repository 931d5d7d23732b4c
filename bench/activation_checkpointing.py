"""Activation checkpointing: peak memory and step time, none vs torch.utils.checkpoint vs DeepSpeed's vs dstrain's.

Same model in every variant (``depth`` residual MLP blocks with dropout, input ``(tokens, dim)`` fp32), one
process per variant (so each one's peak is its own). Memory: on CUDA ``max_memory_allocated`` over the
measured steps; on CPU the peak resident set over the steps (sampled every millisecond, heap trimmed
before each step) minus the resident set before it. DeepSpeed's variant runs in the DeepSpeed venv
(``DSIO_DEEPSPEED_VENV``), its ``deepspeed.checkpointing.checkpoint`` configured with defaults.

    python bench/activation_checkpointing.py                  # default shape, 5 steps per variant
    python bench/activation_checkpointing.py --small --steps 2  # smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

VARIANTS = ("none", "torch", "deepspeed", "dstrain", "dstrain-cpu", "dstrain-nvme")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Samples the resident set every millisecond while running."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self) -> _Peak:
        self.peak = _rss()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def worker(variant: str, dim: int, tokens: int, depth: int, steps: int) -> dict:
    """One variant's measurements (runs in its own process)."""
    import torch
    from torch import nn

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    swap = None
    if variant == "torch":
        from torch.utils.checkpoint import checkpoint as torch_ckpt

        def ckpt(f, x):  # type: ignore[no-untyped-def]
            return torch_ckpt(f, x, use_reentrant=False)
    elif variant == "deepspeed":
        import deepspeed

        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        deepspeed.init_distributed(dist_backend="gloo")  # its checkpoint asks the process group for ranks
        ds_ckpt = deepspeed.checkpointing

        ds_ckpt.configure(None, partition_activations=False, checkpoint_in_cpu=False)
        ckpt = ds_ckpt.checkpoint
    elif variant.startswith("dstrain"):
        import dstrain.checkpointing as dckpt

        section: dict = {}
        if variant == "dstrain-cpu":
            section = {"cpu_checkpointing": True}
        elif variant == "dstrain-nvme":
            swap = tempfile.mkdtemp(dir=os.environ.get("DSIO_BENCH_DIR") or None)
            section = {"cpu_checkpointing": True, "nvme_path": swap, "nvme_window": 2}
        dckpt.configure(deepspeed_config={"activation_checkpointing": section})
        ckpt = dckpt.checkpoint
    else:
        ckpt = None

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))
        for _ in range(depth)
    ).to(device)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-4)
    # requires grad: a reentrant checkpoint (DeepSpeed's) of an input without grad would cut the graph
    x0 = torch.randn(tokens, dim, device=device, requires_grad=True)
    libc = ctypes.CDLL("libc.so.6")

    def step() -> None:
        x = x0
        for b in blocks:
            x = x + (ckpt(b, x) if ckpt is not None else b(x))  # (tokens, dim)
        x.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()  # warm-up: allocator, lazy init
    times, peaks = [], []
    for _ in range(steps):
        libc.malloc_trim(0)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with _Peak() as p:
            base_rss = _rss()
            step()
            if cuda:
                torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated() - base) if cuda else (p.peak - base_rss))
    if variant.startswith("dstrain"):
        import dstrain.checkpointing as dckpt

        dckpt.reset()
    if swap is not None:
        os.rmdir(swap)
    return {
        "variant": variant,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_bytes": int(statistics.median(peaks)),
        "peak_bytes_all": peaks,
        "memory": "cuda max_memory_allocated" if cuda else "peak RSS growth",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="dim 256, 512 tokens, depth 8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--label", default="", help="result file label (e.g. under-load)")
    ap.add_argument("--ds-python", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.small:
        a.dim, a.tokens, a.depth = 256, 512, 8
    if a.worker:
        print(json.dumps(worker(a.worker, a.dim, a.tokens, a.depth, a.steps)))
        return

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._common import deepspeed_python, machine, write_labelled_result

    rows = []
    for variant in a.variants.split(","):
        py = sys.executable
        env = dict(os.environ)
        if variant == "deepspeed":
            py = deepspeed_python(a.ds_python)
            if py is None:
                continue
            env.setdefault("DS_ACCELERATOR", "cpu")
            venv = os.path.dirname(os.path.dirname(py))
            env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(venv, "torch_extensions"))
        cmd = [
            py,
            os.path.abspath(__file__),
            "--worker",
            variant,
            "--dim",
            str(a.dim),
            "--tokens",
            str(a.tokens),
        ]
        cmd += ["--depth", str(a.depth), "--steps", str(a.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"{variant} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    meta = machine()
    meta["load"] = f"{os.getloadavg()[0]:.1f}"
    meta["shape"] = {"dim": a.dim, "tokens": a.tokens, "depth": a.depth, "steps": a.steps}
    none = next((r for r in rows if r["variant"] == "none"), None)
    lines = [
        f"# Activation checkpointing: peak memory and step time ({meta['date']}, load {meta['load']})",
        "",
        f"{a.depth} residual MLP blocks (dim {a.dim}, 4x hidden, dropout 0.1), input ({a.tokens}, {a.dim}) fp32, "
        f"SGD; median of {a.steps} steps after a warm-up. Memory: {rows[0]['memory'] if rows else '?'}.",
        "",
        "| variant | step (s) | peak memory (MiB) | memory vs none | step vs none |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        rel_m = f"{r['peak_bytes'] / none['peak_bytes']:.2f}" if none and none["peak_bytes"] else "-"
        rel_t = f"{r['step_s'] / none['step_s']:.2f}" if none else "-"
        lines.append(
            f"| {r['variant']} | {r['step_s']:.3f} | {r['peak_bytes'] / 2**20:.1f} | {rel_m} | {rel_t} |"
        )
    lines.append("")
    write_labelled_result("activation-checkpointing", a.label, meta, "\n".join(lines) + "\n", {"rows": rows})


if __name__ == "__main__":
    main()
