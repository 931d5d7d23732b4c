"""Optimizer offload to CPU and NVMe trains bit-for-bit like no offload (2 gloo ranks, stages 1-3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, make_model, scratch_dir, spawn
from _offload_helpers import final_params, offload_config, parity_run

STEPS = 10
DEVICES = ("none", "cpu", "nvme")


CLIPPED = [(1, "nvme"), (2, "cpu"), (3, "nvme")]


def _scenarios(root: str) -> dict[str, dict[str, Any]]:
    out = {}
    for stage in (1, 2, 3):
        for device in DEVICES:
            # small sub-groups: several per rank, so read-ahead and write-behind really pipeline
            out[f"s{stage}_{device}"] = offload_config(stage, device, root, sub_group=1024)
        out[f"s{stage}_none_clip"] = offload_config(stage, "none", root, clip=0.05, sub_group=1024)
    for stage, device in CLIPPED:
        out[f"s{stage}_{device}_clip"] = offload_config(stage, device, root, clip=0.05, sub_group=1024)
    for device in ("none", "nvme"):  # bf16 compute, fp32 master in memory, Adam state swapped
        out[f"s3_{device}_bf16"] = offload_config(3, device, root, sub_group=1024, bf16=True)
    # stepping during backward (dstrain.offload.optimizer.early_step) switched off: the step steps everything
    out["s3_nvme_late"] = offload_config(3, "nvme", root, sub_group=1024)
    out["s3_nvme_late"]["zero_optimization"]["offload_optimizer"]["step_in_backward"] = False
    # persistent units stay gathered through backward (refreshed after the step)
    for device in ("none", "nvme"):
        out[f"s3_{device}_persist"] = offload_config(
            3, device, root, sub_group=1024, stage3_param_persistence_threshold=10**5
        )
    # gradient accumulation: only the last micro-batch's backward may step
    for device in ("none", "cpu", "nvme"):
        cfg = offload_config(3, device, root, sub_group=1024)
        world = cfg["train_batch_size"] // cfg["train_micro_batch_size_per_gpu"]
        cfg.update(
            train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, train_batch_size=2 * world
        )
        out[f"s3_{device}_ga2"] = cfg
    return out


@pytest.fixture(scope="module")
def runs() -> Iterator[list[dict[str, Any]]]:
    with scratch_dir("offload-parity-") as root:
        # world size is resolved inside each rank; the config dicts are built there too
        yield spawn(_build_and_run, root, world=2, start_method="forkserver")


def _build_and_run(root: str) -> dict[str, Any]:
    out = parity_run(_scenarios(root), STEPS)
    for name in ("s3_nvme", "s3_nvme_ga2"):  # again, each backward starting with its reads done
        out[f"{name}_drained"] = _drained_run(_scenarios(root)[name])
    return out


def _drained_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """`parity_run`'s entry for one config, with the optimizer's swap reads finished before every
    backward: whether backward finds a sub-group's state read in no longer depends on timing."""
    import dstrain

    engine, opt, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    try:
        losses = engine_losses(engine, STEPS, hook=lambda step, micro: opt.drain())
        params = final_params(engine)
    finally:
        engine.close()  # the last step's writes drain first: counted in the statistics
    return {"losses": losses, "params": params, "offload": opt.statistics()}


CASES = [(s, d, False) for s in (1, 2, 3) for d in ("cpu", "nvme")] + [(s, d, True) for s, d in CLIPPED]


@pytest.mark.parametrize(("stage", "device", "clip"), CASES)
def test_bitwise_identical_to_no_offload(
    runs: list[dict[str, Any]], stage: int, device: str, clip: bool
) -> None:
    suffix = "_clip" if clip else ""
    for rank_result in runs:
        base = rank_result[f"s{stage}_none{suffix}"]
        got = rank_result[f"s{stage}_{device}{suffix}"]
        assert got["losses"] == base["losses"]  # exact float equality, every step
        assert len(got["params"]) == len(base["params"])
        for a, b in zip(got["params"], base["params"], strict=True):
            assert torch.equal(a, b)
        if clip:
            assert got["grad_norm"] == base["grad_norm"]
            assert base["grad_norm"] > 0.05  # clipping really happened
        else:
            assert base["losses"][-1] < base["losses"][0]  # it trained


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_really_swapped(runs: list[dict[str, Any]], stage: int) -> None:
    for rank_result in runs:
        got = rank_result[f"s{stage}_nvme"]
        st = got["offload"]
        assert st.device == "nvme" and st.sub_groups >= 2
        sw = st.swapper
        # every step reads and writes every sub-group's m and v (plus one initial write of zeros)
        assert sw.writes == st.sub_groups * (STEPS + 1)
        assert sw.reads >= st.sub_groups * STEPS
        assert sw.written_bytes == sw.file_bytes * (STEPS + 1)
        assert st.prefetch_hits + st.prefetch_misses == st.sub_groups * STEPS
        assert sw.pinned_bytes <= st.pinned_budget
        assert sw.peak_buffers_in_use <= sw.buffers
        assert got["swap_file_exists"]  # the state really was in a file while training
        assert not got["swap_dir_after_close"]  # and the swap directory is deleted at close


@pytest.mark.parametrize(
    ("name", "base", "early"),
    [
        ("s3_cpu", "s3_none", True),
        ("s3_nvme", "s3_none", True),
        ("s3_nvme_late", "s3_none", False),
        ("s3_cpu_ga2", "s3_none_ga2", True),
        ("s3_nvme_ga2", "s3_none_ga2", True),
        ("s3_nvme_clip", "s3_none_clip", False),  # clipping needs the global norm first
        ("s3_nvme_bf16", "s3_none_bf16", True),
        ("s3_nvme_persist", "s3_none_persist", True),
        ("s3_nvme_drained", "s3_none", True),
        ("s3_nvme_ga2_drained", "s3_none_ga2", True),
    ],
)
def test_stepping_during_backward(runs: list[dict[str, Any]], name: str, base: str, early: bool) -> None:
    """Sub-groups step during the boundary backward where legal (after the first step, which records
    how often each unit reduces), bitwise the same as stepping after it; never where clipping needs
    every gradient first, nor when switched off."""
    for rank_result in runs:
        got, ref = rank_result[name], rank_result[base]
        assert got["losses"] == ref["losses"]
        for a, b in zip(got["params"], ref["params"], strict=True):
            assert torch.equal(a, b)
        st = got["offload"]
        if early and (st.device == "cpu" or name.endswith("_drained")):
            # every sub-group whose units were all reduced in backward, on every step but the first
            assert st.stepped_in_backward >= (STEPS - 1) * (st.sub_groups - 1) > 0
        elif not early:  # (on NVMe, undrained, only those whose state was read in: timing)
            assert st.stepped_in_backward == 0
        if st.device == "nvme":  # every step still reads and writes every sub-group once
            assert st.swapper.writes == st.sub_groups * (STEPS + 1)
            assert st.prefetch_hits + st.prefetch_misses == st.sub_groups * STEPS


def test_bf16_bitwise_identical_to_no_offload(runs: list[dict[str, Any]]) -> None:
    for rank_result in runs:
        base, got = rank_result["s3_none_bf16"], rank_result["s3_nvme_bf16"]
        assert got["losses"] == base["losses"]
        assert all(p.dtype == torch.bfloat16 for p in got["params"])
        for a, b in zip(got["params"], base["params"], strict=True):
            assert torch.equal(a, b)
        assert got["offload"].swapper.writes > 0
