"""The issue-32 table of a bench/offload_gpu_h200.sh run: dstrain vs DeepSpeed on one GPU, side by side.

    python bench/offload_gpu_table.py DIR [--commit SHA] [--out bench/results/offload-gpu-h200-<date>.md]

DIR holds what the device call brought back: dstrain-{both,cpu}.json (bench/offload_gpu.py),
deepspeed-{both,cpu}.json (bench/baselines/deepspeed_offload_gpu.py) and probes.jsonl (the disk alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

MODES = {"both": "parameters + optimizer state on NVMe", "cpu": "optimizer state on the CPU (ZeRO-Offload)"}


def load(d: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"probes": []}
    for impl in ("dstrain", "deepspeed"):
        for mode in MODES:
            f = d / f"{impl}-{mode}.json"
            if not f.exists():
                continue
            raw = json.loads(f.read_text())
            out[f"{impl}-{mode}"] = _dstrain(raw) if impl == "dstrain" else raw
    if (d / "probes.jsonl").exists():
        out["probes"] = [json.loads(x) for x in (d / "probes.jsonl").read_text().splitlines() if x.strip()]
    return out


def _dstrain(raw: dict[str, Any]) -> dict[str, Any]:
    r = dict(raw["result"])
    if "params" in r and "gpu_peak_gib" in r:  # (older runs: bytes/param from the peak)
        r.setdefault("gpu_bytes_per_param", r["gpu_peak_gib"] * 2**30 / r["params"])
    return r


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def row(name: str, r: dict[str, Any] | None, warmup: int) -> str:
    nan = float("nan")
    if r is None:
        return f"| {name} | not run | | | | | | |"
    if "error" in r:
        return f"| {name} | **failed**: `{r['error'][:160]}` | | | | | | |"
    tps = r.get("tokens_per_s")
    rd, wr = r.get("swap_read_gbps"), r.get("swap_write_gbps")
    return (
        f"| {name} | {tps:,.0f} | {_med(r['steps_s'][warmup:]):.2f} | {r.get('timed_steps')} | "
        f"{(rd or 0):.2f} / {(wr or 0):.2f} | {r.get('gpu_peak_gib', nan):.1f} ({r.get('gpu_bytes_per_param', nan):.2f}) | "
        f"{r.get('host_peak_mib', float('nan')):,.0f} | {r.get('stopped') or ''} |"
    )


def targets(data: dict[str, Any]) -> list[str]:
    lines = []
    for mode in MODES:
        a, b = data.get(f"dstrain-{mode}"), data.get(f"deepspeed-{mode}")
        if (
            not a
            or not b
            or "error" in a
            or "error" in b
            or not a.get("tokens_per_s")
            or not b.get("tokens_per_s")
        ):
            lines.append(f"- {MODES[mode]}: no side-by-side (a run is missing or failed)")
            continue
        ratio = a["tokens_per_s"] / b["tokens_per_s"]
        lower = a["gpu_peak_gib"] < b["gpu_peak_gib"]
        lines.append(
            f"- {MODES[mode]}: dstrain {ratio:.2f}x DeepSpeed's tokens/s (target >= 1.5x: "
            f"{'met' if ratio >= 1.5 else 'MISSED'}); GPU peak {a['gpu_peak_gib']:.1f} vs "
            f"{b['gpu_peak_gib']:.1f} GiB, {a['gpu_bytes_per_param']:.2f} vs {b['gpu_bytes_per_param']:.2f} "
            f"B/param ({'lower: met' if lower else 'NOT lower: MISSED'})"
        )
    return lines


def render(data: dict[str, Any], commit: str, warmup: int = 1) -> str:
    any_run: dict[str, Any] = next((v for k, v in data.items() if k != "probes" and "params" in v), {})
    params = any_run.get("params", 0)
    lines = [
        f"# dstrain vs DeepSpeed 0.19.8 on one H200, {datetime.date.today()} (code at {commit})",
        "",
        f"GPT of bench/train.py, {params / 1e6:,.1f}M parameters (20 layers, d=2048, 16 heads, vocab 32000, "
        "seq 1024), micro batch 4, bf16, ZeRO-3, AdamW; one device call (bench/offload_gpu_h200.sh), methods "
        "interleaved (dstrain then DeepSpeed per mode), one run each. Swap GB/s: dstrain's swap counters, "
        "DeepSpeed's block-layer bytes (/proc/self/io), over the timed steps' wall time.",
        "",
        "| method | tokens/s | step s (median) | timed steps | swap read / write GB/s | GPU peak GiB (B/param) | "
        "host peak MiB | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES:
        for impl in ("dstrain", "deepspeed"):
            lines.append(row(f"{impl} {mode}", data.get(f"{impl}-{mode}"), warmup))
    lines += ["", "Disk alone in the same call (dsio, O_DIRECT, 1 GiB fresh file, fsync'ed):", ""]
    for p in data["probes"]:
        lines.append(f"- probe {p['at']}: write {p['write_gbps']:.2f} GB/s, read {p['read_gbps']:.2f} GB/s")
    lines += ["", "Targets (issue 32):", "", *targets(data)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--commit", default="?")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    text = render(load(Path(a.dir)), a.commit, a.warmup)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
