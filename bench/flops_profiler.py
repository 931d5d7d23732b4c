"""Flops profiler totals: dstrain's (torch.utils.flop_counter) vs DeepSpeed's get_model_profile, same models.

Two models, forward only, batch of random fp32 inputs: an MLP (Linear / GELU / Linear blocks: matmuls
dominate, both profilers should agree on them exactly) and a small transformer (LayerNorm, attention by
explicit matmuls + softmax, MLP). DeepSpeed counts elementwise ops (GELU, softmax, LayerNorm, adds) as
FLOPs too; torch's counter counts only matmul-class ops, so its totals are lower by those. Per-module
MACs of every Linear are compared as well. DeepSpeed runs in its venv (``DSIO_DEEPSPEED_VENV``).

    python bench/flops_profiler.py [--label quiet]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        b, t, c = x.shape
        q, k, v = (
            self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        )  # (B, h, T, c/h)
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / (c // self.heads) ** 0.5, dim=-1)
        return self.proj(torch.matmul(att, v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(
        *[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(4)]
    )
    gpt = nn.Sequential(*[Block(256, 8) for _ in range(4)])
    return {"mlp": (mlp, (32, 512)), "transformer": (gpt, (4, 128, 256))}


def measure(which: str) -> dict:
    """Totals and per-Linear MACs of one profiler (runs in the venv that has it)."""
    out = {}
    for name, (model, shape) in models().items():
        if which == "deepspeed":
            from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile

            flops, macs, params = get_model_profile(
                model, input_shape=shape, print_profile=False, as_string=False
            )
            prof = FlopsProfiler(model)
            prof.start_profile()
            with torch.no_grad():
                model(torch.randn(shape))
            linear = {n: int(m.__macs__) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
            prof.end_profile()
        else:
            from dstrain.profiling import FlopsProfiler, get_model_profile

            flops, macs, params = get_model_profile(
                model, input_shape=shape, print_profile=False, as_string=False
            )
            prof = FlopsProfiler(model)
            prof.start_profile()
            with torch.no_grad():
                model(torch.randn(shape))
            prof.stop_profile()
            nodes = {}
            stack = [prof.tree()]
            while stack:
                n = stack.pop()
                nodes[n.name] = n
                stack.extend(n.children)
            linear = {n: nodes[n].macs for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        out[name] = {"flops": int(flops), "macs": int(macs), "params": int(params), "linear_macs": linear}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="")
    ap.add_argument("--ds-python", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(measure(a.worker)))
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._common import deepspeed_python, machine, write_labelled_result

    ours = measure("dstrain")
    theirs = None
    py = deepspeed_python(a.ds_python)
    if py is not None:
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        env.setdefault(
            "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(py)), "torch_extensions")
        )
        res = subprocess.run(
            [py, os.path.abspath(__file__), "--worker", "deepspeed"], capture_output=True, text=True, env=env
        )
        if res.returncode == 0:
            theirs = json.loads(res.stdout.strip().splitlines()[-1])
        else:
            print(res.stderr[-3000:], file=sys.stderr)
    meta = machine()
    lines = [f"# Flops profiler totals: dstrain vs DeepSpeed ({meta['date']})", "",
             "Forward of each model on one random fp32 batch (counts do not depend on load).", "",
             "| model | dstrain FLOPs | DeepSpeed FLOPs | ratio | dstrain MACs | DeepSpeed MACs | params equal | Linear MACs equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, o in ours.items():
        t = (theirs or {}).get(name)
        if t is None:
            lines.append(f"| {name} | {o['flops']:,} | - | - | {o['macs']:,} | - | - | - |")
            continue
        same = all(o["linear_macs"][k] == t["linear_macs"][k] for k in o["linear_macs"])
        lines.append(
            f"| {name} | {o['flops']:,} | {t['flops']:,} | {o['flops'] / t['flops']:.3f} | {o['macs']:,} | "
            f"{t['macs']:,} | {o['params'] == t['params']} | {same} ({len(o['linear_macs'])} layers) |"
        )
    lines += ["", "DeepSpeed counts elementwise ops (GELU, softmax, LayerNorm, residual adds, bias adds) as FLOPs; "
              "torch.utils.flop_counter counts matmul-class ops only, which is where a ratio below 1 comes from.", ""]  # fmt: skip
    write_labelled_result(
        "flops-profiler", a.label, meta, "\n".join(lines), {"dstrain": ours, "deepspeed": theirs}
    )


if __name__ == "__main__":
    main()
