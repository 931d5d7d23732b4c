"""bench/offload_gpu.py: the CPU dry run of the H200 script's code path, its fail-fast checks, and (``-m gpu``)
the same tiny run on CUDA so the real run cannot break on the device for a silly reason."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import _forkserver
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.offload_gpu import GpuBenchError, check_nvme_path, config, parse_args, targets  # noqa: E402

SCRIPT = str(ROOT / "bench" / "offload_gpu.py")


def _driver(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``cmd`` (``python bench/offload_gpu.py ARGS``) run in ROOT, forked from the session's fork server
    (tests/_forkserver.py: the driver's exit status and output without a new interpreter's ~2-3 CPU-s of
    imports; a CUDA run, which a fork server must not have initialized, keeps its own interpreter)."""
    assert cmd[:2] == [sys.executable, SCRIPT], cmd
    if "cuda" in cmd:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    call = functools.partial(_forkserver.script, SCRIPT, cmd[2:])
    return _forkserver.run(call, cmd, cwd=ROOT, env=env, timeout=timeout)


def _tiny(tmp_path: Path, device: str) -> dict[str, object]:
    swap = tmp_path / "swap"
    results = tmp_path / "results"  # make bench's DSIO_BENCH_RESULTS
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"DSIO_BENCH_RESULTS": str(results)}
    # on the CPU: --quick, what make bench runs (the tiny dry run); its files go under DSIO_BENCH_RESULTS
    how = ["--quick"] if device == "cpu" else ["--device", device, "--tiny"]
    cmd = [sys.executable, SCRIPT, *how, "--nvme-path", str(swap)]
    out = _driver(cmd, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (found,) = results.glob("offload-gpu-*.json")
    assert found.name.endswith("-quick.json") == (device == "cpu")
    stem = found.with_suffix("")
    saved = json.loads(stem.with_suffix(".json").read_text())
    r = saved["result"]
    assert r["timed_steps"] == 2 and r["tokens_per_s"] > 0 and not r["stopped"]
    shard = 2 * r["params"]  # bf16 parameters, world 1
    moved = r["swap_bytes"]
    # Adam's m and v (fp32) read and written once per timed step. Reads are read ahead (a sub-group's
    # state for the next step can be in flight when the window opens or closes), so the two timed steps'
    # window holds between one and three steps' worth of them: the exact `>= 2 steps` failed now and then
    # (one 16384-element sub-group short) once more of the state reads moved into backward.
    per_step = 8 * r["params"]
    assert 1 * per_step <= moved["optimizer_read_bytes"] <= 3 * per_step
    # Writes behind: the driver drains the optimizer's transfers at both ends of the window, so it
    # holds exactly the two timed steps' m,v writes (a sub-group's slot padding aside): undrained,
    # the last sub-group's write, in flight on the step thread, fell out of it now and then.
    assert 2 * per_step <= moved["optimizer_written_bytes"] < 3 * per_step
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
    known = r["gpu_memory"]["known"]
    assert set(known) == {"shards", "fp32_master", "gradient_partitions", "gathered_parameters_peak"}
    # parameters offloaded: the gathers copy each shard in (a resident shard at world size 1 would
    # be bound to, nothing gathered beyond it); what the GPU would hold of them, the rest 0 on CPU
    assert known["gathered_parameters_peak"] > 0
    return r


def test_cpu_dry_run(tmp_path: Path) -> None:
    _tiny(tmp_path, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_missing_fails_fast(tmp_path: Path) -> None:
    cmd = [sys.executable, SCRIPT, "--nvme-path", str(tmp_path), "--out", str(tmp_path / "x")]
    out = _driver(cmd, timeout=120)
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
    mem = r["gpu_memory"]
    assert "error" not in mem, mem.get("error")
    assert mem["at_peak"]["peak_bytes"] > 0 and mem["at_peak"]["by_site"]
    # The tiny run's mode is the driver's default (--offload both): parameters and optimizer state on
    # NVMe, so the shards and the fp32 master are in files, nothing of them held on the GPU (the gathers
    # copy each shard in: `_tiny` checks the gathered peak); the fp32 gradient partitions are page-locked
    # host tensors (the step runs on the host), so no fp32 state at all is held on the GPU.
    known, where = mem["known"], r["placement"]
    assert where == {"store": "OffloadedShards", "master": "file", "grads": "cpu pinned", "shards": "file"}
    assert known["shards"] == known["fp32_master"] == known["gradient_partitions"] == 0
    assert len(r["steps_s"]) == 3  # the recorded extra step is not among the measured ones


def _ds_run(tps: float, peak: float, **extra: object) -> dict[str, object]:
    r = {"params": 2**30, "steps_s": [9.0, 8.0, 8.0], "timed_steps": 2, "tokens_per_s": tps, "stopped": ""}
    return {**r, "gpu_peak_gib": peak, "gpu_bytes_per_param": peak, "host_peak_mib": 9216.0, **extra}


def _dstrain_run(tps: float, peak: float, **extra: object) -> dict[str, object]:
    r = {"params": 2**30, "steps_s": [9.0, 4.0, 4.0], "timed_steps": 2, "tokens_per_s": tps, "stopped": ""}
    r |= {"gpu_peak_gib": peak, "gpu_peak_run_gib": peak + 4, "host_peak_mib": 5120.0, **extra}
    return {"meta": {"args": {"layers": 20, "dim": 2048, "heads": 16, "vocab": 32000, "seq": 1024, "batch": 4}},
            "result": r}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", ["cpu", "optimizer"])
def test_cuda_tiny_cpu_offload_reports_the_host_master(tmp_path: Path, offload: str) -> None:
    """The H200 run's ZeRO-Offload and optimizer-on-NVMe modes in miniature: on CUDA the bench reports
    the fp32 master and the gradient partitions as page-locked host tensors and the shards on the GPU
    (HostMasterShards), and a GPU peak over the steps no larger than over the whole run."""
    cmd = [sys.executable, SCRIPT, "--device", "cuda", "--tiny", "--offload", offload]
    cmd += ["--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "r")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())["result"]
    want = {"store": "HostMasterShards", "master": "cpu pinned", "grads": "cpu pinned", "shards": "cuda"}
    assert r["placement"] == want
    assert r["timed_steps"] == 2 and r["tokens_per_s"] > 0
    assert 0 < r["gpu_peak_gib"] <= r["gpu_peak_run_gib"]


def test_side_by_side_table_targets(tmp_path: Path) -> None:
    """bench/offload_gpu_table.py on known numbers (runs.jsonl, as bench/offload_gpu_h200.sh writes it):
    the 1.5x tokens/s, lower-GPU-peak and bytes-per-parameter verdicts per mode, the tokens/s ratio in
    the table, a failed DeepSpeed run shown with its error and the steps it did instead of a ratio, a
    skipped run, and dstrain's swap against the disk probes (the I/O floor)."""
    from bench.offload_gpu_table import load, render

    cpu_where = {"store": "HostMasterShards", "master": "cpu pinned", "grads": "cpu pinned", "shards": "cuda"}
    swap = {"optimizer_read_bytes": 6e9, "param_read_bytes": 2e9, "optimizer_written_bytes": 6e9}
    lines = [
        {"name": "probe", "at": 0, "write_gbps": 2.0, "read_gbps": 1.0, "bytes": 2**30},
        {"name": "dstrain-both", "data": _dstrain_run(160.0, 2.0, swap_bytes=swap, losses=[10.0, 9.0])},
        {
            "name": "deepspeed-both",
            "data": {
                "error": "AssertionError: Not enough buffers",
                "steps_s": [20.5],
                "traceback": "Traceback:\n  File swap_in\nAssertionError: x",
            },
        },
        {"name": "dstrain-cpu", "data": _dstrain_run(140.0, 4.0, placement=cpu_where, losses=[10.0, 9.0])},
        {"name": "deepspeed-cpu", "data": _ds_run(100.0, 3.0, losses=[10.0, 9.009])},
        {"name": "dstrain-optimizer", "data": _dstrain_run(300.0, 2.5, swap_bytes=swap)},
        {"name": "deepspeed-optimizer", "data": _ds_run(100.0, 3.0)},
        {"name": "probe", "at": 1, "write_gbps": 2.0, "read_gbps": 1.0},
        {"name": "dstrain-big", "skipped": "100 s left, BIG_MIN_S 240"},
    ]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = render(load(tmp_path), "abc1234")
    assert "| dstrain both | 160 |  | 4.00 | 2 |" in text and "2.0 (2.00)" in text  # GiB, bytes/param
    assert "**failed** after 1 steps (20.5 s): `AssertionError: Not enough buffers`" in text
    assert (
        "parameters + optimizer state on NVMe: no side-by-side (dstrain: 160 tokens/s; DeepSpeed: failed"
        in text
    )
    # over 2 timed steps: per step 4 GB read at 1 GB/s + 3 GB written at 2 GB/s = a 5.5 s floor; 4 s is 0.73x
    assert "I/O floor of 5.50 s" in text and "step 4.00 s = 0.73x it (target <= 1.1x: met)" in text
    assert "| dstrain cpu | 140 | 1.40x | 4.00 |" in text and "| cpu pinned / cpu pinned |" in text
    assert "dstrain 1.40x DeepSpeed's tokens/s (target >= 1.5x: MISSED)" in text
    assert "GPU peak over the steps 4.0 vs 3.0 GiB (NOT lower: MISSED)" in text
    assert "4.00 vs 3.00 B/param (at most DeepSpeed's: MISSED)" in text
    assert "losses of the 2 steps within 1.0e-03 relative of each other" in text
    assert "dstrain 3.00x DeepSpeed's tokens/s (target >= 1.5x: met)" in text
    assert (
        "GPU peak over the steps 2.5 vs 3.0 GiB (lower: met), 2.50 vs 3.00 B/param (at most DeepSpeed's: met)"
        in text
    )
    assert "| dstrain big | skipped: 100 s left, BIG_MIN_S 240 |" in text
    assert "largest model the disk holds (dstrain alone): not measured (skipped, 100 s left" in text
    assert "probe 0: write 2.00 GB/s, read 1.00 GB/s (1 GiB)" in text and "probe 1:" in text
    tb = (
        "Traceback of deepspeed-both (last lines):\n\n```\nTraceback:\n  File swap_in\nAssertionError: x\n```"
    )
    assert tb in text
    # every table row has the header's cell count
    rows = [x for x in text.splitlines() if x.startswith("| ")]
    assert len({x.count("|") for x in rows}) == 1, rows


def test_table_reads_the_older_layout(tmp_path: Path) -> None:
    """The first H200 call's files (one JSON per run, probes.jsonl) render the same way."""
    from bench.offload_gpu_table import load, render

    (tmp_path / "dstrain-both.json").write_text(json.dumps(_dstrain_run(314.0, 12.3)))
    (tmp_path / "deepspeed-both.json").write_text(json.dumps({"error": "AssertionError: Not enough buffers"}))
    (tmp_path / "probes.jsonl").write_text(json.dumps({"at": 0, "write_gbps": 3.0, "read_gbps": 2.4}) + "\n")
    text = render(load(tmp_path), "abc1234")
    assert "| dstrain both | 314 |" in text and "| deepspeed cpu | not run |" in text
    assert "probe 0: write 3.00 GB/s, read 2.40 GB/s" in text


def test_fit_disk_sizes_the_model_to_the_free_bytes() -> None:
    """--fit-disk: the most layers whose 18 B/param of swap files fit 90% of the free bytes, at most
    --max-params; refused when not even --layers fit."""
    from bench.bigmodel import gpt_numel
    from bench.offload_gpu import fit_layers

    args = parse_args(["--dim", "2560", "--heads", "20", "--layers", "20", "--fit-disk"])
    n, why = fit_layers(args, free=50 * 2**30)
    assert gpt_numel(n, 2560, 32000, 1024) * 18 <= 0.9 * 50 * 2**30 < gpt_numel(n + 1, 2560, 32000, 1024) * 18
    assert "limited by the disk" in why and n > 20
    n, why = fit_layers(args, free=10**15)
    assert gpt_numel(n, 2560, 32000, 1024) <= 3.2e9 < gpt_numel(n + 1, 2560, 32000, 1024)
    assert "limited by --max-params" in why
    with pytest.raises(GpuBenchError):
        fit_layers(args, free=2**30)


def _quick_cmd(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        SCRIPT,
        "--quick",
        "--nvme-path",
        str(tmp_path / "swap"),
        "--out",
        str(tmp_path / "r"),
        *extra,
    ]


def test_budget_stops_before_a_step_that_would_pass_it(tmp_path: Path) -> None:
    """With a spent budget the run stops after its first timed step (the warm-up never counts), says
    so, and ZeRO-Offload's placement is recorded (on a CPU run the store is composed, nothing apart)."""
    cmd = _quick_cmd(tmp_path, "--offload", "cpu", "--time-budget-s", "0")  # (--quick: 3 steps, 1 warm-up)
    out = _driver(cmd, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())["result"]
    assert len(r["steps_s"]) == 2 and r["timed_steps"] == 1 and r["tokens_per_s"] > 0
    assert "stopped after 2 of 3 steps" in r["stopped"]
    assert r["placement"]["store"] == "HostMasterShards" and r["placement"]["master"].startswith("cpu")


def test_sigterm_writes_the_steps_done(tmp_path: Path) -> None:
    """SIGTERM (the driver's `timeout`) mid-run: the process ends non-zero with its JSON written, the
    error named and the steps done so far in it."""
    cmd = _quick_cmd(tmp_path, "--steps", "100000", "--time-budget-s", "100000")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:  # wait for two steps to be done
        if line.startswith("offload_gpu: step 2:"):
            break
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    r = json.loads((tmp_path / "r.json").read_text())["result"]
    assert r["error"].startswith("BudgetKilled") and len(r["steps_s"]) >= 2 and len(r["losses"]) >= 2
    assert "Failed** after" in (tmp_path / "r.md").read_text()
    assert not any((tmp_path / "swap").iterdir())  # swap files removed


def test_driver_records_a_run_it_has_no_time_for(tmp_path: Path) -> None:
    """bench/offload_gpu_h200.sh in its CPU dry-run mode with too little time for the big model: the
    disk probes and the skip are lines of runs.jsonl, the summary renders them, $OUT holds 3 files."""
    env = {**os.environ, "DEVICE": "cpu", "MODES": "big", "TOTAL_S": "100", "PROBE_GIB": "0.015625",
           "OUT": str(tmp_path / "out"), "NVME": str(tmp_path / "nvme"), "PY": sys.executable,
           "DSIO_DEEPSPEED_VENV": str(tmp_path / "no-venv")}  # fmt: skip
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "offload_gpu_h200.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "out" / "runs.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines] == ["probe", "dstrain-big", "probe"]
    assert "BIG_MIN_S 240" in lines[1]["skipped"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| dstrain big | skipped:" in summary and "probe 1:" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run.log", "runs.jsonl", "summary.md"]


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


def test_budget_stop_rule() -> None:
    """Stop before a step the last one says would end past the budget; never before a timed step,
    never after the last."""
    from bench.offload_gpu import budget_stop

    assert budget_stop([5.0], 4, 1, spent=100.0, budget=10.0) == ""  # only the warm-up is done
    assert "stopped after 2 of 4 steps" in budget_stop([5.0, 4.0], 4, 1, spent=7.0, budget=10.0)
    assert budget_stop([5.0, 4.0], 4, 1, spent=6.0, budget=10.0) == ""  # 6 + 4 s: exactly the budget
    assert budget_stop([5.0, 4.0, 4.0, 4.0], 4, 1, spent=100.0, budget=10.0) == ""  # all steps done


def test_config_places_what_offload_names() -> None:
    """``config(args)``: the one DeepSpeed-style config of the driver (the ZeRO-Offload experiment
    reuses it): ``--offload`` decides the sections, the sizes come from the arguments."""
    zero = config(parse_args(["--tiny", "--offload", "both"]), "/swap")["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == "/swap"
    assert zero["stage"] == 3 and zero["sub_group_size"] == 16384 and zero["offload_pinned_bytes"] == 1 << 26
    assert "offload_param" not in config(parse_args(["--offload", "optimizer"]), "/swap")["zero_optimization"]
    cpu = config(parse_args(["--offload", "cpu"]))["zero_optimization"]
    assert cpu["offload_optimizer"]["device"] == "cpu" and "offload_param" not in cpu
    with pytest.raises(GpuBenchError):
        config(parse_args(["--offload", "param"]))  # NVMe without a swap folder


def test_both_drivers_cap_the_gathered_parameters_alike() -> None:
    """With the parameters on NVMe both drivers' configs carry the same ``stage3_max_live_parameters``:
    the embedding plus one transformer layer by default (115.9M elements on the 1.07B GPT; DeepSpeed's
    1e9 kept 1.85 GiB of gathered copies on the H200), ``--max-live-params`` for both; unset in the
    modes with resident parameters (DeepSpeed's default, both sides)."""
    from bench.baselines.deepspeed_offload_gpu import ds_config
    from bench.baselines.deepspeed_offload_gpu import parse_args as ds_args

    def caps(argv: list[str]) -> tuple[object, object]:
        ours = config(parse_args(argv), "/swap")["zero_optimization"].get("stage3_max_live_parameters")
        theirs = ds_config(ds_args([*argv, "--out", "x"]))["zero_optimization"].get(
            "stage3_max_live_parameters"
        )
        return ours, theirs

    assert caps(["--offload", "both"]) == (32000 * 2048 + 12 * 2048 * 2048,) * 2 == (115_867_648,) * 2
    assert caps(["--offload", "both", "--max-live-params", "2e8"]) == (200_000_000,) * 2
    assert caps(["--offload", "optimizer"]) == (None, None)
    assert caps(["--offload", "cpu", "--max-live-params", "5e7"]) == (50_000_000,) * 2
    # DeepSpeed's twin keeps its prefetch off in that mode (its swapper asserts with it on)
    assert ds_config(ds_args(["--out", "x"]))["zero_optimization"]["stage3_prefetch_bucket_size"] == 0


def test_gpu_memory_breakdown_replays_the_trace_to_its_peak() -> None:
    """bench/gpu_memory.py on a made-up allocator snapshot: the blocks live before the step (with their
    sites) plus the step's allocations, minus its frees, at the point where the sum peaked; summed by
    allocation site (innermost dstrain/ or bench/ frame) and by category."""
    from bench.gpu_memory import UNRECORDED, category, peak_breakdown, site

    def fr(path: str, name: str) -> list[dict[str, object]]:
        return [{"filename": "/x/torch/nn/functional.py", "name": "linear"}, {"filename": path, "name": name}]

    shards = fr("/repo/dstrain/zero/units.py", "place")
    baseline = {
        "segments": [
            {
                "blocks": [
                    {"address": 0, "size": 100, "state": "active_allocated", "frames": shards},
                    {"address": 100, "size": 50, "state": "inactive"},
                    {"address": 200, "size": 7, "state": "active_allocated", "frames": []},
                    {"address": 300, "size": 5, "state": "active_awaiting_free", "frames": shards},
                ]
            }
        ]
    }
    act = fr("/repo/bench/train.py", "forward")
    gather = fr("/repo/dstrain/zero/gather.py", "start")
    events = [
        {"action": "alloc", "addr": 1000, "size": 40, "frames": act},
        {"action": "alloc", "addr": 2000, "size": 30, "frames": gather},
        {"action": "free_requested", "addr": 1000, "size": 40},
        {"action": "free_completed", "addr": 1000, "size": 40},  # 137 live after the peak of 177
        {"action": "alloc", "addr": 3000, "size": 20, "frames": act},
        {"action": "free_completed", "addr": 9999, "size": 500},  # a block it never saw: not counted
    ]
    events.insert(0, {"action": "free_completed", "addr": 300, "size": 5})  # the awaiting one, freed first
    got = peak_breakdown({"device_traces": [events]}, baseline)
    assert got["start_bytes"] == 112 and got["peak_bytes"] == 177 and got["events"] == 7
    assert got["by_site"] == {
        "dstrain/zero/units.py:place": 100,
        "bench/train.py:forward": 40,
        "dstrain/zero/gather.py:start": 30,
        UNRECORDED: 7,
    }
    assert got["by_category"]["gathered parameters"] == 30
    assert got["by_category"]["model activations (bench/train.py's GPT)"] == 40
    assert sum(got["by_category"].values()) == 177
    assert site([{"filename": "/usr/lib/torch/autograd/graph.py", "name": "backward"}]).endswith(
        "graph.py:backward"
    )
    assert category("torch (no Python frame)").startswith("autograd")
    top = peak_breakdown({"device_traces": [events]}, baseline, top=2)["by_site"]
    assert list(top) == ["dstrain/zero/units.py:place", "bench/train.py:forward", "(the rest)"]
    assert top["(the rest)"] == 37


def test_side_by_side_table_shows_dstrains_gpu_memory(tmp_path: Path) -> None:
    """The table of a device call prints each dstrain run's GPU memory breakdown (bytes per parameter),
    so one call attributes the peak; run as a script, as bench/offload_gpu_h200.sh does."""
    mem = {
        "known": {
            "shards": 2 * 2**30,
            "fp32_master": 0,
            "gradient_partitions": 0,
            "gathered_parameters_peak": 2**29,
        },
        "at_peak": {
            "start_bytes": 3 * 2**30,
            "peak_bytes": 5 * 2**30,
            "events": 10,
            "by_site": {"dstrain/zero/units.py:place": 2 * 2**30, "bench/train.py:forward": 3 * 2**30},
            "by_category": {"model activations (bench/train.py's GPT)": 3 * 2**30, "shards": 2 * 2**30},
        },
    }
    run = _dstrain_run(4000.0, 5.0, gpu_memory=mem)
    (tmp_path / "runs.jsonl").write_text(json.dumps({"name": "dstrain-cpu", "data": run}) + "\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "offload_gpu_table.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GPU memory, dstrain cpu" in out.stdout
    assert "`bench/train.py:forward` 3.00 GiB (3.00 B/param)" in out.stdout  # params 2**30
    assert "shards 2.00 GiB (2.00 B/param)" in out.stdout


def test_known_gathered_bytes_are_what_lies_beyond_the_shards() -> None:
    """The breakdown's ``gathered_parameters_peak`` is the gathered units' peak beyond the shards
    (listed on their own): 0 for ZeRO-Offload at world size 1, where a pass binds the parameters to
    the shards themselves (the bench's config: the optimizer on the CPU, the master on the host)."""
    pytest.importorskip("dsio._C", reason="dsio's native core is not built here")
    import dstrain
    from bench.gpu_memory import known_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
        },
    }
    engine = dstrain.initialize(model=model, config=cfg)[0]
    try:
        for _ in range(2):
            loss = engine(torch.randn(2, 32)).square().mean()
            engine.backward(loss)
            engine.step()
        known = known_bytes(engine)
        stats = engine.statistics().zero
    finally:
        engine.close()
    assert stats.prefetches > 0 and stats.peak_resident_param_numel == stats.master_numel
    assert known["gathered_parameters_peak"] == 0
