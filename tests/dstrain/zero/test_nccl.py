"""The ZeRO stages on NCCL with one GPU per rank (run on a 2-GPU machine; skipped without two GPUs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, overflow_run, reference_losses, run_scenarios, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group"),
]


def _scenarios() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for stage in range(4):
        out[f"stage{stage}"] = base_config(stage, world=2, micro=2)
        out[f"stage{stage}_gas2_overlap"] = base_config(stage, world=2, micro=1, gas=2)
        out[f"stage{stage}_gas2_overlap"]["zero_optimization"].update(
            overlap_comm=True, reduce_bucket_size=300
        )
        out[f"bf16_stage{stage}"] = base_config(stage, world=2, micro=2, bf16={"enabled": True})
    return out


def _run() -> dict[str, Any]:
    results = run_scenarios(_scenarios())
    results["overflow"] = {s: overflow_run(s, hysteresis=2, inject=[1, 2], inject_rank=1) for s in range(4)}
    return results


@pytest.fixture(scope="module")
def nccl() -> list[dict[str, Any]]:
    return spawn(_run, world=2, backend="nccl")


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(20, 4, device="cuda:0")


@pytest.mark.parametrize("name", list(_scenarios()))
def test_nccl_matches_single_gpu_pytorch(
    name: str, nccl: list[dict[str, Any]], reference: list[float]
) -> None:
    rank0, rank1 = nccl
    tol = 0.02 if name.startswith("bf16") else 1e-4
    assert rank0[name]["losses"] == pytest.approx(reference, rel=tol, abs=tol)
    assert rank1[name]["losses"] == rank0[name]["losses"]
    assert rank1[name]["checksum"] == pytest.approx(rank0[name]["checksum"], rel=1e-9)


@pytest.mark.parametrize("stage", range(4))
def test_nccl_fp16_overflow_skips_on_all_ranks(stage: int, nccl: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        out = nccl[rank]["overflow"][stage]
        assert out["changed"] == [True, False, False, True, True, True]
        assert out["scale"] == [256, 256, 128, 128, 128, 128]
