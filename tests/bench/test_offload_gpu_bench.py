"""bench/offload_gpu.py: the CPU dry run of the H200 script's code path, its fail-fast checks, and (``-m gpu``)
the same tiny run on CUDA so the real run cannot break on the device for a silly reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.offload_gpu import GpuBenchError, check_nvme_path, parse_args, targets  # noqa: E402

SCRIPT = str(ROOT / "bench" / "offload_gpu.py")


def _tiny(tmp_path: Path, device: str) -> dict[str, object]:
    swap = tmp_path / "swap"
    results = tmp_path / "results"  # make bench's DSIO_BENCH_RESULTS
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"DSIO_BENCH_RESULTS": str(results)}
    # on the CPU: --quick, what make bench runs (the tiny dry run); its files go under DSIO_BENCH_RESULTS
    how = ["--quick"] if device == "cpu" else ["--device", device, "--tiny"]
    cmd = [sys.executable, SCRIPT, *how, "--nvme-path", str(swap)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (found,) = results.glob("offload-gpu-*.json")
    assert found.name.endswith("-quick.json") == (device == "cpu")
    stem = found.with_suffix("")
    saved = json.loads(stem.with_suffix(".json").read_text())
    r = saved["result"]
    assert r["timed_steps"] == 2 and r["tokens_per_s"] > 0 and not r["stopped"]
    shard = 2 * r["params"]  # bf16 parameters, world 1
    moved = r["swap_bytes"]
    # Adam's m and v (fp32) read and written once per timed step
    assert moved["optimizer_read_bytes"] >= 2 * 8 * r["params"]
    assert moved["optimizer_written_bytes"] >= 2 * 8 * r["params"]
    # the parameter shards: read for the gathers, written once per step
    assert moved["param_read_bytes"] >= 2 * shard and moved["param_written_bytes"] >= 2 * shard
    assert r["swap_read_gbps"] > 0 and r["swap_write_gbps"] > 0
    probes = saved["meta"]["probes"]
    assert set(probes) == {"before training", "after training"}
    assert all(p["read_gbps"] > 0 and p["write_gbps"] > 0 for p in probes.values())
    md = stem.with_suffix(".md").read_text()
    assert "tokens/s" in md and "before training" in md
    assert "Targets (issue 32):" in md and "x the I/O floor" in md
    assert not any(swap.iterdir())  # swap files and the probe file removed
    return r


def test_cpu_dry_run(tmp_path: Path) -> None:
    _tiny(tmp_path, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_missing_fails_fast(tmp_path: Path) -> None:
    cmd = [sys.executable, SCRIPT, "--nvme-path", str(tmp_path), "--out", str(tmp_path / "x")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "torch.cuda.is_available() is False" in out.stderr and "--device cpu --tiny" in out.stderr
    assert not (tmp_path / "x.json").exists() and not list(tmp_path.iterdir())  # nothing built or written


def test_refuses_bad_arguments_and_memory_folders(tmp_path: Path) -> None:
    with pytest.raises(GpuBenchError):
        parse_args(["--steps", "0"])
    with pytest.raises(GpuBenchError):
        parse_args(["--steps", "3", "--warmup", "3"])
    assert check_nvme_path(str(tmp_path / "new")) and (tmp_path / "new").is_dir()
    shm = "/dev/shm"
    fs = subprocess.run(["stat", "-f", "-c", "%T", shm], capture_output=True, text=True).stdout.strip()
    if fs != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip(f"{shm} is not a writable tmpfs here ({fs!r})")
    with pytest.raises(GpuBenchError):
        check_nvme_path(shm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiny_run(tmp_path: Path) -> None:
    r = _tiny(tmp_path, "cuda")
    assert r["gpu_peak_gib"] > 0


def test_side_by_side_table_targets(tmp_path: Path) -> None:
    """bench/offload_gpu_table.py on known numbers: the 1.5x tokens/s and lower-GPU-peak lines, and a
    failed DeepSpeed run shown with its error instead of a ratio."""
    from bench.offload_gpu_table import load, render

    def dstrain(tps: float, peak: float) -> dict[str, object]:
        r = {"params": 2**30, "steps_s": [9.0, 4.0, 4.0], "timed_steps": 2, "tokens_per_s": tps}
        return {"result": {**r, "gpu_peak_gib": peak, "host_peak_mib": 5000.0, "stopped": ""}}

    ds = {"params": 2**30, "steps_s": [9.0, 8.0, 8.0], "timed_steps": 2, "tokens_per_s": 100.0}
    ds |= {"gpu_peak_gib": 3.0, "gpu_bytes_per_param": 3.0, "host_peak_mib": 9000.0}
    (tmp_path / "dstrain-both.json").write_text(json.dumps(dstrain(160.0, 2.0)))
    (tmp_path / "dstrain-cpu.json").write_text(json.dumps(dstrain(140.0, 4.0)))
    (tmp_path / "deepspeed-both.json").write_text(json.dumps({"error": "AssertionError: Not enough buffers"}))
    (tmp_path / "deepspeed-cpu.json").write_text(json.dumps(ds))
    (tmp_path / "probes.jsonl").write_text(json.dumps({"at": 0, "write_gbps": 2.0, "read_gbps": 1.5}) + "\n")
    text = render(load(tmp_path), "abc1234")
    assert "| dstrain both | 160 | 4.00 | 2 |" in text and "2.0 (2.00)" in text  # GiB, bytes/param
    assert "**failed**: `AssertionError: Not enough buffers`" in text
    assert "parameters + optimizer state on NVMe: no side-by-side" in text
    assert "dstrain 1.40x DeepSpeed's tokens/s (target >= 1.5x: MISSED)" in text
    assert "GPU peak 4.0 vs 3.0 GiB, 4.00 vs 3.00 B/param (NOT lower: MISSED)" in text
    assert "probe 0: write 2.00 GB/s, read 1.50 GB/s" in text


def test_targets_judge_the_step_against_the_io_floor() -> None:
    """The issue-32 line of one run on known numbers: 2 GB read at 1 GB/s + 1 GB written at 0.5 GB/s
    per step is a 4 s floor; a 4.2 s step is 1.05x (met), a 5 s step 1.25x (MISSED)."""
    probes = {
        "before training": {"read_gbps": 1.0, "write_gbps": 0.5},
        "after training": {"read_gbps": 1.0, "write_gbps": 0.5},
    }
    meta = {"args": {"warmup": 1, "offload": "both"}, "probes": probes}

    def result(step: float) -> dict[str, object]:
        swap = {"optimizer_read_bytes": 2e9, "param_read_bytes": 2e9, "optimizer_written_bytes": 2e9}
        return {"steps_s": [9.0, step, step], "timed_steps": 2, "swap_bytes": swap, "stall_s": 0.4,
                "prefetch_hits": 3, "prefetch_misses": 1}  # fmt: skip

    met = targets(meta, result(4.2))[0]
    assert "1.05x the I/O floor 4.00 s" in met and "(target <= 1.1x: met)" in met
    assert "stall fraction 0.05, prefetch hits 75%" in met
    assert "(target <= 1.1x: MISSED)" in targets(meta, result(5.0))[0]
    cpu = {**meta, "args": {"warmup": 1, "offload": "cpu"}}
    assert "nothing is swapped" in targets(cpu, {**result(4.2), "swap_bytes": {}})[0]
    assert any("DeepSpeed" in line and "not judged" in line for line in targets(meta, result(4.2)))
