"""bench/offload.py: the report's arithmetic and target lines on known numbers, and one real tiny run.

The tiny run launches 2 gloo ranks with dstrain's NVMe optimizer offload on a 0.3M-parameter MLP and
checks that the bytes dstrain's counters say it swapped equal the formula (and what the kernel saw
the processes move), that the report, JSON and PNG are written, and that prefetch/stall are filled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.offload import QUICK_METHODS, BenchError, default_stem, parse_args, worker_env  # noqa: E402
from bench.offload import ROOT as BENCH_ROOT  # noqa: E402
from bench.offload_methods import METHODS, SHAPES, Method, expected_bytes  # noqa: E402
from bench.offload_report import _error_line, summarize, targets  # noqa: E402
from bench.offload_worker import ds_config, offload_counters  # noqa: E402


def _rank(step: float, rss: float, **extra: float) -> dict[str, float]:
    return {"median_step_s": step, "peak_rss_mib": rss, "params": 1_000_000, "losses": [1.0, 0.9], **extra}


def _run(method: str, step: float, rss: float, **extra: float) -> dict[str, object]:
    return {
        "shape": "mlp",
        "method": method,
        "rep": 0,
        "ranks": [_rank(step, rss, **extra), _rank(step, rss, **extra)],
    }


SWAP = {"optimizer_read_bytes_per_step": 4e6, "optimizer_written_bytes_per_step": 4e6}
COUNTERS = {"stall_s_per_step": 0.01, "hits": 9, "misses": 1, "pinned_bytes": 1 << 20}
PROBES = [{"read_gbps": 1.0, "write_gbps": 1.0}]


def test_targets_met_missed_and_not_applicable() -> None:
    runs = [
        _run("dstrain-cpu", 0.40, 600),
        _run("dstrain-nvme", 0.45, 590, **SWAP, **COUNTERS),
        _run("deepspeed-cpu", 0.60, 1000),
        _run("deepspeed-nvme", 1.00, 950),
    ]
    s = summarize(runs, PROBES)
    row = s["shapes"]["mlp"]["dstrain-nvme"]
    assert row["swap_bytes_per_step"] == {"optimizer_read": 8e6, "optimizer_written": 8e6}
    assert row["io_floor_s"] == pytest.approx(0.016)  # 8 MB read + 8 MB written at 1 GB/s each
    assert row["prefetch_hit_rate"] == pytest.approx(0.9)
    assert row["stall_fraction"][0] == pytest.approx(0.01 / 0.45)
    lines = targets(s, "mlp")
    assert "2.22x faster" in lines[0] and "MISSED" not in lines[0]
    assert "1.12" in lines[1] and ": met" in lines[1]
    assert "1.50x" in lines[2] and "met" in lines[2]

    slow = [*runs[:1], _run("dstrain-nvme", 0.80, 990, **SWAP, **COUNTERS), *runs[2:]]
    lines = targets(summarize(slow, PROBES), "mlp")
    assert "MISSED" in lines[0] and "NOT lower" in lines[0] and "limit:" in lines[0]
    assert "MISSED" in lines[1] and "I/O floor 0.016 s" in lines[1]

    # the disk too slow for the step: the NVMe/CPU target does not apply to this shape
    lines = targets(summarize(slow, [{"read_gbps": 0.01, "write_gbps": 0.01}]), "mlp")
    assert "not applicable" in lines[1]


def test_params_and_optimizer_on_nvme_target_lines() -> None:
    """Issue 32: step / CPU-offload step <= 1.15; the stall fraction where the I/O floor is below
    compute, else the step against 1.1x the floor; overlap figures reported either way."""
    both = {**SWAP, "param_read_bytes_per_step": 4e6, "param_written_bytes_per_step": 4e6}
    early = {**COUNTERS, "stepped_in_backward": 8}
    runs = [_run("dstrain-cpu", 0.40, 600), _run("dstrain-paramopt-nvme", 0.44, 580, **both, **early)]
    lines = targets(summarize(runs, PROBES), "mlp")
    ratio, overlap = lines[-2], lines[-1]
    assert "params + optimizer NVMe / dstrain CPU step: 1.10 (target <= 1.15: met)" in ratio
    assert "prefetch hits 90%" in ratio and "stepped in backward 80%" in ratio
    # 16 MB read + 16 MB written at 1 GB/s: floor 0.032 s < compute 0.40 s; stall 0.01 / 0.44
    assert (
        "I/O floor 0.032 s < compute" in overlap and "stall fraction 0.02" in overlap and ": met" in overlap
    )
    # counters by kind: stepped in backward is a share of the optimizer's sub-group steps (8 of 10),
    # not of every prefetch (125 gathers + 10 sub-groups); hits and stalls shown per kind
    kinds = {**early, "hits": 49, "misses": 86, "hits_param": 40, "misses_param": 85, "hits_optimizer": 9}
    kinds |= {"misses_optimizer": 1, "stall_s_param_per_step": 0.008, "stall_s_optimizer_per_step": 0.002}
    split = [runs[0], _run("dstrain-paramopt-nvme", 0.44, 580, **both, **kinds)]
    ratio = targets(summarize(split, PROBES), "mlp")[-2]
    assert "stepped in backward 80% of the sub-groups" in ratio
    assert "prefetch hits gathers 32%, optimizer 90%" in ratio
    assert "(gathers 0.008 s, optimizer 0.002 s per step)" in ratio
    slow = [runs[0], _run("dstrain-paramopt-nvme", 0.60, 580, **both, **{**early, "stall_s_per_step": 0.2})]
    ratio, overlap = targets(summarize(slow, PROBES), "mlp")[-2:]
    assert "1.50 (target <= 1.15: MISSED)" in ratio and "limit:" in ratio
    assert "stall fraction 0.33 (target <= 0.05: MISSED)" in overlap
    # the disk slower than compute: the step is held against 1.1x the I/O floor
    ratio, overlap = targets(summarize(slow, [{"read_gbps": 0.05, "write_gbps": 0.05}]), "mlp")[-2:]
    assert (
        "I/O floor 0.640 s >= compute 0.400 s" in overlap
        and "0.94x the floor (target <= 1.1x: met)" in overlap
    )


def test_worker_env_keeps_the_callers_pythonpath() -> None:
    # on the GPU machine the wheels live on PYTHONPATH (pip --target): the workers must still see them
    env = worker_env({"PYTHONPATH": "/opt/wheels:/other", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BENCH_ROOT), "/opt/wheels", "/other"]
    assert env["HOME"] == "/h" and env["OMP_NUM_THREADS"] == "1" and env["DS_ACCELERATOR"] == "cpu"
    assert worker_env({})["PYTHONPATH"] == str(BENCH_ROOT)


def test_failed_rows_name_the_ranks_exception() -> None:
    err = (
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]: dstrain.errors.NotImplementedConfigError: zero_optimization.offload_param.device: nope\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert _error_line(err).startswith("dstrain.errors.NotImplementedConfigError: zero_optimization")
    s = summarize([{"shape": "mlp", "method": "dstrain-paramopt-nvme", "rep": 0, "error": err}], PROBES)
    assert "NotImplementedConfigError" in s["shapes"]["mlp"]["dstrain-paramopt-nvme"]["error"]


def test_expected_bytes_formulas() -> None:
    p = 16_801_800
    ours, text = expected_bytes(METHODS["dstrain-nvme"], p)
    assert ours == {"optimizer": 16 * p} and "8,400,900" in text
    theirs, _ = expected_bytes(METHODS["deepspeed-nvme"], p)
    assert theirs == {"optimizer": 32 * p}
    both, text = expected_bytes(METHODS["dstrain-paramopt-nvme"], p)
    assert both == {"optimizer": 16 * p, "param": 16 * p} and "param" in text
    # gradients on NVMe too (the budget below the gradient shards): written once, read once, 4 B each
    allin, text = expected_bytes(METHODS["dstrain-paramopt-nvme"], p, grads_on_nvme=True)
    assert allin == {"optimizer": 16 * p, "param": 16 * p, "grad": 8 * p} and "grad" in text
    assert expected_bytes(METHODS["dstrain-cpu"], p)[0] == {}


def test_counters_walk_nested_snapshots_once() -> None:
    @dataclasses.dataclass(frozen=True)
    class Sw:
        kind: str
        path: str
        read_bytes: int
        written_bytes: int
        pinned_bytes: int

    @dataclasses.dataclass(frozen=True)
    class Opt:
        stall_seconds: float
        prefetch_hits: int
        prefetch_misses: int
        stepped_in_backward: int
        swapper: Sw

    @dataclasses.dataclass(frozen=True)
    class Store:  # the parameter store: its prefetch counters count the gathers' shard reads
        holds_master: bool
        stall_seconds: float
        prefetch_hits: int
        prefetch_misses: int
        master_from_gathers_bytes: int = 0
        gathers_from_step_bytes: int = 0
        gathers_reused_bytes: int = 0

    @dataclasses.dataclass(frozen=True)
    class Eng:
        zero: object
        offload: list[object]

    opt = Opt(0.5, 3, 1, 2, Sw("optimizer", "/a", 10, 20, 7))
    par = Sw("param", "/b", 100, 50, 5)

    class Src:
        def __init__(self, snap: object) -> None:
            self.snap = snap

        def statistics(self) -> object:
            return self.snap

    # the optimizer's snapshot reachable both from the optimizer and from the engine: counted once
    c = offload_counters(Src(opt), Src(Eng(zero=opt, offload=[par])))
    assert c == {
        "stall_s": 0.5, "hits": 3, "misses": 1, "pinned_bytes": 12, "in_backward": 2,
        "stall_s_optimizer": 0.5, "hits_optimizer": 3, "misses_optimizer": 1,
        "optimizer_read_bytes": 10, "optimizer_written_bytes": 20, "param_read_bytes": 100, "param_written_bytes": 50,
    }  # fmt: skip
    # the gathers' counters are kept apart from the optimizer's (and summed into the totals)
    both = offload_counters(Src(opt), Src(Store(True, 0.25, 40, 60, 4096)))
    assert both is not None and both["hits_param"] == 40 and both["misses_param"] == 60
    assert both["master_from_gathers_bytes"] == 4096  # master bytes not read from the file
    assert both["hits_optimizer"] == 3 and both["hits"] == 43 and both["stall_s_param"] == 0.25
    assert offload_counters(object(), Src(None)) is None
    # gradient swaps are their own kind, not lumped into the optimizer's
    g = offload_counters(Src(Eng(zero=opt, offload=[Sw("grad", "/c", 1000, 2000, 3)])))
    assert g is not None and g["grad_read_bytes"] == 1000 and g["optimizer_read_bytes"] == 10


def test_cli_refuses_unknown_names() -> None:
    with pytest.raises(BenchError):
        parse_args(["--shapes", "mlp,resnet"])
    with pytest.raises(BenchError):
        parse_args(["--methods", "dstrain-nvme,deepspeed-tape"])
    with pytest.raises(BenchError):
        parse_args(["--steps", "2"])
    a = parse_args(["--tiny"])
    assert a.reps == 1 and not any(m.startswith("deepspeed") for m in a.method_list)
    # --quick (make bench): tiny, 1 rep, both shapes, the rows the target lines compare
    q = parse_args(["--quick"])
    assert q.tiny and q.reps == 1 and q.method_list == list(QUICK_METHODS) and q.shape_list == list(SHAPES)
    assert Path(default_stem(q, "/r")).name.endswith("-quick") and Path(default_stem(q, "/r")).parent == Path(
        "/r"
    )
    assert not default_stem(a, "/r").endswith("-quick")
    assert parse_args(["--quick", "--methods", "dstrain-nvme"]).method_list == ["dstrain-nvme"]
    assert {"dstrain-param-cpu", "dstrain-paramopt-nvme"} <= set(parse_args([]).method_list)
    with pytest.raises(ValueError):
        Method(name="x", impl="dstrain", optimizer="disk")
    with pytest.raises(ValueError):
        dataclasses.replace(SHAPES["mlp"], steps=0)


@pytest.mark.usefixtures("child_tmpdir")  # the torchrun's torchelastic_* folder goes with tmp_path
def test_tiny_run_swaps_the_formulas_bytes(tmp_path: Path) -> None:
    results = tmp_path / "results"  # make bench's DSIO_BENCH_RESULTS: files go there, not bench/results
    env = {**os.environ, "DSIO_BENCH_DIR": str(tmp_path / "scratch"), "DSIO_BENCH_RESULTS": str(results)}
    cmd = [sys.executable, str(ROOT / "bench" / "offload.py"), "--quick", "--shapes", "mlp",
           "--methods", "dstrain-nvme"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (found,) = results.glob("offload-*-quick.json")
    stem = found.with_suffix("")
    saved = json.loads(stem.with_suffix(".json").read_text())
    row = saved["summary"]["shapes"]["mlp"]["dstrain-nvme"]
    swapped = row["swap_bytes_per_step"]
    total = swapped["optimizer_read"] + swapped["optimizer_written"]
    # m and v of each rank's shard, read and written once per step; sub-groups padded to 4 KiB
    assert row["expected_bytes_per_step"] <= total <= row["expected_bytes_per_step"] * 1.02 + 2 * 4 * 4096
    # what the kernel saw the rank processes move through the disk (O_DIRECT): the same bytes
    assert row["disk_bytes_per_step"]["read"] >= swapped["optimizer_read"]
    assert row["prefetch_hit_rate"] is not None and 0 <= row["stall_fraction"][0] <= 1
    assert row["io_floor_s"] > 0
    md = stem.with_suffix(".md").read_text()
    assert "| dstrain-nvme |" in md and "2 x 8 B x" in md and "Targets (issues 11 and 32)" in md
    assert stem.with_suffix(".png").stat().st_size > 0
    assert not list((tmp_path / "scratch").iterdir())  # the scratch folder is left empty


def test_shapes_run_every_method() -> None:
    # dstrain steps the master in page-aligned pieces when parameters and optimizer state are both on
    # NVMe: sub_group_size must be a multiple of 1024 elements or initialize refuses the paramopt row
    for shape in SHAPES.values():
        assert shape.sub_group % 1024 == 0 and shape.tiny().sub_group % 1024 == 0


def test_both_libraries_get_gradient_clipping_written_out(tmp_path: Path) -> None:
    """DeepSpeed clips at 1.0 when the key is absent and dstrain does not clip: the shared config must say 0.0,
    or DeepSpeed's GPT losses part from dstrain's at the second step (offload-2026-11-30-shapes.md)."""
    for name in ("dstrain-nvme", "deepspeed-nvme", "deepspeed-cpu"):
        cfg = ds_config(SHAPES["gpt110m"], METHODS[name], str(tmp_path), 64 << 20)
        assert cfg["gradient_clipping"] == 0.0, name


def test_paramopt_bytes_line_counts_assembled_master_ranges_as_reads_saved() -> None:
    from bench.offload_report import _paramopt_bytes

    params = 1_000_000  # 4 MB of fp32 shards over all ranks
    row = {
        "params": params,
        "swap_bytes_per_step": {
            "param_read": 7e6,
            "master_from_gathers": 4e6,
            "gather_from_step": 1e6,
            "gather_reused": 2e6,
            "param_written": 4e6,
        },
    }
    (line,) = _paramopt_bytes(row)
    assert (
        "read 7 MB + master ranges assembled from the gathers' shards 4 MB + the pass's first shard" in line
    )
    assert "kept from the step 1 MB + backward gathers served by the buffers of their forward gather" in line
    assert "gather 2 MB = 14 MB = 3.50x" in line
    assert "written 4 MB = 1.00x" in line
    assert _paramopt_bytes({"params": params, "swap_bytes_per_step": {"optimizer_read": 1.0}}) == []
