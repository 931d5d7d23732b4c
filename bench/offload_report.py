"""Summary, markdown report, issue-11 target lines and the PNG of the offload benchmark."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from bench.offload_methods import METHODS, SHAPES, expected_bytes

__all__ = ["loss_agreement", "plot", "render", "summarize", "targets"]

Triple = tuple[float, float, float]

KINDS = {"param": "gathers", "optimizer": "optimizer", "grad": "gradients"}
"""Prefetch counters by kind (bench/offload_worker.py) and how the report names them: the gathers'
shard reads, the optimizer's sub-group reads (state, master and gradient ranges), gradient ranges."""


def _med(values: list[float]) -> Triple:
    return statistics.median(values), min(values), max(values)


def _fmt(t: Triple | None, spec: str) -> str:
    return "" if t is None else f"{t[0]:{spec}} [{t[1]:{spec}}-{t[2]:{spec}}]"


_EXC = re.compile(r"\b(?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b: ")


def _error_line(text: str) -> str:
    """The most telling line of a failed run's output: the first exception a rank raised (not the
    launcher's ChildFailedError), else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    found = [ln for ln in lines if _EXC.search(ln) and "ChildFailedError" not in ln]
    ranked = [ln for ln in found if ln.startswith("[rank")]
    pick = (ranked or found or lines[-1:] or ["?"])[0]
    return pick.split("]: ", 1)[-1][:240] if pick.startswith("[rank") else pick[:240]


def _rank_sum(ranks: list[dict[str, Any]], key: str) -> float:
    return sum(float(x.get(key, 0.0)) for x in ranks)


def summarize(runs: list[dict[str, Any]], probes: list[dict[str, Any]]) -> dict[str, Any]:
    """{"disk": {...}, "shapes": {shape: {method: row}}} from the raw runs and disk probes."""
    out: dict[str, Any] = {"shapes": {}}
    reads = [p["read_gbps"] for p in probes if "read_gbps" in p]
    writes = [p["write_gbps"] for p in probes if "write_gbps" in p]
    disk = {"read_gbps": _med(reads), "write_gbps": _med(writes)} if reads and writes else None
    if disk:
        out["disk"] = disk
    order = list(dict.fromkeys((r["shape"], r["method"]) for r in runs))
    for shape, method in order:
        rows = out["shapes"].setdefault(shape, {})
        mine = [r for r in runs if r["shape"] == shape and r["method"] == method]
        ok = [r for r in mine if "ranks" in r]
        if not ok:
            rows[method] = {"error": _error_line(mine[-1].get("error", "not run"))}
            continue
        params = ok[0]["ranks"][0]["params"]
        steps = [max(x["median_step_s"] for x in r["ranks"]) for r in ok]  # the slower rank sets the pace
        row: dict[str, Any] = {
            "reps": len(ok),
            "failed_reps": len(mine) - len(ok),
            "params": params,
            "step_s": _med(steps),
            "peak_rss_mib": _med([max(x["peak_rss_mib"] for x in r["ranks"]) for r in ok]),
            "peak_rss_mib_per_rank": [
                statistics.median(r["ranks"][i]["peak_rss_mib"] for r in ok)
                for i in range(len(ok[0]["ranks"]))
            ],
        }
        r0 = ok[0]["ranks"][0]
        # dstrain put the gradients on NVMe too (offload_pinned_bytes below the gradient shards)
        grads = any(k.startswith("grad_") for k in r0)
        expected, formula = expected_bytes(
            METHODS[method], params, world=len(ok[0]["ranks"]), grads_on_nvme=grads
        )
        row["expected_bytes_per_step"] = sum(expected.values())
        row["formula"] = formula
        swap_keys = sorted(k for k in r0 if k.endswith("_bytes_per_step") and not k.startswith("disk_"))
        if swap_keys:  # dstrain's own counters, by kind and direction
            row["swap_bytes_per_step"] = {
                k.removesuffix("_bytes_per_step"): statistics.median(_rank_sum(r["ranks"], k) for r in ok)
                for k in swap_keys
            }
            row["stall_fraction"] = _med(
                [max(x["stall_s_per_step"] / x["median_step_s"] for x in r["ranks"]) for r in ok]
            )
            row["stall_s_per_step"] = statistics.median(
                max(x["stall_s_per_step"] for x in r["ranks"]) for r in ok
            )
            hits = sum(x["hits"] for r in ok for x in r["ranks"])
            misses = sum(x["misses"] for r in ok for x in r["ranks"])
            row["prefetch_hit_rate"] = hits / (hits + misses) if hits + misses else None
            by_kind: dict[str, float] = {}
            for kind in KINDS:
                h = sum(x.get(f"hits_{kind}", 0) for r in ok for x in r["ranks"])
                n = h + sum(x.get(f"misses_{kind}", 0) for r in ok for x in r["ranks"])
                if n:
                    by_kind[kind] = h / n
            row["prefetch_hit_rate_by_kind"] = by_kind
            row["stall_s_per_step_by_kind"] = {
                kind: statistics.median(
                    max(x.get(f"stall_s_{kind}_per_step", 0.0) for x in r["ranks"]) for r in ok
                )
                for kind in KINDS
                if f"stall_s_{kind}_per_step" in r0
            }
            # of the optimizer's sub-group steps (a run recorded before the counters were split by
            # kind: of every prefetch, gathers included, which understated it)
            early = sum(x.get("stepped_in_backward", 0) for r in ok for x in r["ranks"])
            steps = sum(
                x.get("hits_optimizer", 0) + x.get("misses_optimizer", 0) for r in ok for x in r["ranks"]
            )
            steps = steps or hits + misses
            row["stepped_in_backward"] = early / steps if steps else None
            row["pinned_bytes"] = max(x["pinned_bytes"] for x in ok[0]["ranks"])
        if "disk_read_bytes_per_step" in r0:
            row["disk_bytes_per_step"] = {
                "read": statistics.median(_rank_sum(r["ranks"], "disk_read_bytes_per_step") for r in ok),
                "written": statistics.median(
                    _rank_sum(r["ranks"], "disk_written_bytes_per_step") for r in ok
                ),
            }
        if "swap_file_bytes_total" in r0:
            row["swap_file_bytes_total"] = r0["swap_file_bytes_total"]
        if disk and METHODS[method].swaps:
            rd, wr = _io_bytes(row)
            row["io_floor_s"] = rd / (disk["read_gbps"][0] * 1e9) + wr / (disk["write_gbps"][0] * 1e9)
        rows[method] = row
    return out


def _io_bytes(row: dict[str, Any]) -> tuple[float, float]:
    """(read, written) bytes per step through the disk, all ranks: dstrain's counters, else the
    process's storage counters (/proc/<pid>/io), else the formula split evenly."""
    swap = row.get("swap_bytes_per_step")
    if swap:
        rd = sum(v for k, v in swap.items() if k.endswith("_read"))
        return rd, sum(v for k, v in swap.items() if k.endswith("_written"))
    disk = row.get("disk_bytes_per_step")
    if disk and disk["read"] + disk["written"] > 0:
        return disk["read"], disk["written"]
    half = row["expected_bytes_per_step"] / 2
    return half, half


def _mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB"


def render(meta: dict[str, Any], summary: dict[str, Any]) -> str:
    """The markdown report of one run of bench/offload.py."""
    disk = summary.get("disk")
    loads = meta.get("loadavg", [])
    load_txt = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"
    lines = [
        f"# Offload benchmark {meta['date']} ({meta['host']}){' — ' + meta['label'] if meta.get('label') else ''}",
        "",
    ]
    if meta.get("under_load"):
        lines += [
            f"**Run under load**: the 1-minute load average between runs was {load_txt} on {meta['cpus']} CPUs "
            "(other jobs shared the machine). Judge by the ratios within this run; re-run on a quiet machine "
            "for numbers to quote.",
            "",
        ]
    else:
        lines += [f"Load average between runs: {load_txt} on {meta['cpus']} CPUs.", ""]
    lines += [
        f"ZeRO-3, fp32, AdamW, world 2 (gloo, one thread per rank), same config, seed and data for dstrain and "
        f"DeepSpeed; {meta['reps']} reps, methods interleaved rep by rep (each run in fresh torchrun processes), a "
        "dsio disk probe between reps; medians with [min-max] over reps. Step time: the slower rank's median over "
        "the timed steps (two warm-up steps first). Peak RSS: VmHWM reset after warm-up, max over ranks.",
    ]
    if disk:
        lines += [
            "",
            f"Disk in the same run (dsio, {meta['probe_mib']} MiB fresh file, O_DIRECT): write "
            f"{_fmt(disk['write_gbps'], '.2f')} GB/s, read {_fmt(disk['read_gbps'], '.2f')} GB/s.",
        ]
    for shape, rows in summary["shapes"].items():
        params = next((r["params"] for r in rows.values() if "params" in r), 0)
        sh = SHAPES[shape].tiny() if meta.get("tiny") else SHAPES[shape]
        steps = meta.get("steps") or sh.steps
        lines += [
            "",
            f"## {shape}: {sh.describe(params)}",
            "",
            f"sub_group_size {sh.sub_group:,}, {steps} steps per run ({max(steps - 2, 1)} timed), dstrain's "
            f"pinned budget {(meta.get('pinned') or sh.pinned) / 2**20:.0f} MiB per rank"
            + (
                f" ({sh.paramopt_pinned / 2**20:.0f} MiB with parameters and optimizer state on NVMe: "
                f"{sh.paramopt_note})."
                if sh.paramopt_pinned and not meta.get("pinned")
                else "."
            ),
            "",
            "| method | step s | peak RSS MiB (max rank) | swapped per step, measured (both ranks) | expected | "
            "I/O floor s | stall fraction | prefetch hits | stepped in backward |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m, row in rows.items():
            if "error" in row:
                lines.append(f"| {m} | failed: `{row['error']}` | | | | | | | |")
                continue
            swap = row.get("swap_bytes_per_step")
            if swap:
                measured = ", ".join(f"{k.replace('_', ' ')} {_mb(v)}" for k, v in swap.items())
            elif METHODS[m].swaps and row.get("disk_bytes_per_step"):
                d = row["disk_bytes_per_step"]
                measured = f"disk read {_mb(d['read'])}, written {_mb(d['written'])} (/proc/pid/io)"
            else:
                measured = ""
            expected = _mb(row["expected_bytes_per_step"]) if row["expected_bytes_per_step"] else ""
            floor = f"{row['io_floor_s']:.3f}" if "io_floor_s" in row else ""
            hit = _hits(row)
            early = row.get("stepped_in_backward")
            lines.append(
                f"| {m} | {_fmt(row['step_s'], '.3f')} | {_fmt(row['peak_rss_mib'], '.0f')} | {measured} | "
                f"{expected} | {floor} | {_fmt(row.get('stall_fraction'), '.2f')} | "
                f"{hit} | {'' if early is None else f'{early:.0%}'} |"
            )
        for m, row in rows.items():
            d = row.get("disk_bytes_per_step")
            if METHODS[m].impl == "deepspeed" and METHODS[m].swaps and d and d["read"] + d["written"] == 0:
                lines += [
                    "",
                    f"{m}: its processes moved 0 bytes through the disk in the timed steps (swap files at the end: "
                    f"{row.get('swap_file_bytes_total', 0):,} bytes); its I/O floor uses the formula.",
                ]
        formulas = [f"- {m}: {row['formula']}" for m, row in rows.items() if row.get("formula")]
        if formulas:
            lines += [
                "",
                "Expected bytes per step (fp32; each rank holds P/2 of every tensor):",
                "",
                *formulas,
            ]
        lines += ["", "Targets (issues 11 and 32):", "", *targets(summary, shape)]
        agreement = loss_agreement(meta.get("runs", []), shape)
        if agreement:
            lines += [
                "",
                "Loss agreement, dstrain vs DeepSpeed (rank 0, same model, seed and data):",
                "",
                *agreement,
            ]
    lines += [
        "",
        "DeepSpeed's parameter offload is not measured: at fp32 on NVMe it rounds the weights to bf16 at initialize "
        "(anchors/ds_param_nvme_rounding.py), below max_in_cpu (1e9 parameters) it keeps them in memory without "
        "saying so, and with max_in_cpu 0 its prefetcher asserts; the dstrain param rows have no DeepSpeed twin.",
    ]
    return "\n".join(lines) + "\n"


def targets(summary: dict[str, Any], shape: str) -> list[str]:
    """The three issue-11 target lines of one shape, each met / MISSED, with the limiting resource when missed."""
    rows = summary["shapes"].get(shape, {})
    disk = summary.get("disk")

    def get(m: str) -> dict[str, Any] | None:
        r = rows.get(m)
        return r if r and "step_s" in r else None

    dn, dc, sn, sc = get("dstrain-nvme"), get("dstrain-cpu"), get("deepspeed-nvme"), get("deepspeed-cpu")
    out: list[str] = []
    if dn and sn:
        ratio = sn["step_s"][0] / dn["step_s"][0]
        rss = (dn["peak_rss_mib"][0], sn["peak_rss_mib"][0])
        ok = ratio >= 1.5 and rss[0] < rss[1]
        line = (
            f"- dstrain NVMe vs DeepSpeed NVMe: {ratio:.2f}x faster (target >= 1.5x: "
            f"{'met' if ratio >= 1.5 else 'MISSED'}); peak RSS {rss[0]:.0f} vs {rss[1]:.0f} MiB "
            f"({'lower: met' if rss[0] < rss[1] else 'NOT lower: MISSED'})"
        )
        if not ok:
            line += "; " + _nvme_limit(dn, disk)
        out.append(line)
    else:
        out.append("- dstrain NVMe vs DeepSpeed NVMe: not measured in this run")
    if dn and dc:
        ratio = dn["step_s"][0] / dc["step_s"][0]
        floor = dn.get("io_floor_s")
        below = floor is not None and floor < dc["step_s"][0]
        where = (
            f"I/O floor {floor:.3f} s {'<' if below else '>='} compute (CPU-offload step) {dc['step_s'][0]:.3f} s"
            if floor is not None
            else "I/O floor unknown (no disk probe)"
        )
        verdict = ("met" if ratio <= 1.25 else "MISSED") if below else "not applicable on this shape"
        line = f"- dstrain NVMe / dstrain CPU step: {ratio:.2f} (target <= 1.25 where the I/O floor is below compute: {verdict}; {where})"
        if below and ratio > 1.25:
            line += "; " + _nvme_limit(dn, disk)
        out.append(line)
    else:
        out.append("- dstrain NVMe / dstrain CPU step: not measured in this run")
    late = get("dstrain-nvme-late")
    if late and dc:
        line = (
            f"- the same NVMe run with every sub-group stepped after backward (step_in_backward false): "
            f"NVMe / CPU {late['step_s'][0] / dc['step_s'][0]:.2f}, stall fraction "
            f"{_fmt(late.get('stall_fraction'), '.2f')}, prefetch hits "
            f"{_hits(late)}"
        )
        if dn:
            line += (
                f" (stepping during backward: {dn['step_s'][0] / dc['step_s'][0]:.2f}, stall fraction "
                f"{_fmt(dn.get('stall_fraction'), '.2f')}, prefetch hits "
                f"{_hits(dn)})"
            )
        out.append(line)
    if dc and sc:
        ratio = sc["step_s"][0] / dc["step_s"][0]
        line = f"- dstrain CPU-offload vs DeepSpeed CPU-offload: {ratio:.2f}x (target >= 1.0: {'met' if ratio >= 1.0 else 'MISSED'})"
        if ratio < 1.0:
            line += (
                f"; dstrain CPU-offload step {dc['step_s'][0]:.3f} s vs {dc.get('stall_s_per_step', 0):.3f} s "
                "stalled: the limit is compute (Adam and the ZeRO-3 gathers on 2 shared cores)"
            )
        out.append(line)
    else:
        out.append("- dstrain CPU-offload vs DeepSpeed CPU-offload: not measured in this run")
    return out + _paramopt_targets(get("dstrain-paramopt-nvme"), dc, disk)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _hits(row: dict[str, Any]) -> str:
    """Prefetch hits by kind where more than one kind reads ahead ("gathers 41%, optimizer 100%"),
    else the one rate."""
    by_kind = row.get("prefetch_hit_rate_by_kind") or {}
    if len(by_kind) > 1:
        return ", ".join(f"{KINDS[k]} {v:.0%}" for k, v in by_kind.items())
    return _pct(row.get("prefetch_hit_rate"))


def _stalls(row: dict[str, Any]) -> str:
    """The kinds that stalled, as ' (gathers 0.120 s, optimizer 0.010 s per step)'; '' if none did."""
    by_kind = {k: v for k, v in (row.get("stall_s_per_step_by_kind") or {}).items() if v > 0}
    if not by_kind:
        return ""
    return " (" + ", ".join(f"{KINDS[k]} {v:.3f} s" for k, v in by_kind.items()) + " per step)"


def _paramopt_targets(
    po: dict[str, Any] | None, dc: dict[str, Any] | None, disk: dict[str, Any] | None
) -> list[str]:
    """Issue 32's lines for parameters + optimizer state on NVMe: its step / the CPU-offload step
    <= 1.15; stall fraction <= 0.05 where the I/O floor is below compute, else step <= 1.1x the floor."""
    if not po or not dc:
        return ["- dstrain params + optimizer NVMe / dstrain CPU step: not measured in this run"]
    step, cpu = po["step_s"][0], dc["step_s"][0]
    ratio, floor, stall = step / cpu, po.get("io_floor_s"), po.get("stall_fraction")
    overlap = (
        f"stall fraction {_fmt(stall, '.2f')}{_stalls(po)}, prefetch hits {_hits(po)}, "
        f"stepped in backward {_pct(po.get('stepped_in_backward'))} of the sub-groups"
    )
    line = (
        f"- dstrain params + optimizer NVMe / dstrain CPU step: {ratio:.2f} (target <= 1.15: "
        f"{'met' if ratio <= 1.15 else 'MISSED'}); {overlap}"
    )
    if ratio > 1.15:
        line += "; " + _nvme_limit(po, disk)
    lines = [*_paramopt_bytes(po), line]
    if floor is None or stall is None:
        return [*lines, "- params + optimizer NVMe overlap: I/O floor unknown (no disk probe)"]
    if floor < cpu:
        ok = stall[0] <= 0.05
        lines.append(
            f"- params + optimizer NVMe, I/O floor {floor:.3f} s < compute {cpu:.3f} s: stall fraction "
            f"{stall[0]:.2f} (target <= 0.05: {'met' if ok else 'MISSED'})"
        )
    else:
        ok = step <= 1.1 * floor
        lines.append(
            f"- params + optimizer NVMe, I/O floor {floor:.3f} s >= compute {cpu:.3f} s: step {step:.3f} s = "
            f"{step / floor:.2f}x the floor (target <= 1.1x: {'met' if ok else 'MISSED'})"
        )
    return lines


def _paramopt_bytes(po: dict[str, Any]) -> list[str]:
    """Parameter bytes per step (all ranks) against the formula's: the shard file read for the
    forward and backward gathers and for each master range, less the master ranges assembled from
    the backward gathers' shards (fp32: `dstrain.offload.param.swapped_master`), and written once."""
    swap = po.get("swap_bytes_per_step") or {}
    if "param_read" not in swap or not po.get("params"):
        return []
    shard = 4 * po["params"]  # fp32, every rank's shard
    read, assembled = swap["param_read"], swap.get("master_from_gathers", 0.0)
    kept = swap.get("gather_from_step", 0.0)
    reused = swap.get("gather_reused", 0.0)
    total = read + assembled + kept + reused
    return [
        f"- params + optimizer NVMe, parameter bytes per step: read {_mb(read)} + master ranges assembled "
        f"from the gathers' shards {_mb(assembled)} + the pass's first shard kept from the step {_mb(kept)} "
        f"+ backward gathers served by the buffers of their forward gather {_mb(reused)} "
        f"= {_mb(total)} = {total / shard:.2f}x "
        f"the shards (formula: fwd + bwd gathers + master = 3.00x, {_mb(3 * shard)}; a tied weight "
        f"used twice in forward is gathered once more); written {_mb(swap.get('param_written', 0.0))} = "
        f"{swap.get('param_written', 0.0) / shard:.2f}x (formula 1.00x)"
    ]


def _nvme_limit(row: dict[str, Any], disk: dict[str, Any] | None) -> str:
    """Which resource bounded dstrain's NVMe step, with numbers."""
    rd, wr = _io_bytes(row)
    step = row["step_s"][0]
    stall = row.get("stall_s_per_step", 0.0)
    parts = [f"step {step:.3f} s, of which {stall:.3f} s stalled on swap reads"]
    if disk:
        floor = row.get("io_floor_s", 0.0)
        parts.append(
            f"{_mb(rd)} read at {disk['read_gbps'][0]:.2f} GB/s + {_mb(wr)} written at {disk['write_gbps'][0]:.2f} GB/s "
            f"= I/O floor {floor:.3f} s ({floor / step:.0%} of the step)"
        )
        parts.append(
            "limit: disk" if floor >= 0.8 * step else "limit: compute / overlap (the disk had slack)"
        )
    return "; ".join(parts)


def loss_agreement(runs: list[dict[str, Any]], shape: str) -> list[str]:
    """Per-step loss of dstrain vs DeepSpeed in the same mode (same model, seed and data), rank 0, first rep."""
    out = []
    for mode in ("none", "cpu", "nvme"):
        a = next(
            (r for r in runs if r["shape"] == shape and r["method"] == f"dstrain-{mode}" and "ranks" in r),
            None,
        )
        b = next(
            (r for r in runs if r["shape"] == shape and r["method"] == f"deepspeed-{mode}" and "ranks" in r),
            None,
        )
        if a is None or b is None:
            continue
        la, lb = a["ranks"][0]["losses"], b["ranks"][0]["losses"]
        rel = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(la, lb, strict=True))
        out.append(f"- {mode}: max relative difference of per-step loss over {len(la)} steps: {rel:.2e}")
    return out


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Step-time bars (median, min-max whiskers) per method, one panel per shape; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(summary["shapes"])
    if not shapes:
        return False
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rows = {m: r for m, r in summary["shapes"][shape].items() if "step_s" in r}
        names = list(rows)
        med = [rows[m]["step_s"][0] for m in names]
        err = [
            [rows[m]["step_s"][0] - rows[m]["step_s"][1] for m in names],
            [rows[m]["step_s"][2] - rows[m]["step_s"][0] for m in names],
        ]
        colors = ["tab:blue" if m.startswith("dstrain") else "tab:orange" for m in names]
        ax.bar(names, med, yerr=err, color=colors, capsize=3)
        ax.set_title(f"{shape}: step time, s (median, min-max)")
        ax.tick_params(axis="x", rotation=45)
        for lbl in ax.get_xticklabels():
            lbl.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
