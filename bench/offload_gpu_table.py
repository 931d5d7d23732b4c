"""The issue-32 table of a bench/offload_gpu_h200.sh run: dstrain vs DeepSpeed on one GPU, side by side.

    python bench/offload_gpu_table.py DIR [--commit SHA] [--out bench/results/offload-gpu-h200-<date>.md]

DIR holds what the device call brought back: runs.jsonl (one line per run: ``name`` dstrain-<mode> or
deepspeed-<mode> with the run's JSON under ``data``, or a skipped run; one line per disk probe), or the
older layout: dstrain-<mode>.json (bench/offload_gpu.py), deepspeed-<mode>.json
(bench/baselines/deepspeed_offload_gpu.py) and probes.jsonl. Modes: ``both`` (parameters + optimizer
state on NVMe), ``cpu`` (optimizer state on the CPU), ``optimizer`` (optimizer state on NVMe), ``big``
(dstrain alone, the largest model the disk holds).

Rendered per run: tokens/s and the ratio to DeepSpeed's in the same mode, median step, GPU peak over the
training steps in GiB and bytes per parameter (and over the whole run, the fp32 model before
``initialize`` included), host peak, swap GB/s, where dstrain keeps the fp32 master and gradients; then
the targets of issue 32 with their verdicts: dstrain >= 1.5x DeepSpeed's tokens/s with a lower GPU peak
(training steps), GPU bytes per parameter at most DeepSpeed's, and, for the NVMe modes, dstrain's swap
GB/s and step against the disk's own GB/s measured in the same call (the median of its probes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # (run as a script: bench.gpu_memory below)
    sys.path.insert(0, str(ROOT))

MODES = {
    "both": "parameters + optimizer state on NVMe",
    "cpu": "optimizer state on the CPU (ZeRO-Offload)",
    "optimizer": "optimizer state on NVMe, parameters on the GPU",
    "big": "parameters + optimizer state on NVMe, the largest model the disk holds (dstrain alone)",
}
IMPLS = ("dstrain", "deepspeed")
SPEEDUP_TARGET = 1.5
FLOOR_TARGET = 1.1  # issue 32: step <= 1.1x the I/O floor where the floor is above compute


def load(d: Path) -> dict[str, Any]:
    """``{"<impl>-<mode>": run, "probes": [...], "skipped": {name: why}, "meta": dstrain's meta}``; a
    dstrain run is its ``result`` (with ``sizing`` from its meta), a DeepSpeed run its JSON."""
    out: dict[str, Any] = {"probes": [], "skipped": {}, "meta": {}}
    runs = d / "runs.jsonl"
    if runs.exists():
        for line in runs.read_text().splitlines():
            if not line.strip():
                continue
            x = json.loads(line)
            if x["name"] == "probe":
                out["probes"].append(x)
            elif "skipped" in x:
                out["skipped"][x["name"]] = x["skipped"]
            else:
                out[x["name"]] = _run(x["name"], x["data"], out)
        return out
    for impl in IMPLS:
        for mode in MODES:
            f = d / f"{impl}-{mode}.json"
            if f.exists():
                out[f"{impl}-{mode}"] = _run(f"{impl}-{mode}", json.loads(f.read_text()), out)
    if (d / "probes.jsonl").exists():
        out["probes"] = [json.loads(x) for x in (d / "probes.jsonl").read_text().splitlines() if x.strip()]
    return out


def _run(name: str, raw: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    if not name.startswith("dstrain") or "result" not in raw:
        return raw  # DeepSpeed's JSON, or the driver's record of a run that wrote none
    r = dict(raw["result"])
    meta = raw.get("meta", {})
    if not out["meta"] or (out["meta"].get("sizing") and not meta.get("sizing")):
        out["meta"] = meta  # the header describes the 1.07B GPT: a big run's sizing only if alone
    if meta.get("sizing"):
        r["sizing"] = meta["sizing"]
    if "params" in r and "gpu_peak_gib" in r:  # (older runs: bytes/param from the peak)
        r.setdefault("gpu_bytes_per_param", r["gpu_peak_gib"] * 2**30 / r["params"])
    return r


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and "error" not in r and bool(r.get("tokens_per_s"))


def _ratio(data: dict[str, Any], mode: str) -> float | None:
    a, b = data.get(f"dstrain-{mode}"), data.get(f"deepspeed-{mode}")
    if not _ok(a) or not _ok(b):
        return None
    assert a is not None and b is not None
    return float(a["tokens_per_s"]) / float(b["tokens_per_s"])


def _steps(r: dict[str, Any]) -> str:
    s = r.get("steps_s") or []
    return f" after {len(s)} steps ({', '.join(f'{t:.1f}' for t in s)} s)" if s else ""


HEADER = (
    "| method | tokens/s | vs DeepSpeed | step s (median) | timed steps | swap read / write GB/s | "
    "disk read / write GB/s | "
    "GPU peak GiB, steps (B/param) | GPU peak GiB, whole run | host peak GiB | fp32 master / gradients | note |"
)


def row(name: str, r: dict[str, Any] | None, warmup: int, ratio: float | None, skipped: str = "") -> str:
    nan = float("nan")
    blank = " |" * (HEADER.count("|") - 2)  # (the cells after the second)
    if r is None:
        return f"| {name} | {'skipped: ' + skipped if skipped else 'not run'}{blank}"
    if "error" in r:
        return f"| {name} | **failed**{_steps(r)}: `{r['error'][:200]}`{blank}"
    tps = r.get("tokens_per_s")
    rd, wr = r.get("swap_read_gbps"), r.get("swap_write_gbps")
    pl = r.get("placement")
    where = f"{pl['master']} / {pl['grads']}" if pl else ""
    run_peak = r.get("gpu_peak_run_gib")
    brd, bwr = r.get("block_read_gbps"), r.get("block_write_gbps")
    block = f"{brd:.2f} / {bwr:.2f}" if brd is not None and bwr is not None else ""
    gpu = f"{r['gpu_peak_gib']:.1f} ({r.get('gpu_bytes_per_param', nan):.2f})" if "gpu_peak_gib" in r else ""
    return (
        f"| {name} | {tps:,.0f} | {f'{ratio:.2f}x' if ratio is not None else ''} | "
        f"{_med(r['steps_s'][warmup:]):.2f} | {r.get('timed_steps')} | {(rd or 0):.2f} / {(wr or 0):.2f} | {block} | "
        f"{gpu} | "
        f"{'' if run_peak is None else f'{run_peak:.1f}'} | {r.get('host_peak_mib', nan) / 1024:.1f} | {where} | "
        f"{r.get('stopped') or ''} |"
    )


def _disk(probes: list[dict[str, Any]]) -> tuple[float, float] | None:
    if not probes:
        return None
    return _med([p["read_gbps"] for p in probes]), _med([p["write_gbps"] for p in probes])


def _vs_disk(r: dict[str, Any], probes: list[dict[str, Any]], warmup: int) -> str:
    """dstrain's swap GB/s and median step against the disk's own GB/s (the call's probes, median)."""
    disk = _disk(probes)
    swap = r.get("swap_bytes") or {}
    k = max(1, int(r.get("timed_steps") or 0))
    if disk is None or not swap:
        return "swap vs the disk: not measured (no probe or nothing swapped)"
    rd = sum(v for n, v in swap.items() if n.endswith("_read_bytes")) / k
    wr = sum(v for n, v in swap.items() if n.endswith("_written_bytes")) / k
    floor = rd / (disk[0] * 1e9) + wr / (disk[1] * 1e9)
    step = _med(r["steps_s"][warmup:])
    ratio = step / floor if floor > 0 else float("inf")
    return (
        f"swap read {r.get('swap_read_gbps') or 0:.2f} / write {r.get('swap_write_gbps') or 0:.2f} GB/s against "
        f"the disk's {disk[0]:.2f} / {disk[1]:.2f} GB/s (probes' median); per step {rd / 1e9:.2f} GB read + "
        f"{wr / 1e9:.2f} GB written = an I/O floor of {floor:.2f} s (reads and writes taking turns); step "
        f"{step:.2f} s = {ratio:.2f}x it (target <= {FLOOR_TARGET}x: {'met' if ratio <= FLOOR_TARGET else 'MISSED'})"
    )


def targets(data: dict[str, Any], warmup: int = 1) -> list[str]:
    lines = []
    for mode, what in MODES.items():
        a, b = data.get(f"dstrain-{mode}"), data.get(f"deepspeed-{mode}")
        if mode == "big":
            if _ok(a):
                assert a is not None
                lines.append(
                    f"- {what}: {a['params'] / 1e9:.2f}B parameters ({a.get('sizing') or 'as asked'}), "
                    f"{a['tokens_per_s']:,.0f} tokens/s; {_vs_disk(a, data['probes'], warmup)}"
                )
            else:
                lines.append(f"- {what}: not measured ({_why(a, data, 'dstrain-big')})")
            continue
        if not _ok(a) or not _ok(b):
            lines.append(
                f"- {what}: no side-by-side (dstrain: {_why(a, data, f'dstrain-{mode}')}; "
                f"DeepSpeed: {_why(b, data, f'deepspeed-{mode}')})"
            )
        else:
            assert a is not None and b is not None
            ratio = a["tokens_per_s"] / b["tokens_per_s"]
            text = (
                f"- {what}: dstrain {ratio:.2f}x DeepSpeed's tokens/s (target >= {SPEEDUP_TARGET}x: "
                f"{'met' if ratio >= SPEEDUP_TARGET else 'MISSED'}); "
            )
            if "gpu_peak_gib" in a and "gpu_peak_gib" in b:
                lower = a["gpu_peak_gib"] < b["gpu_peak_gib"]
                per = a["gpu_bytes_per_param"] <= b["gpu_bytes_per_param"]
                text += (
                    f"GPU peak over the steps {a['gpu_peak_gib']:.1f} vs {b['gpu_peak_gib']:.1f} GiB "
                    f"({'lower: met' if lower else 'NOT lower: MISSED'}), {a['gpu_bytes_per_param']:.2f} vs "
                    f"{b['gpu_bytes_per_param']:.2f} B/param (at most DeepSpeed's: {'met' if per else 'MISSED'})"
                )
            else:
                text += "GPU peak not measured (a run off the GPU)"
            lines.append(text + "; " + _losses(a, b))
        if mode in ("both", "optimizer") and _ok(a):
            assert a is not None
            lines.append(f"  - dstrain {mode}: {_vs_disk(a, data['probes'], warmup)}")
    return lines


def _losses(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How far apart the two runs' losses are, step by step (same model, same data, same seed)."""
    pairs = list(zip(a.get("losses") or [], b.get("losses") or [], strict=False))
    if not pairs:
        return "losses not recorded"
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)
    return f"losses of the {len(pairs)} steps within {worst:.1e} relative of each other"


def _why(r: dict[str, Any] | None, data: dict[str, Any], name: str) -> str:
    if r is None:
        why = data["skipped"].get(name)
        return f"skipped, {why}" if why else "not run"
    if "error" in r:
        return f"failed{_steps(r)}: {r['error'][:160]}"
    if _ok(r):
        return f"{r['tokens_per_s']:,.0f} tokens/s"
    return "no timed step"


def render(data: dict[str, Any], commit: str, warmup: int = 1) -> str:
    any_run: dict[str, Any] = next(
        (v for k, v in data.items() if k.endswith(tuple(m for m in MODES if m != "big")) and "params" in v),
        {},
    )
    params = any_run.get("params", 0)
    meta = data["meta"]
    a = meta.get("args") or {"layers": 20, "dim": 2048, "heads": 16, "vocab": 32000, "seq": 1024, "batch": 4}
    where = f"{meta.get('gpu', 'H200')}, {meta.get('cpus', '?')} CPUs" if meta else "one H200"
    lines = [
        f"# dstrain vs DeepSpeed 0.19.8 on {where}, {datetime.date.today()} (code at {commit})",
        "",
        f"GPT of bench/train.py, {params / 1e6:,.1f}M parameters ({a['layers']} layers, d={a['dim']}, "
        f"{a['heads']} heads, vocab {a['vocab']}, seq {a['seq']}), micro batch {a['batch']}, bf16, ZeRO-3, AdamW; "
        "one device call (bench/offload_gpu_h200.sh), methods interleaved (dstrain then DeepSpeed per mode), "
        "one run each, both models built on the training device. Swap GB/s: dstrain's swap counters, "
        "DeepSpeed's process I/O bytes (/proc/self/io); disk GB/s: the swap folder's block device's own "
        "counters (/sys/dev/block/M:m/stat; nothing else runs meanwhile); all over the timed steps' wall time "
        "(dstrain's state reads run ahead of the steps, so up to one step's worth of them can fall before the "
        "window: reads per step, and the I/O floor from them, can be low by that much; writes are exact). "
        "GPU peak over the steps: torch's peak allocated bytes after `initialize` (reset there); whole run: "
        "with the fp32 model placed before `initialize` partitions it.",
        "",
        HEADER,
        "|" + " --- |" * (HEADER.count("|") - 1),
    ]
    for mode, what in MODES.items():
        lines.append(f"| *{what}* |" + " |" * (HEADER.count("|") - 2))
        for impl in IMPLS if mode != "big" else ("dstrain",):
            name = f"{impl}-{mode}"
            ratio = _ratio(data, mode) if impl == "dstrain" else None
            lines.append(row(f"{impl} {mode}", data.get(name), warmup, ratio, data["skipped"].get(name, "")))
    lines += [
        "",
        "Disk alone in the same call (dsio, O_DIRECT, fresh file, fsync'ed; before the first pair and after each):",
        "",
    ]
    for p in data["probes"]:
        size = f" ({p['bytes'] / 2**30:g} GiB)" if "bytes" in p else ""
        lines.append(
            f"- probe {p['at']}: write {p['write_gbps']:.2f} GB/s, read {p['read_gbps']:.2f} GB/s{size}"
        )
    from bench.gpu_memory import memory_lines

    for mode, what in MODES.items():  # where dstrain's GPU bytes are at the peak (bench/gpu_memory.py)
        r = data.get(f"dstrain-{mode}")
        if isinstance(r, dict) and r.get("gpu_memory") and r.get("params"):
            lines += [
                "",
                f"GPU memory, dstrain {mode} ({what}):",
                *memory_lines(r["gpu_memory"], r["params"]),
            ]
    lines += ["", "Targets (issue 32):", "", *targets(data, warmup)]
    failed = [(k, v) for k, v in data.items() if isinstance(v, dict) and "traceback" in v]
    for name, r in failed:  # (DeepSpeed's runs keep their traceback: its last lines say where)
        tail = [x for x in r["traceback"].splitlines() if x.strip()][-8:]
        lines += ["", f"Traceback of {name} (last lines):", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--commit", default="?")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--json", default=None, help="also the loaded runs as JSON (README's offload-gpu block reads it)"
    )
    a = p.parse_args(argv)
    data = load(Path(a.dir))
    text = render(data, a.commit, a.warmup)
    if a.json:
        Path(a.json).write_text(json.dumps({"commit": a.commit, "data": data}, indent=1, default=str))
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
