"""README's measured numbers, generated from the result files they cite.

Every figure README.md quotes from a benchmark lives between markers naming its source::

    <!-- numbers:checkpoint source=bench/results/checkpoint-2026-11-30.json -->
    ...generated text...
    <!-- /numbers -->

This script re-renders each block from its source (JSON written by the benchmark, or re-derived from its
report where the run wrote none; such files say so in ``derived_from``):

    .venv/bin/python scripts/readme_numbers.py           # rewrite README.md in place
    .venv/bin/python scripts/readme_numbers.py --check   # exit 1 and show the diff when README has drifted

tests/test_readme_numbers.py runs ``--check`` and also fails when a measurement-like figure (GB/s, ops/s,
a ratio like 1.02x) appears in README outside a generated block. To cite a newer run, change the block's
``source=`` and re-run this script.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

BLOCK = re.compile(
    r"(?P<open><!-- numbers:(?P<kind>[\w-]+) source=(?P<source>\S+) -->\n)(?P<body>.*?)(?P<close><!-- /numbers -->)",
    re.S,
)
#: Figures that look measured; README may show them only inside generated blocks.
MEASURED = re.compile(
    r"\d(?:[\d,.]*\d)?\s*(?:GB/s|GiB/s|MB/s|ops/s|k?\s*(?:writes|reads)/s|us of CPU)"
    r"|\b\d+\.\d+x\b"
    r"|\b\d+(?:\.\d+)?-\d+(?:\.\d+)?\s*GB/s",
)


TABLE_FIGURE = re.compile(r"^\|.*\b\d+\.\d+\b.*\|\s*$", re.M)


def unsourced_figures(text: str) -> list[str]:
    """Measurement-like figures in ``text`` outside every generated block (each with a little context)."""
    human = outside_blocks(text)
    hits = [m for m in MEASURED.finditer(human)] + [m for m in TABLE_FIGURE.finditer(human)]
    return [human[max(0, m.start() - 40) : m.end() + 10].replace("\n", " ") for m in hits]


class NumbersError(Exception):
    """A block names an unknown kind or a source that is missing or lacks what the kind needs."""


@dataclass(frozen=True, slots=True)
class Block:
    kind: str
    source: str
    body: str
    start: int
    end: int


def blocks(text: str) -> list[Block]:
    """The generated blocks of ``text``, in order."""
    return [
        Block(m["kind"], m["source"], m["body"], m.start("body"), m.end("body")) for m in BLOCK.finditer(text)
    ]


def outside_blocks(text: str) -> str:
    """``text`` with every generated block's body removed (what a human wrote)."""
    out, pos = [], 0
    for b in blocks(text):
        out.append(text[pos : b.start])
        pos = b.end
    out.append(text[pos:])
    return "".join(out)


# -- formatting ------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs)


def mrange(xs: list[float], digits: int = 2) -> str:
    """``median (min-max)``."""
    if digits == 0:
        return f"{med(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"
    return f"{med(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def kilo(x: float) -> str:
    return f"{x / 1000:.1f}k"


def _get(d: dict[str, Any], *keys: str) -> Any:
    cur: Any = d
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            raise NumbersError(f"the source has no {'/'.join(keys)!r}")
        cur = cur[k]
    return cur


# -- renderers: one per kind -----------------------------------------------------------------------
IO_SEQ_ROWS = [
    ("dsio io_uring, locked buffer", "dsio io_uring, locked buffer"),
    ("dsio io_uring, ordinary tensor", "dsio io_uring, ordinary `torch.randn` tensor"),
    ("DeepSpeed aio_handle, locked", "DeepSpeed aio_handle, locked buffer"),
    ("DeepSpeed aio_handle, ordinary tensor", "DeepSpeed aio_handle, ordinary tensor"),
    ("fio libaio 1M QD32", "fio libaio 1M QD32"),
    ("fio io_uring 1M QD32", "fio io_uring 1M QD32"),
]


def _fio_note(meta: dict[str, Any]) -> str:
    """What fio's write jobs included; runs before the key existed used end_fsync=1 (bench/baselines/fio.py)."""
    fsync = meta.get("fio_write_fsync", True)
    return (
        "fio's write jobs (new file, overwrite and small ops) end with an fsync (`end_fsync=1`) that dsio's and "
        "DeepSpeed's overwrite and small-op figures do not include"
        if fsync
        else "fio's write jobs run without an fsync, like dsio's and DeepSpeed's overwrite and small-op figures"
    )


def _cache_note(meta: dict[str, Any]) -> str:
    for key in ("page_cache_dropped", "drop_caches", "cold_reads"):
        if key in meta:
            return (
                "page cache dropped before every read"
                if meta[key]
                else "WARM reads: the page cache could not be dropped"
            )
    return "the run's report says the page cache was dropped before every read (run as root; the file does not record the check)"


def render_io_seq(src: dict[str, Any], source: str) -> str:
    res, meta = _get(src, "results"), _get(src, "meta")
    reps = len(_get(res, IO_SEQ_ROWS[0][0], "write_new_fsync"))
    lines = [
        f"`{source}` ({meta.get('date', '?')}, host {meta.get('host', '?')}): 1 GiB sequential, GB/s, median (min-max) "
        f"of {reps} interleaved reps; {_cache_note({**meta, **({'cold_reads': src['cold']} if 'cold' in src else {})})}; "
        f"{_fio_note(meta)}.",
        "",
        "| GB/s | write new + fsync | overwrite | read |",
        "| --- | --- | --- | --- |",
    ]
    for key, label in IO_SEQ_ROWS:
        if key not in res:
            continue
        r = res[key]
        lines.append(
            f"| {label} | {mrange(r['write_new_fsync'])} | {mrange(r['overwrite'])} | {mrange(r['read'])} |"
        )
    return "\n".join(lines) + "\n"


def render_io_ops(src: dict[str, Any], source: str) -> str:
    res, meta = _get(src, "results"), _get(src, "meta")
    ours, ds, fio = (
        res["dsio io_uring (default config)"],
        res.get("DeepSpeed aio_handle", {}),
        res.get("fio libaio", {}),
    )
    n_ops = 2000
    lines = [
        f"Small operations from `{source}`: {n_ops:,} concurrent ops per rep, ops/s, median of the reps. "
        "DeepSpeed's `async_pwrite/pread(path)` + one `wait()` opens the file per op, so the headline compares "
        f"dsio's path-per-op calls with it; dsio's open-file mode is its own column. As above, {_fio_note(meta)}.",
        "",
        "| size, op | dsio, path per op | DeepSpeed, path per op | dsio / DeepSpeed | dsio, open file | fio libaio QD1 / QD32 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for size, label in (("64K", "64 KiB"), ("1024K", "1 MiB")):
        for op in ("write", "read"):
            path = med(_get(ours, f"ops_{op}_{size}_path"))
            opened = med(_get(ours, f"ops_{op}_{size}"))
            d = ds.get(f"ops_{op}_{size}")
            f1, f32 = fio.get(f"ops_{op}_{size}_qd1"), fio.get(f"ops_{op}_{size}_qd32")
            lines.append(
                f"| {label} {op} | {path:,.0f} | {f'{med(d):,.0f}' if d else '-'} | "
                f"{ratio(path, med(d)) if d else '-'} | {opened:,.0f} | "
                f"{f'{med(f1):,.0f} / {med(f32):,.0f}' if f1 and f32 else '-'} |"
            )
    return "\n".join(lines) + "\n"


def render_checkpoint(src: dict[str, Any], source: str) -> str:
    st, rows = _get(src, "state"), _get(src, "rows")
    targets = _get(src, "targets")

    def find(*words: str) -> dict[str, Any]:
        """The target whose name holds every word (the targets' bounds changed between runs: 0.9x -> 0.95x,
        10% -> 5%; a result file names the bound it was judged against)."""
        hits = [x for x in targets if all(w in x["target"] for w in words)]
        if len(hits) != 1:
            raise NumbersError(f"{source}: no single checkpoint target naming {words}")
        return hits[0]

    def val(x: dict[str, Any]) -> str:
        return f"{x['value']:.2f}x" if x["unit"] == "x" else f"{x['value']:.1f}%"

    def bound(x: dict[str, Any]) -> str:
        m = re.search(r"(?:>=|<=|<)\s*([\d.]+(?:x|%))", x["target"])
        return m.group(1) if m else "?"

    durable, vs_st = find("durable save", "raw new-file write"), find("durable save", "safetensors")
    load, load_st = find("load >=", "raw read"), find("load >=", "safetensors")
    blocked = find("async save blocked")
    derived = f", re-derived from `{src['derived_from']}`" if src.get("derived_from") else ""
    staged = rows.get("dsio Checkpointer save: until the state may change (wait_staged)")
    durable_s = rows["dsio Checkpointer save (durable)"]["seconds_median"]
    free_again = (
        f" (`save()` returns at once; the state may change again {staged['seconds_median'] / durable_s * 100:.0f}% "
        "of the way into the save, once `wait_staged()` returns)"
        if staged
        else ""
    )
    return (
        f"Measured on {st['gib']:.2f} GiB of GPT-like state ({st['tensors']} tensors; `{source}`{derived}; "
        f"{src.get('reps', '?')} interleaved reps, medians): durable save "
        f"{val(durable)} dsio's raw new-file write (target {bound(durable)}) and "
        f"{val(vs_st)} safetensors + fsync "
        f"({rows['dsio Checkpointer save (durable)']['gbps_median']:.2f} GB/s); load "
        f"{val(load)} raw read (target {bound(load)}) and {val(load_st)} safetensors "
        f"({rows['dsio Checkpointer load (crc32c verified)']['gbps_median']:.2f} GB/s, crc32c verified). An async "
        f"save blocks training for {val(blocked)} of a synchronous save{free_again} (target {bound(blocked)}: "
        f"{'met' if blocked['met'] else 'not met'}).{_checkpoint_limits(src)}\n"
    )


def _checkpoint_limits(src: dict[str, Any]) -> str:
    """The resources' rates measured in the same run (bench/checkpoint.py's ``limits``; older runs have none)."""
    lim = src.get("limits")
    if not lim:
        return ""

    def pick(prefix: str) -> float:
        hits = [v for k, v in lim.items() if k.startswith(prefix)]
        if len(hits) != 1:
            raise NumbersError(f"checkpoint limits: no single entry starting {prefix!r}")
        return float(hits[0])

    threads = [k for k in lim if k.startswith("staging on the ")]
    n = threads[0].split()[3] if len(threads) == 1 else "?"
    return (
        f" Same run: the disk wrote {pick('disk write'):.2f} GB/s and read {pick('disk read'):.2f} GB/s (raw); "
        f"staging (memcpy + crc32c) runs at {pick('staging on the '):.2f} GB/s on the {n} copier threads, crc32c "
        f"at {pick('crc32c on one core'):.2f} GB/s per core, first touch of fresh memory at "
        f"{pick('fresh memory first touch'):.2f} GB/s per core."
    )


def render_metrics(src: dict[str, Any], source: str) -> str:
    modes = _get(src, "modes")
    return (
        f"Exporter cost (`{source}`, {modes['on']['windows']} on/off window pairs of 64 KiB O_DIRECT ops, "
        f"scraped every second by {_get(src, 'meta', 'scraper')}): CPU per op changed by "
        f"{src['cpu_per_op_change_pct']:+.2f}% with the exporter (median of the paired on/off ratios; medians "
        f"{modes['off']['cpu_us_per_op_median']:.2f} us off, {modes['on']['cpu_us_per_op_median']:.2f} us on); "
        f"one scrape costs {src['scrape_cpu_us']:.0f} us of CPU.\n"
    )


GPU_ROWS = [
    ("dsio bounce", "dsio bounce"),
    ("dsio cufile", "dsio cufile (compat mode)"),
    ("dsio host-pinned (ceiling)", "dsio host-pinned (the disk's ceiling)"),
    ("kvikio CuFile", "kvikio CuFile"),
    ("tensor.cpu() + torch.save", "`tensor.cpu()` + `torch.save`"),
]


def render_gpu(src: dict[str, Any], source: str) -> str:
    res, meta = _get(src, "results"), _get(src, "meta")
    lines = [
        f"`{source}` ({meta.get('date', '?')}, {meta.get('gpu', '?').split(',')[0]}): "
        f"{meta.get('size_gib', '?')} GiB CUDA tensor, fsync'ed writes, GB/s, median (min-max) of "
        f"{meta.get('reps', '?')} interleaved reps.",
        "",
        "| GB/s | write | read |",
        "| --- | --- | --- |",
    ]
    for key, label in GPU_ROWS:
        if key in res:
            lines.append(f"| {label} | {mrange(res[key]['write'])} | {mrange(res[key]['read'])} |")
    return "\n".join(lines) + "\n"


def render_gpu_ratios(src: dict[str, Any], source: str) -> str:
    res, meta = _get(src, "results"), _get(src, "meta")
    b, h, k = (_get(res, name) for name in ("dsio bounce", "dsio host-pinned (ceiling)", "kvikio CuFile"))
    return (
        f"`{source}` ({meta.get('date', '?')}): bounce {med(b['write']):.2f} / {med(b['read']):.2f} GB/s "
        f"(write / read) = {ratio(med(b['write']), med(h['write']))} / {ratio(med(b['read']), med(h['read']))} "
        f"host-pinned, {ratio(med(b['write']), med(k['write']))} / {ratio(med(b['read']), med(k['read']))} kvikio.\n"
    )


def _train_row(reps: list[list[dict[str, Any]]]) -> tuple[float, float, float]:
    """(best step, median step, peak RSS MiB) the way bench/train.py reports them: a step takes as long as
    its slowest rank; best = fastest such step over all reps; median = median over reps of each rep's
    median step; RSS = max over ranks, median over reps."""
    steps = [[max(xs) for xs in zip(*(r["step_s"] for r in rep), strict=True)] for rep in reps]
    best = min(min(s) for s in steps)
    median = med([med(s) for s in steps])
    rss = med([max(r["peak_rss_mib"] for r in rep) for rep in reps])
    return best, median, rss


def render_train(src: dict[str, Any], source: str) -> str:
    res = _get(src, "results")
    rows = {m: _train_row(reps) for m, reps in res.items() if reps}
    one = res[next(iter(rows))][0][0]
    when = f", {src['meta']['date']}" if isinstance(src.get("meta"), dict) and "date" in src["meta"] else ""
    lines = [
        f"`{source}`{when}: GPT-like model, {one['params'] / 1e6:.1f}M parameters, fp32, world size {one['world']} "
        f"(gloo), {len(res[next(iter(rows))])} interleaved reps. Best step = the fastest step over all reps "
        "(a step lasts as long as its slowest rank); peak RSS per rank.",
        "",
        "| method | best step, s | vs DDP | vs DeepSpeed, same stage | median step, s | peak RSS, MiB | RSS vs DeepSpeed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ddp = rows.get("ddp")
    for m, (best, median, rss) in rows.items():
        ds = rows.get("deepspeed" + m[len("dstrain") :]) if m.startswith("dstrain") else None
        lines.append(
            f"| {m} | {best:.3f} | {ratio(best, ddp[0]) if ddp else '-'} | {ratio(best, ds[0]) if ds else '-'} "
            f"| {median:.3f} | {rss:,.0f} | {ratio(rss, ds[2]) if ds else '-'} |"
        )
    return "\n".join(lines) + "\n"


def render_demo(src: dict[str, Any], source: str) -> str:
    """``make demo``'s result (demo/train_demo.py --out): its own table (demo/report.py), one source of truth."""
    for keys in (
        ("reference", "checkpoints", "per_rank"),
        ("verdict", "bitwise_equal"),
        ("phases",),
        ("date",),
    ):
        _get(src, *keys)
    sys.path.insert(0, str(ROOT / "demo"))
    from report import table  # demo/report.py

    return f"`{source}` ({src['date']}, host {src.get('host', '?')}): " + table(src, heading=False)


def _bench_module(name: str) -> Any:
    """A module of the checkout's ``bench`` package (its own report code: one source of truth)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import importlib

    return importlib.import_module(f"bench.{name}")


def render_io_tuned(src: dict[str, Any], source: str) -> str:
    """bench/io.py's tuned-vs-tuned sweep (bench/io.report_tuned), the main table's defaults beside it."""
    res, meta = _get(src, "results"), _get(src, "meta")
    tuned = _get(res, "tuned")
    _get(tuned, "results", "dsio")
    main_defaults = {
        (side, op): statistics.median(res[method][case])
        for side, method in (
            ("dsio", "dsio io_uring, locked buffer"),
            ("DeepSpeed", "DeepSpeed aio_handle, locked"),
        )
        for op, case in (("write", "write_new"), ("read", "read"))
        if res.get(method, {}).get(case)
    }
    body = _bench_module("io").report_tuned(tuned, 1 << 30, main_defaults)
    body = body.replace("## Tuned vs tuned: each side's best of the same sweep", "").strip()
    return f"`{source}` ({meta.get('date', '?')}, host {meta.get('host', '?')}): " + body + "\n"


def render_io_loop(src: dict[str, Any], source: str) -> str:
    """bench/io.py's asyncio vs uvloop rows (bench/io.loop_lines)."""
    res, meta = _get(src, "results"), _get(src, "meta")
    _get(res, "dsio io_uring (default config)", "ops_write_64K_path")
    lines = _bench_module("io").loop_lines(res)
    if not lines:
        raise ValueError("no uvloop rows in this run")
    table = "\n".join(line for line in lines if line.startswith("|"))
    return f"`{source}` ({meta.get('date', '?')}, host {meta.get('host', '?')}): 64 KiB ops/s, median (min-max).\n\n{table}\n"


def render_io_read_path(src: dict[str, Any], source: str) -> str:
    """bench/io.py --read-path (issue 17's matrix): each case's read (write) over DeepSpeed's, per group."""
    rp = _bench_module("io_read_path")
    res, meta, args = _get(src, "results"), _get(src, "meta"), _get(src, "args")
    groups = list(res)
    cases = [c for c in (*rp.READ_CASES, rp.WRITE_CASES[0]) if any(c in res[g] for g in groups)]
    cold = (
        "page cache dropped and checked before every operation" if src.get("cold") else "WARM (drop failed)"
    )
    lines = [
        f"`{source}` ({meta['date']}, host {meta['host']}): {args['runs']} runs x {args['reps']} interleaved reps "
        f"per case, `IOConfig()` defaults, {cold}; median over runs of (the run's median / DeepSpeed's "
        "`aio_handle()` read into its locked buffer, or its write, in the same run), min-max over runs.",
        "",
        "| case | target | " + " | ".join(groups) + " |",
        "| --- | --- | " + " | ".join("---" for _ in groups) + " |",
    ]
    met = total = 0
    for case in cases:
        target = rp.TARGETS.get(case)
        cells = []
        for g in groups:
            c = res[g]
            ref = c.get(rp.DS_READ if "read" in case else rp.WRITE_CASES[1])
            if not ref or case not in c:
                cells.append("-")
                continue
            r = rp._ratios(c[case], ref)
            cells.append(f"{ratio(statistics.median(r), 1.0)} ({min(r):.2f}-{max(r):.2f})")
            if target is not None:
                total += 1
                met += statistics.median(r) >= target
        t = "-" if target is None else f">= {target:.2f}x"
        lines.append(f"| {case} | {t} | " + " | ".join(cells) + " |")
    lines += ["", f"Targets met: {met} of {total}.", ""]
    return "\n".join(lines)


def render_activation_checkpointing(src: dict[str, Any], source: str) -> str:
    """bench/activation_checkpointing.py's table (its own render), the title replaced by the source."""
    meta, rows, probes = _get(src, "meta"), _get(src, "rows"), _get(src, "probes")
    body = _bench_module("activation_checkpointing").render(meta, rows, probes)
    _, _, rest = body.partition("\n")
    load = f"under load (load {meta['load']})" if meta.get("under_load") else f"load {meta['load']}"
    return (
        f"`{source}` ({meta.get('date', '?')}, host {meta.get('host', '?')}, {load}):" + rest.rstrip() + "\n"
    )


def render_offload_gpu(src: dict[str, Any], source: str) -> str:
    """bench/offload_gpu_table.py --json: dstrain vs DeepSpeed per offload mode on one GPU."""
    data, commit = _get(src, "data"), src.get("commit", "?")
    meta = data.get("meta") or {}
    modes = (
        ("cpu", "optimizer state on the CPU"),
        ("optimizer", "optimizer state on NVMe"),
        ("both", "parameters + optimizer state on NVMe"),
        ("big", "the largest model the disk holds, everything on NVMe"),
    )

    def peak(r: dict[str, Any]) -> str:
        return f"{r['gpu_peak_gib']:.1f} ({r['gpu_bytes_per_param']:.2f})" if r.get("gpu_peak_gib") else "-"

    def tok(r: dict[str, Any] | None) -> str:
        if not r:
            return "not run"
        if r.get("tokens_per_s"):
            return f"{r['tokens_per_s']:,.0f}"
        return "failed" if r.get("error") else "not run"

    lines = [
        f"`{source}` ({meta.get('date', '?')}, {meta.get('gpu', 'GPU')}, code at {commit}): tokens/s and GPU peak "
        "over the training steps, GiB (bytes per parameter), one run each, interleaved.",
        "",
        "| mode | params | dstrain tokens/s | DeepSpeed tokens/s | dstrain / DeepSpeed | dstrain GPU peak | DeepSpeed GPU peak |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, what in modes:
        d, s = data.get(f"dstrain-{mode}"), data.get(f"deepspeed-{mode}")
        if not (d and d.get("tokens_per_s")) and not (s and s.get("tokens_per_s")):
            continue
        ratio = (
            f"{d['tokens_per_s'] / s['tokens_per_s']:.2f}x"
            if d and s and d.get("tokens_per_s") and s.get("tokens_per_s")
            else "-"
        )
        n = (d or s or {}).get("params", 0)
        ds = "-" if mode == "big" else tok(s)
        lines.append(
            f"| {what} | {n / 1e9:.2f}B | {tok(d)} | {ds} | {ratio} | {peak(d or {})} | "
            f"{peak(s or {}) if mode != 'big' else '-'} |"
        )
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "offload-gpu": render_offload_gpu,
    "activation-checkpointing": render_activation_checkpointing,
    "io-read-path": render_io_read_path,
    "io-tuned": render_io_tuned,
    "io-loop": render_io_loop,
    "io-seq": render_io_seq,
    "io-ops": render_io_ops,
    "checkpoint": render_checkpoint,
    "metrics": render_metrics,
    "gpu": render_gpu,
    "gpu-ratios": render_gpu_ratios,
    "train": render_train,
    "demo": render_demo,
}


def render(kind: str, source: str, root: Path = ROOT) -> str:
    """The body of one block, from its source file."""
    if kind not in RENDERERS:
        raise NumbersError(f"unknown numbers kind {kind!r} (known: {', '.join(RENDERERS)})")
    path = root / source
    if not path.is_file():
        raise NumbersError(f"{source}: no such result file")
    if path.suffix != ".json":
        raise NumbersError(f"{source}: numbers are generated from JSON result files only")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NumbersError(f"{source}: not valid JSON: {e}") from e
    try:
        return RENDERERS[kind](data, source)
    except (KeyError, TypeError, ValueError, statistics.StatisticsError) as e:
        raise NumbersError(f"{source}: lacks what a {kind!r} block needs: {e!r}") from e


def regenerate(text: str, root: Path = ROOT) -> str:
    """``text`` with every block's body re-rendered from its source."""
    out, pos = [], 0
    for b in blocks(text):
        out += [text[pos : b.start], render(b.kind, b.source, root)]
        pos = b.end
    out.append(text[pos:])
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="only compare; exit 1 with a diff when README drifted"
    )
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    new = regenerate(text, args.readme.resolve().parent)
    if args.check:
        if new != text:
            sys.stdout.writelines(
                difflib.unified_diff(text.splitlines(True), new.splitlines(True), "README.md", "generated")
            )
            print(
                "README.md's numbers differ from their result files: run scripts/readme_numbers.py",
                file=sys.stderr,
            )
            return 1
        print(f"README.md: {len(blocks(text))} generated blocks match their result files")
        return 0
    if new != text:
        args.readme.write_text(new)
        print(f"README.md: {len(blocks(text))} blocks regenerated")
    else:
        print("README.md: already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
