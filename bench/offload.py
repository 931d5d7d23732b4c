"""Offload benchmark: dstrain vs DeepSpeed, optimizer state in memory / on CPU / on NVMe, ZeRO-3.

The anchors' 16.8M-parameter MLP (4 x Linear(2048, 2048) + GELU, Linear(2048, 8); see
/work/shared/anchors/ds_offload_steps.py), world size 2 on gloo, fp32, AdamW, sub_group_size 4M.
Every (method, rep) runs in fresh torchrun processes, methods interleaved rep by rep, and a dsio
disk probe (fresh-file write and read of 256 MiB) runs between reps, so the I/O floor is measured
in the same time window as the steps it bounds.

    python bench/offload.py                           # all methods, 3 reps
    python bench/offload.py --methods dstrain-nvme,deepspeed-nvme --reps 1 --steps 6   # quick look

Per method: median step time (steps 3..N) and per-rank peak RSS after warm-up; for NVMe runs the
bytes swapped per step (dstrain: from the swapper's counters; DeepSpeed: the formula its swap
layout implies), stall fraction and prefetch hit rate (dstrain). DeepSpeed runs only when
--ds-python can import deepspeed.
"""

from __future__ import annotations

import argparse
import datetime
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
MODES = ("none", "cpu", "nvme")
ALL_METHODS = [f"{impl}-{mode}" for impl in ("dstrain", "deepspeed") for mode in MODES]


# -- inside a torchrun rank --------------------------------------------------------------------


def _rss_kib(field: str = "VmHWM:") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    impl, mode = args.method.split("-")
    h = args.hidden
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.GELU()) for _ in range(4)], nn.Linear(h, 8))
    n_params = sum(p.numel() for p in model.parameters())
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": args.sub_group}
    if mode == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif mode == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_dir, "buffer_count": 4}
    cfg: dict[str, Any] = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
            "intra_op_parallelism": 1,
        },
    }
    if impl == "dstrain":
        sys.path.insert(0, str(ROOT))
        import dstrain as lib

        if mode == "nvme":
            zero["offload_pinned_bytes"] = args.pinned
    else:
        import deepspeed as lib  # type: ignore[import-not-found,no-redef]

        if mode == "none":  # torch's fused AdamW, as dstrain (offload modes use DeepSpeedCPUAdam)
            cfg["optimizer"]["params"]["torch_adam"] = True
    t0 = time.perf_counter()
    engine, optimizer, _, _ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1 + rank)
    xs = [torch.randn(8, h, generator=g) for _ in range(args.steps)]
    times: list[float] = []
    losses: list[float] = []
    stats0 = None
    for i, x in enumerate(xs):
        if i == 2:
            _reset_peak()  # peak RSS of the training phase, after two warm-up steps
            stats0 = _offload_stats(optimizer)
        t = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.item()))
    stats1 = _offload_stats(optimizer)
    tail = times[2:] or times
    result = {
        "rank": rank,
        "median_step_s": statistics.median(tail),
        "steps_s": times,
        "peak_rss_mib": _rss_kib() / 1024,
        "init_s": init_s,
        "params": n_params,
        "losses": losses,
    }
    if stats0 is not None and stats1 is not None:
        k = len(tail)
        result.update(
            read_bytes_per_step=(stats1["read_bytes"] - stats0["read_bytes"]) / k,
            written_bytes_per_step=(stats1["written_bytes"] - stats0["written_bytes"]) / k,
            stall_s_per_step=(stats1["stall"] - stats0["stall"]) / k,
            optimizer_step_s=(stats1["step_s"] - stats0["step_s"]) / k,
            hits=stats1["hits"] - stats0["hits"],
            misses=stats1["misses"] - stats0["misses"],
            pinned_bytes=stats1["pinned"],
        )
    if impl == "deepspeed" and mode == "nvme":
        swap = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(args.nvme_dir) for f in fs)
        result["swap_file_bytes_total"] = swap
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    if hasattr(optimizer, "close"):
        optimizer.close()
    dist.destroy_process_group()


def _offload_stats(optimizer: Any) -> dict[str, float] | None:
    st = getattr(optimizer, "statistics", None)
    if st is None:
        return None
    s = st()
    sw = getattr(s, "swapper", None)
    if not hasattr(s, "stall_seconds"):
        return None
    return {
        "read_bytes": sw.read_bytes if sw else 0,
        "written_bytes": sw.written_bytes if sw else 0,
        "stall": s.stall_seconds,
        "step_s": s.step_seconds,
        "hits": s.prefetch_hits,
        "misses": s.prefetch_misses,
        "pinned": s.pinned_bytes,
    }


# -- disk probe (same time window) ---------------------------------------------------------------


def disk_probe(directory: str, nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of one fresh-file write and one read of ``nbytes`` through dsio (1 MiB blocks, O_DIRECT)."""
    code = f"""
import asyncio, os, time, torch, json, sys
sys.path.insert(0, {str(ROOT)!r})
import dsio
from dsio.pool import PinnedPool
async def main():
    path = os.path.join({directory!r}, "probe.bin")
    pool = PinnedPool({nbytes}, {nbytes})
    lease = pool.try_acquire(); t = lease.tensor; t.fill_(7)
    async with dsio.AsyncIOHandle(dsio.IOConfig(queue_depth=32)) as h:
        t0 = time.perf_counter(); await h.pwrite(t, path, fsync=True); w = time.perf_counter() - t0
        t0 = time.perf_counter(); await h.pread(t, path); r = time.perf_counter() - t0
    os.unlink(path); lease.release(); pool.close()
    print(json.dumps({{"write_gbps": {nbytes} / w / 1e9, "read_gbps": {nbytes} / r / 1e9}}))
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode:
        return {"error": out.stderr[-500:]}  # type: ignore[dict-item]
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- driver ----------------------------------------------------------------------------------------


def run_one(args: argparse.Namespace, method: str, nvme_dir: str) -> dict[str, Any]:
    impl = method.split("-")[0]
    py = args.ds_python if impl == "deepspeed" else sys.executable
    torchrun = str(Path(py).parent / "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if impl == "deepspeed":
        env["TORCH_EXTENSIONS_DIR"] = args.ds_extensions
    shutil.rmtree(nvme_dir, ignore_errors=True)
    os.makedirs(nvme_dir)
    cmd = [
        torchrun, "--standalone", "--nproc_per_node", "2", __file__, "--worker", "--method", method,
        "--steps", str(args.steps), "--hidden", str(args.hidden), "--sub-group", str(args.sub_group),
        "--nvme-dir", nvme_dir, "--pinned", str(args.pinned),
    ]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    shutil.rmtree(nvme_dir, ignore_errors=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"method": method, "ranks": json.loads(line[7:]), "wall_s": wall}
    return {"method": method, "error": (out.stdout + out.stderr)[-3000:], "wall_s": wall}


def _med(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(
    runs: list[dict[str, Any]], probes: list[dict[str, float]], methods: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    read_gbps = [p["read_gbps"] for p in probes if "read_gbps" in p]
    write_gbps = [p["write_gbps"] for p in probes if "write_gbps" in p]
    for m in methods:
        ok = [r for r in runs if r["method"] == m and "ranks" in r]
        if not ok:
            out[m] = {"error": next((r["error"] for r in runs if r["method"] == m), "not run")}
            continue
        steps = [max(x["median_step_s"] for x in r["ranks"]) for r in ok]  # the slower rank sets the pace
        rss = [max(x["peak_rss_mib"] for x in r["ranks"]) for r in ok]
        row: dict[str, Any] = {"step_s": _med(steps), "peak_rss_mib": _med(rss), "reps": len(ok)}
        r0 = ok[-1]["ranks"]
        if "read_bytes_per_step" in r0[0]:
            moved = [
                sum(x["read_bytes_per_step"] + x["written_bytes_per_step"] for x in r["ranks"]) for r in ok
            ]
            row["swap_bytes_per_step"] = statistics.median(moved)
            stall = [max(x["stall_s_per_step"] / x["median_step_s"] for x in r["ranks"]) for r in ok]
            row["stall_fraction"] = _med(stall)
            hits = sum(x["hits"] for r in ok for x in r["ranks"])
            misses = sum(x["misses"] for r in ok for x in r["ranks"])
            row["prefetch_hit_rate"] = hits / max(1, hits + misses)
            row["pinned_bytes"] = r0[0]["pinned_bytes"]
        if "swap_file_bytes_total" in r0[0]:
            row["swap_file_bytes_total"] = r0[0]["swap_file_bytes_total"]
        out[m] = row
    if read_gbps and write_gbps:
        out["disk"] = {"read_gbps": _med(read_gbps), "write_gbps": _med(write_gbps)}
    return out


def report(args: argparse.Namespace, summary: dict[str, Any], n_params: int) -> str:
    lines = [
        f"# Offload benchmark {datetime.date.today()} ({platform.node()}){' — ' + args.label if args.label else ''}",
        "",
        f"ZeRO-3, fp32, AdamW, world 2 (gloo), MLP of {n_params / 1e6:.1f}M parameters (hidden {args.hidden}), "
        f"sub_group_size {args.sub_group:,}, {args.steps} steps per run (median of steps 3..N), {args.reps} "
        "interleaved reps; medians with [min-max]. dstrain's pinned budget "
        f"{args.pinned / 2**20:.0f} MiB per rank.",
        "",
        "| method | step s | peak RSS MiB (max rank) | swap bytes/step (both ranks) | I/O floor s | stall fraction | prefetch hits |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    disk = summary.get("disk")
    for m in [k for k in summary if k != "disk"]:
        row = summary[m]
        if "error" in row:
            lines.append(
                f"| {m} | failed: `{row['error'].strip().splitlines()[-1][:120] if row['error'].strip() else '?'}` | | | | | |"
            )
            continue
        s, lo, hi = row["step_s"]
        r, rlo, rhi = row["peak_rss_mib"]
        swap = row.get("swap_bytes_per_step")
        floor = ""
        if swap is not None and disk:
            # both ranks share the disk: half the bytes read, half written
            floor = (
                f"{swap / 2 / (disk['read_gbps'][0] * 1e9) + swap / 2 / (disk['write_gbps'][0] * 1e9):.3f}"
            )
        stall = row.get("stall_fraction")
        hit = row.get("prefetch_hit_rate")
        lines.append(
            f"| {m} | {s:.3f} [{lo:.3f}-{hi:.3f}] | {r:.0f} [{rlo:.0f}-{rhi:.0f}] | "
            f"{'' if swap is None else f'{swap / 1e6:.0f} MB'} | {floor} | "
            f"{'' if stall is None else f'{stall[0]:.2f} [{stall[1]:.2f}-{stall[2]:.2f}]'} | "
            f"{'' if hit is None else f'{hit:.0%}'} |"
        )
    if disk:
        lines += ["", f"Disk in the same run (dsio, 256 MiB, O_DIRECT): write {disk['write_gbps'][0]:.2f} GB/s "
                  f"[{disk['write_gbps'][1]:.2f}-{disk['write_gbps'][2]:.2f}], read {disk['read_gbps'][0]:.2f} GB/s "
                  f"[{disk['read_gbps'][1]:.2f}-{disk['read_gbps'][2]:.2f}]."]  # fmt: skip
    part = n_params / 2
    lines += [
        "",
        "Bytes per step, expected: dstrain keeps the fp32 master in the parameter shard it already holds "
        "and swaps Adam's m and v only: read + write of 2 x 4 bytes x P/2 per rank = "
        f"{2 * 2 * 8 * part / 1e6:.0f} MB per step for both ranks (P = {n_params:,}; sub-groups padded to "
        "4 KiB). DeepSpeed swaps fp32 master + m + v: 2 x 12 x P/2 per rank = "
        f"{2 * 2 * 12 * part / 1e6:.0f} MB per step.",
    ]
    return "\n".join(lines) + "\n"


def loss_agreement(runs: list[dict[str, Any]]) -> list[str]:
    """Per-step loss of dstrain vs DeepSpeed in the same mode (same model, seed and data), rank 0."""
    out = []
    for mode in MODES:
        a = next((r for r in runs if r["method"] == f"dstrain-{mode}" and "ranks" in r), None)
        b = next((r for r in runs if r["method"] == f"deepspeed-{mode}" and "ranks" in r), None)
        if a is None or b is None or "losses" not in a["ranks"][0] or "losses" not in b["ranks"][0]:
            continue
        la, lb = a["ranks"][0]["losses"], b["ranks"][0]["losses"]
        rel = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(la, lb, strict=True))
        out.append(f"- {mode}: max relative difference of per-step loss over {len(la)} steps: {rel:.2e}")
    return out


def targets(summary: dict[str, Any]) -> list[str]:
    def step(m: str) -> float | None:
        row = summary.get(m)
        return row["step_s"][0] if row and "step_s" in row else None

    out = []
    dn, dc, sn, sc = step("dstrain-nvme"), step("dstrain-cpu"), step("deepspeed-nvme"), step("deepspeed-cpu")
    if dn and sn:
        rss = (summary["dstrain-nvme"]["peak_rss_mib"][0], summary["deepspeed-nvme"]["peak_rss_mib"][0])
        out.append(
            f"- dstrain NVMe vs DeepSpeed NVMe: {sn / dn:.2f}x faster (target >= 1.5x: "
            f"{'met' if sn / dn >= 1.5 else 'MISSED'}); peak RSS {rss[0]:.0f} vs {rss[1]:.0f} MiB "
            f"({'lower' if rss[0] < rss[1] else 'NOT lower'})"
        )
    if dn and dc:
        out.append(
            f"- dstrain NVMe / dstrain CPU step: {dn / dc:.2f} (target <= 1.25: {'met' if dn / dc <= 1.25 else 'MISSED'})"
        )
    if dc and sc:
        out.append(
            f"- dstrain CPU-offload vs DeepSpeed CPU-offload: {sc / dc:.2f}x (target >= 1.0: "
            f"{'met' if sc / dc >= 1.0 else 'MISSED'})"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="dstrain-none")
    p.add_argument("--methods", default=",".join(ALL_METHODS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--sub-group", type=int, default=4_000_000)
    p.add_argument("--pinned", type=int, default=64 << 20, help="dstrain offload_pinned_bytes per rank")
    p.add_argument("--nvme-dir", default=None)
    p.add_argument("--ds-python", default="/work/ds-venv/bin/python")
    p.add_argument("--ds-extensions", default="/work/ds-venv/torch_extensions")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="result file stem (default bench/results/offload-<date>)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    methods = [m for m in args.methods.split(",") if m]
    if any(m.startswith("deepspeed") for m in methods):
        ok = subprocess.run([args.ds_python, "-c", "import deepspeed"], capture_output=True).returncode == 0
        if not ok:
            print(f"DeepSpeed not importable with {args.ds_python}: skipping its methods", file=sys.stderr)
            methods = [m for m in methods if not m.startswith("deepspeed")]
    base = args.nvme_dir or tempfile.mkdtemp(prefix="offload-bench-", dir=str(ROOT / "build"))
    os.makedirs(base, exist_ok=True)
    runs: list[dict[str, Any]] = []
    probes: list[dict[str, float]] = []
    for rep in range(args.reps):
        probes.append(disk_probe(base))
        print(f"rep {rep + 1}: disk {probes[-1]}", flush=True)
        for m in methods:
            r = run_one(args, m, os.path.join(base, "swap"))
            runs.append(r)
            brief = (
                f"{max(x['median_step_s'] for x in r['ranks']):.3f} s/step"
                if "ranks" in r
                else "FAILED " + r["error"][-300:]
            )
            print(f"rep {rep + 1} {m}: {brief} (wall {r['wall_s']:.0f} s)", flush=True)
    n_params = next((r["ranks"][0]["params"] for r in runs if "ranks" in r), 0)
    summary = summarize(runs, probes, methods)
    text = report(args, summary, n_params) + "\nTargets (issue 11):\n\n" + "\n".join(targets(summary)) + "\n"
    agreement = loss_agreement(runs)
    if agreement:
        text += "\nLoss agreement, dstrain vs DeepSpeed (rank 0, same model, seed and data):\n\n"
        text += "\n".join(agreement) + "\n"
    stem = args.out or str(ROOT / "bench" / "results" / f"offload-{datetime.date.today()}")
    Path(stem + ".md").write_text(text)
    Path(stem + ".json").write_text(json.dumps({"args": vars(args), "runs": runs, "probes": probes,
                                                "summary": summary}, indent=1))  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
