"""``dsio tune`` finds the fastest read AND write settings, says when they differ, and the emitted
``"aio"`` block favours the workload named with ``--workload checkpoint|offload``."""

from __future__ import annotations

import json

import pytest

import dsio
from dsio import _tune
from dsio.cli import main

SWEEP = [
    "--size",
    "8M",
    "--block-sizes",
    "256K,1M",
    "--queue-depths",
    "4,32",
    "--parallelism",
    "1",
    "--reps",
    "1",
    "--finalists",
    "4",
    "--quiet",
]


@pytest.fixture
def known_speeds(monkeypatch):
    """Fake timings: reads are fastest with 1 MiB blocks at QD 32, writes with 256 KiB at QD 4,
    so the best read and write settings differ by construction."""

    async def fake(f, op, view, offset):
        cfg = f._ops.config
        if op == "read":
            gbps = 1.0 + (cfg.block_size == 1 << 20) + (cfg.queue_depth == 32)
        else:
            gbps = 1.0 + (cfg.block_size == 256 << 10) + (cfg.queue_depth == 4)
        gbps += 0.1 * (not cfg.single_submit) + 0.05 * cfg.overlap_events  # one winner per op
        return view.numel() / (gbps * 1e9)

    monkeypatch.setattr(_tune, "_timed", fake)


def _block(path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())["aio"]


@pytest.mark.parametrize(
    ("workload", "want"),
    [
        ("offload", {"block_size": 1 << 20, "queue_depth": 32}),
        ("checkpoint", {"block_size": 256 << 10, "queue_depth": 4}),
    ],
)
def test_workload_picks_read_or_write_settings(data_dir, tmp_path, capsys, known_speeds, workload, want):
    out = tmp_path / workload
    assert main(["tune", "--dir", data_dir, "--out", str(out), "--workload", workload, *SWEEP]) == 0
    text = capsys.readouterr().out
    aio = _block(out)
    assert {k: aio[k] for k in want} == want
    assert aio["single_submit"] is False and aio["overlap_events"] is True
    # Both winners are reported, and the difference is said out loud.
    assert "fastest READ and WRITE settings differ" in text
    assert '"block_size": 1048576, "queue_depth": 32' in text  # the read winner
    assert '"block_size": 262144, "queue_depth": 4' in text  # the write winner
    assert ("favours read" in text) == (workload == "offload")
    assert ("favours write" in text) == (workload == "checkpoint")


def test_same_best_settings_say_they_agree(data_dir, tmp_path, capsys, monkeypatch):
    async def fake(f, op, view, offset):
        cfg = f._ops.config
        gbps = 1.0 + (cfg.block_size == 1 << 20) + (cfg.queue_depth == 32) + 0.1 * (not cfg.single_submit)
        gbps += 0.05 * cfg.overlap_events
        return view.numel() / (gbps * 1e9)

    monkeypatch.setattr(_tune, "_timed", fake)
    out = tmp_path / "same"
    assert main(["tune", "--dir", data_dir, "--out", str(out), "--workload", "checkpoint", *SWEEP]) == 0
    text = capsys.readouterr().out
    assert "differ" not in text and "fastest read and write settings agree" in text
    assert _block(out)["block_size"] == 1 << 20


def test_workload_and_optimize_are_exclusive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--dir", ".", "--workload", "offload", "--optimize", "write"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--dir", ".", "--workload", "training"])


def test_real_sweep_reports_read_winner(data_dir, tmp_path, capsys):
    """On the real disk: the offload block is the final rung's best read on the backend auto uses."""
    import csv

    out = tmp_path / "real"
    assert main(["tune", "--dir", data_dir, "--out", str(out), "--workload", "offload", *SWEEP]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").read_text().splitlines()))
    auto = next(b.name for b in dsio.backend_status() if b.available)
    reads = [r for r in rows if r["status"] == "final" and r["op"] == "read" and r["backend"] == auto]
    best = max(reads, key=lambda r: float(r["gbps_median"]))
    aio = _block(out)
    assert (aio["block_size"], aio["queue_depth"]) == (int(best["block_size"]), int(best["queue_depth"]))
    assert "best read" in capsys.readouterr().out
