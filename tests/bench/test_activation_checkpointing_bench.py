"""bench/activation_checkpointing.py: the rotation, the per-rep ratios and floors on known numbers, and a
real two-method run (worker processes, the protocol, the files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.activation_checkpointing import parse_args, render, rotated, summarize  # noqa: E402


def test_every_method_takes_every_position_once_over_as_many_reps() -> None:
    methods = ["a", "b", "c", "d"]
    orders = [rotated(methods, r) for r in range(len(methods))]
    assert all(sorted(o) == methods for o in orders)
    for pos in range(len(methods)):
        assert sorted(o[pos] for o in orders) == methods


def test_ratios_are_per_rep_and_floors_use_the_same_reps_plain_step() -> None:
    steps = {
        "none": [1.0, 2.0],
        "torch": [2.0, 4.0],
        "dstrain": [2.2, 4.0],
        "dstrain-cpu": [3.0, 5.0],
        "dstrain-nvme": [4.0, 4.4],
    }
    mib = 2**20
    extra = {
        "dstrain-cpu": {"offloaded_bytes": 1000 * mib},
        "dstrain-nvme": {"offloaded_bytes": 1000 * mib, "read_bytes": 1000 * mib},
    }
    probes = {"memcpy_gbps": 1000 * mib / 1e9, "write_gbps": 500 * mib / 1e9, "read_gbps": 1000 * mib / 1e9}
    rows = {r["method"]: r for r in summarize(steps, extra, probes)}
    assert rows["dstrain"]["vs_torch"] == pytest.approx([1.1, 1.0])  # rep by rep, not median over median
    assert rows["dstrain"]["vs_none"] == pytest.approx([2.2, 2.0])
    assert "vs_torch" not in rows["torch"] and "floor_s" not in rows["dstrain"]
    assert rows["dstrain-cpu"]["floor_s"] == pytest.approx([3.2, 5.0])  # plain + 1 s of copy
    # nvme: max(plain + 2 copies, write 2 s + read 1 s)
    assert rows["dstrain-nvme"]["floor_s"] == pytest.approx([4.2, 6.0])
    assert rows["dstrain-nvme"]["vs_floor"] == pytest.approx([4.0 / 4.2, 4.4 / 6.0])


def test_render_names_the_load_and_the_failed_methods() -> None:
    meta = {
        "date": "d",
        "load": "3.0",
        "under_load": True,
        "memory": "m",
        "failed": {"deepspeed": "boom"},
        "shape": {
            "model": "gpt",
            "dim": 8,
            "heads": 2,
            "tokens": 4,
            "batch": 1,
            "depth": 2,
            "reps": 1,
            "threads": 1,
        },
    }
    rows = summarize(
        {"none": [1.0], "torch": [2.0]},
        {"none": {"peak_bytes": 2**20, "rss_growth": 0}, "torch": {"peak_bytes": 2**19, "rss_growth": 0}},
        {},
    )
    md = render(meta, rows, {})
    assert "under load (load 3.0)" in md and "deepspeed: did not run: boom" in md
    assert "| torch | 2.000 [2.000-2.000] | 1 | 2.00 [2.00-2.00] | 0.5 |" in md


def test_a_real_run_of_two_methods(tmp_path) -> None:
    env = dict(os.environ, DSIO_BENCH_RESULTS=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "activation_checkpointing.py"),
        "--quick",
        "--reps",
        "2",
        "--methods",
        "torch,dstrain,dstrain-nvme",
        "--swap-dir",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=300)
    (stem,) = {p.with_suffix("") for p in tmp_path.glob("activation-checkpointing-quick-*.json")}
    rows = {r["method"]: r for r in json.loads(stem.with_suffix(".json").read_text())["rows"]}
    assert len(rows["torch"]["step_s"]) == len(rows["dstrain-nvme"]["step_s"]) == 2
    nvme = rows["dstrain-nvme"]
    page = -(-2 * 64 * 64 * 4 // 4096) * 4096  # one (B, T, C) fp32 input per block, page-rounded
    assert nvme["offloaded_bytes"] == nvme["read_bytes"] == 4 * page  # 4 blocks, each written and read once
    assert nvme["peak_bytes"] > 0 and len(nvme["vs_floor"]) == 2
    assert stem.with_suffix(".png").exists() and "dstrain-nvme" in stem.with_suffix(".md").read_text()
    assert [p for p in tmp_path.iterdir() if p.name.startswith("actckpt-")] == []  # the swap dir is removed


def test_quick_is_one_tiny_rep_labelled_quick() -> None:
    a = parse_args(["--quick"])
    assert (a.reps, a.depth, a.label) == (1, 4, "quick")
    assert parse_args(["--quick", "--reps", "2"]).reps == 2 and parse_args(["--quick"]).dim == 64
    assert parse_args(["--label", "x"]).label == "x" and parse_args([]).reps == 5
