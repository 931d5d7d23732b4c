"""``dsio tune`` finds the fastest read AND write settings, says when they differ, and the emitted
``"aio"`` block favours the workload named with ``--workload checkpoint|offload``."""

from __future__ import annotations

import csv
import json
import os

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
    """On the real disk: the offload block is the final rung's best read, with its backend named."""
    import csv

    out = tmp_path / "real"
    assert main(["tune", "--dir", data_dir, "--out", str(out), "--workload", "offload", *SWEEP]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").read_text().splitlines()))
    reads = [r for r in rows if r["status"] == "final" and r["op"] == "read"]
    best = max(reads, key=lambda r: float(r["gbps_median"]))
    aio = _block(out)
    assert (aio["backend"], aio["block_size"], aio["queue_depth"]) == (
        best["backend"],
        int(best["block_size"]),
        int(best["queue_depth"]),
    )
    assert aio["backend"] in [b.name for b in dsio.backend_status() if b.available]
    assert "best read" in capsys.readouterr().out


def test_ds_nvme_tune_options_with_their_meaning(data_dir, tmp_path, capsys, monkeypatch):
    """ds_nvme_tune's command line, as its users type it: several --nvme_dir (each transfer split over
    them, all at once), a DeepSpeed --sweep_config, --no_read, --io_size, --loops, --log_dir, --verbose
    and --flush_page_cache (moot under O_DIRECT, and said so)."""
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in dirs:
        d.mkdir()
    seen: dict[str, set[str]] = {"dirs": set()}

    async def fake(f, op, view, offset):
        seen["dirs"].add(os.path.dirname(f.path))
        cfg = f._ops.config
        gbps = 1.0 + (cfg.block_size == 256 << 10) + (cfg.queue_depth == 4) + 0.05 * cfg.overlap_events
        return view.numel() / (gbps * 1e9)

    monkeypatch.setattr(_tune, "_timed", fake)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(
        json.dumps(
            {
                "block_size": ["256K", "1M"],
                "queue_depth": [4, 32],
                "io_parallel": [1],
                "single_submit": [False],
                "sequential_requests": [False, True],
            }
        )
    )
    log_dir = tmp_path / "logs"
    argv = ["tune", "--nvme_dir", *map(str, dirs), "--sweep_config", str(sweep), "--no_read"]
    argv += ["--io_size", "8M", "--loops", "1", "--log_dir", str(log_dir), "--verbose", "--flush_page_cache"]
    assert main([*argv, "--finalists", "4", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert seen["dirs"] == {str(d) for d in dirs}
    from dsio._report import probe_o_direct

    direct = all(probe_o_direct(str(d)).get("o_direct") for d in dirs)  # tmpfs has no O_DIRECT
    assert ("nothing to flush" if direct else "cannot use O_DIRECT") in text
    assert "GB/s" in text and "write" in text and "args =" in text  # --verbose
    rows = list(csv.DictReader((log_dir / "dsio_tune.csv").read_text().splitlines()))
    assert {r["op"] for r in rows} == {"write"}  # --no_read
    backends = [b.name for b in dsio.backend_status() if b.available]
    screening = [r for r in rows if r["rung"] == "1"]
    assert len(screening) == len(backends) * 2 * 2 * 1 * 2  # the sweep file's grid
    assert {r["single_submit"] for r in rows} == {"False"} and {r["overlap_events"] for r in rows} == {
        "True",
        "False",
    }
    assert {int(r["block_size"]) for r in rows} == {256 << 10, 1 << 20}
    aio = json.loads((log_dir / "dsio_tune.json").read_text())["aio"]
    assert (aio["block_size"], aio["queue_depth"], aio["overlap_events"]) == (256 << 10, 4, True)
    assert aio["backend"] in backends and dsio.IOConfig.from_deepspeed(aio).backend == aio["backend"]
    for d in dirs:
        assert not [f for f in os.listdir(d) if f.startswith(".dsio")]


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ({"block_size": ["1M"], "thread_count": [1]}, "unknown key 'thread_count'"),
        ({"block_size": ["12K"]}, "not a power of two"),
        ({"queue_depth": [0]}, "not a positive int"),
        ({"single_submit": ["yes"]}, "not true/false"),
        ({"io_parallel": []}, "non-empty list"),
    ],
)
def test_a_bad_sweep_config_is_one_line_naming_the_key(data_dir, tmp_path, capsys, sweep, message):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    assert main(["tune", "--dir", data_dir, "--sweep_config", str(path), "--quiet"]) == 1
    assert message in capsys.readouterr().err


def test_no_read_and_no_write_together_and_gds_without_cuda_are_errors(data_dir, capsys):
    assert main(["tune", "--dir", data_dir, "--no_read", "--no_write", "--quiet"]) == 1
    assert "nothing to measure" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["tune", "--dir", data_dir, "--gds", "--quiet"]) == 1
        assert "CUDA" in capsys.readouterr().err
