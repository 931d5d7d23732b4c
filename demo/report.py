"""The demo's results: one JSON of everything measured, a Markdown table, and a PNG.

`summarize` turns the three phases' events into numbers (all from the workers' own records and
metrics; nothing is estimated); `write_outputs` writes ``<stem>.json``, ``<stem>.md`` and ``<stem>.png``.
The plot is drawn from the JSON alone, so ``python demo/report.py <stem>.json`` redraws it.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["summarize", "write_outputs"]


def _by_step(phase: Any) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = {}
    for e in phase.of("step"):
        steps.setdefault(e["step"], []).append(e)
    return steps


def _series(phase: Any, t0: float) -> dict[str, list[float]]:
    """Per step (complete on both ranks): mean loss, and the swap rate since the previous step."""
    steps = {s: es for s, es in _by_step(phase).items() if len(es) == 2}
    out: dict[str, list[float]] = {"step": [], "loss": [], "t": [], "read_gbps": [], "write_gbps": []}
    prev: tuple[float, float, float] | None = None
    for s in sorted(steps):
        es = steps[s]
        t = max(e["t"] for e in es)  # a step lasts as long as its slowest rank
        read, written = sum(e["swap_read"] for e in es), sum(e["swap_written"] for e in es)
        out["step"].append(s)
        out["loss"].append(statistics.fmean(e["loss"] for e in es))
        out["t"].append(t - t0)
        if prev is None or t <= prev[0]:
            out["read_gbps"].append(float("nan"))
            out["write_gbps"].append(float("nan"))
        else:
            out["read_gbps"].append((read - prev[1]) / (t - prev[0]) / 1e9)
            out["write_gbps"].append((written - prev[2]) / (t - prev[0]) / 1e9)
        prev = (t, read, written)
    return out


def _throughput(phase: Any) -> dict[str, float]:
    """Tokens/s and swap GB/s between the first and the last step both ranks finished (saves included)."""
    steps = {s: es for s, es in _by_step(phase).items() if len(es) == 2}
    first, last = min(steps), max(steps)
    t_first, t_last = (max(e["t"] for e in steps[s]) for s in (first, last))
    span = t_last - t_first
    tokens = sum(e["tokens"] for s in steps if first < s <= last for e in steps[s])

    def moved(key: str) -> float:
        return sum(e[key] for e in steps[last]) - sum(e[key] for e in steps[first])

    n = last - first
    return {
        "tokens_per_s": tokens / span,
        "step_s": span / n,
        "swap_read_gbps": moved("swap_read") / span / 1e9,
        "swap_write_gbps": moved("swap_written") / span / 1e9,
        "swap_read_mb_per_step": moved("swap_read") / n / 1e6,
        "swap_write_mb_per_step": moved("swap_written") / n / 1e6,
    }


def _checkpoints(phase: Any) -> dict[str, Any]:
    per_rank = []
    for e in sorted(phase.of("summary"), key=lambda e: e["rank"]):
        c = e["checkpoint"]
        busy = c.get("dsio_checkpoint_staging_seconds_total", 0.0) + c.get(
            "dsio_checkpoint_write_seconds_total", 0.0
        )
        nbytes = c.get("dsio_checkpoint_bytes_written_total", 0.0)
        saves = c.get("dsio_checkpoint_saves_total", 0.0)
        per_rank.append(
            {
                "rank": e["rank"],
                "saves": int(saves),
                "mb_per_save": nbytes / saves / 1e6 if saves else 0.0,
                "save_gbps": nbytes / busy / 1e9 if busy else 0.0,
            }
        )
    blocked: dict[int, float] = {}
    for e in phase.of("save"):
        blocked[e["step"]] = max(blocked.get(e["step"], 0.0), e["blocked_seconds"])
    ms = sorted(v * 1e3 for v in blocked.values())
    return {
        "per_rank": per_rank,
        "blocked_ms_median": statistics.median(ms) if ms else float("nan"),
        "blocked_ms_min": ms[0] if ms else float("nan"),
        "blocked_ms_max": ms[-1] if ms else float("nan"),
        "saves": len(ms),
    }


def summarize(
    *,
    reference: Any,
    crash: Any,
    resume: Any,
    verdict: dict[str, Any],
    active: list[str],
    config: dict[str, Any],
    shape: dict[str, int],
    device: str,
    dtype: str,
    wall_seconds: float,
) -> dict[str, Any]:
    """Everything the table and the plot show, as plain JSON values."""
    t0 = min(e["t"] for e in reference.events)
    start = reference.of("start", 0)[0]
    resumed = resume.of("resumed", 0)
    phases = {}
    for ph in (reference, crash, resume):
        rss = {e["rank"]: e["peak_rss_kib"] / 1024 for e in ph.of("summary")}
        phases[ph.name] = {
            "seconds": ph.seconds,
            "returncode": ph.returncode,
            "scrapes": len(ph.scrapes),
            "metrics_urls": [ph.urls[r] for r in sorted(ph.urls)],
            "peak_rss_mib": [rss.get(r) for r in (0, 1)],
            "series": _series(ph, t0),
        }
    swapped: dict[str, float] = {}  # bytes by kind (param / optimizer), both ranks, the uninterrupted run
    for e in reference.of("summary"):
        for key, value in e.get("offload", {}).items():
            if key.startswith("dstrain_offload_swap_bytes") and "kind=" in key:
                kind = key.split("kind=", 1)[1].rstrip("}").split(",")[0]
                swapped[kind] = swapped.get(kind, 0.0) + value
    return {
        "swap_bytes_by_kind": swapped,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "device": device,
        "dtype": dtype,
        "world_size": 2,
        "params": start["params"],
        "shape": shape,
        "micro_batch": config["train_micro_batch_size_per_gpu"],
        "steps": start["steps"],
        "offloads": active,
        "wall_seconds": wall_seconds,
        "reference": {**_throughput(reference), "checkpoints": _checkpoints(reference)},
        "crash": {"killed": crash.killed, "t": (crash.killed or {}).get("t", t0) - t0},
        "resume": {
            "from_step": resumed[0]["step"] if resumed else None,
            "load_seconds": resumed[0]["seconds"] if resumed else None,
            "t": (resumed[0]["t"] - t0) if resumed else None,
        },
        "verdict": verdict,
        "phases": phases,
    }


def table(r: dict[str, Any], *, heading: bool = True) -> str:
    """The Markdown report of one demo run (``heading=False``: without its title line, as README shows it)."""
    ref, ck = r["reference"], r["reference"]["checkpoints"]
    rss = r["phases"]["reference"]["peak_rss_mib"]
    save_gbps = " / ".join(f"{x['save_gbps']:.2f}" for x in ck["per_rank"])
    mb = " / ".join(f"{x['mb_per_save']:.0f}" for x in ck["per_rank"])
    v = r["verdict"]
    killed = r["crash"]["killed"] or {}
    rows = [
        ("tokens/s (2 ranks, checkpoint stalls included)", f"{ref['tokens_per_s']:,.0f}"),
        ("step time, s", f"{ref['step_s']:.3f}"),
        (
            "swap read, GB/s (MB per step)",
            f"{ref['swap_read_gbps']:.3f} ({ref['swap_read_mb_per_step']:.0f})",
        ),
        (
            "swap written, GB/s (MB per step)",
            f"{ref['swap_write_gbps']:.3f} ({ref['swap_write_mb_per_step']:.0f})",
        ),
        ("checkpoint save, GB/s per rank (rank 0 / 1)", f"{save_gbps} ({mb} MB per save)"),
        (
            "training blocked per save, ms: median (min-max)",
            f"{ck['blocked_ms_median']:.0f} ({ck['blocked_ms_min']:.0f}-{ck['blocked_ms_max']:.0f}), {ck['saves']} saves",
        ),
        ("peak RSS per rank, MiB (rank 0 / 1)", " / ".join(f"{x:,.0f}" if x else "-" for x in rss)),
    ]
    lines = [
        *([f"# dsio/dstrain demo, {r['date']} on {r['host']} ({r['device']}, {r['dtype']})", ""] if heading else []),
        f"Byte-level GPT, {r['params'] / 1e6:.1f}M parameters ({', '.join(f'{k} {v}' for k, v in r['shape'].items())}), ZeRO-3 on {r['world_size']} ranks, "
        f"micro-batch {r['micro_batch']}, {r['steps']} steps. Offloaded: {'; '.join(r['offloads'])}.",
        "",
        "| uninterrupted run | value |",
        "| --- | --- |",
        *(f"| {k} | {val} |" for k, val in rows),
        "",
        f"Crash: rank {killed.get('rank')} SIGKILLed after its step {killed.get('step')}; resumed from the latest "
        f"committed checkpoint, step {r['resume']['from_step']} (load {r['resume']['load_seconds'] or 0:.2f} s). "
        f"Losses after the resume vs the uninterrupted run: {v['steps_compared_after_resume']} rank-steps, "
        f"{'bitwise equal' if v['bitwise_equal'] else 'MISMATCH ' + str(v['mismatches_after_resume'])} "
        f"(before the crash: {v['steps_compared_before_crash']} rank-steps, "
        f"{len(v['mismatches_before_crash'])} mismatches).",
        "",
        "Phases (s): " + ", ".join(f"{k} {p['seconds']:.1f}" for k, p in r["phases"].items())
        + f"; whole demo {r['wall_seconds']:.0f} s. Metrics scraped live "
        + ", ".join(f"{p['scrapes']}x in {k}" for k, p in r["phases"].items()) + ".",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    """Loss per step (reference, crashed, resumed; crash and resume marked) and swap GB/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ph = r["phases"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7.5))
    a.plot(ph["reference"]["series"]["step"], ph["reference"]["series"]["loss"], "-", color="0.6", lw=3,
           label="uninterrupted run")  # fmt: skip
    a.plot(ph["crash"]["series"]["step"], ph["crash"]["series"]["loss"], "o", color="tab:red", ms=4,
           label="run that crashes")  # fmt: skip
    a.plot(ph["resume"]["series"]["step"], ph["resume"]["series"]["loss"], "x", color="tab:blue", ms=6,
           label="resumed from checkpoint")  # fmt: skip
    killed = r["crash"]["killed"] or {}
    if killed:
        a.axvline(killed["step"], color="tab:red", ls="--", lw=1)
        a.annotate(f"SIGKILL rank {killed['rank']}", (killed["step"], a.get_ylim()[1]), color="tab:red",
                   ha="left", va="top", xytext=(3, -3), textcoords="offset points")  # fmt: skip
    if r["resume"]["from_step"] is not None:
        a.axvline(r["resume"]["from_step"], color="tab:blue", ls=":", lw=1)
        a.annotate(f"resume from step {r['resume']['from_step']}", (r["resume"]["from_step"], a.get_ylim()[0]),
                   color="tab:blue", ha="right", va="bottom", xytext=(-3, 3), textcoords="offset points")  # fmt: skip
    a.set_xlabel("step")
    a.set_ylabel("loss (mean of 2 ranks)")
    verdict = "bitwise equal" if r["verdict"]["bitwise_equal"] else "MISMATCH"
    a.set_title(
        f"{r['params'] / 1e6:.1f}M-param GPT, ZeRO-3 + NVMe offload, 2 ranks: resumed losses {verdict}"
    )
    a.legend(loc="upper right")
    for name, color in (("reference", "0.4"), ("crash", "tab:red"), ("resume", "tab:blue")):
        s = ph[name]["series"]
        b.plot(s["t"], s["read_gbps"], "-", color=color, label=f"{name}: read")
        b.plot(s["t"], s["write_gbps"], "--", color=color, label=f"{name}: written")
    if killed:
        b.axvline(r["crash"]["t"], color="tab:red", ls="--", lw=1)
    b.set_xlabel("seconds since the demo started")
    b.set_ylabel("swap GB/s (both ranks)")
    b.legend(loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], stem: Path, *, plot_png: bool = True) -> dict[str, str]:
    """Write ``<stem>.json``, ``<stem>.md`` and (``plot_png``) ``<stem>.png``; returns their paths."""
    stem = Path(stem)
    paths = {"json": str(stem) + ".json", "md": str(stem) + ".md"}
    Path(paths["json"]).write_text(json.dumps(result, indent=1) + "\n")
    Path(paths["md"]).write_text(table(result))
    if plot_png:
        paths["png"] = str(stem) + ".png"
        plot(result, Path(paths["png"]))
    return paths


if __name__ == "__main__":  # redraw from a result file: python demo/report.py <stem>.json
    src = Path(sys.argv[1])
    res = json.loads(src.read_text())
    print(write_outputs(res, src.with_suffix(""))["md"])
