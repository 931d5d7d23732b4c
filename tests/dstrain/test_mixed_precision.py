"""fp16 with dynamic loss scaling (overflow skips the step, hysteresis, window) and bf16, both with fp32 masters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, overflow_run, reference_losses, run_scenarios, spawn

import dstrain
from dstrain.config import FP16Config
from dstrain.precision import LossScaler


def test_scaler_halves_after_hysteresis_is_spent() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=10, hysteresis=2))
    s.update(overflow=True)
    assert s.scale == 1024  # first overflow absorbed by hysteresis
    s.update(overflow=True)
    assert s.scale == 512
    s.update(overflow=True)
    assert s.scale == 256  # budget stays spent until the scale grows again
    assert s.statistics().overflows == 3


def test_scaler_grows_after_window_and_refills_hysteresis() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    s.update(overflow=True)
    s.update(overflow=True)
    assert s.scale == 8
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 8
    s.update(overflow=False)
    assert s.scale == 16 and s.hysteresis_left == 2


def test_scaler_respects_min_scale_and_static_scale() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=1, hysteresis=1, min_loss_scale=1.0))
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == 1.0
    fixed = LossScaler(FP16Config(enabled=True, loss_scale=128.0))
    fixed.update(overflow=True)
    fixed.update(overflow=False)
    assert fixed.scale == 128.0 and fixed.overflows == 1


def test_consecutive_hysteresis_refills_after_each_good_step() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2, consecutive_hysteresis=True))
    s.update(overflow=True)
    s.update(overflow=False)
    s.update(overflow=True)
    assert s.scale == 16  # budget refilled in between, so neither overflow lowered the scale


def test_scaler_state_round_trips() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=6, hysteresis=1))
    s.update(overflow=True)
    t = LossScaler(FP16Config(enabled=True))
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_injected_inf_skips_step_world1(stage: int) -> None:
    out = overflow_run(stage, hysteresis=2, inject=[1, 2], inject_rank=0)
    assert out["changed"] == [True, False, False, True, True, True]
    assert out["scale"] == [256, 256, 128, 128, 128, 128]
    assert out["skipped"] == [0, 1, 2, 2, 2, 2]
    # the LR schedule advances after good steps only (the LR after steps 0, 1, 2 is the one of step 1)
    assert out["lr"][0] == out["lr"][1] == out["lr"][2] < out["lr"][3] < out["lr"][4]


def test_hysteresis_one_halves_at_first_overflow() -> None:
    out = overflow_run(1, hysteresis=1, inject=[1], inject_rank=0)
    assert out["scale"][:3] == [256, 128, 128]
    assert out["changed"][:3] == [True, False, True]


def _overflow_world2() -> dict[str, Any]:
    return {stage: overflow_run(stage, hysteresis=2, inject=[1, 2], inject_rank=1) for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def world2_overflow() -> list[dict[int, Any]]:
    return spawn(_overflow_world2, world=2, start_method="forkserver")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inf_on_one_rank_skips_the_step_on_all_ranks(
    stage: int, world2_overflow: list[dict[int, Any]]
) -> None:
    rank0, rank1 = world2_overflow[0][stage], world2_overflow[1][stage]
    for out in (rank0, rank1):
        assert out["changed"] == [True, False, False, True, True, True]
        assert out["scale"] == [256, 256, 128, 128, 128, 128]
        assert out["skipped"] == [0, 1, 2, 2, 2, 2]


def _precision_scenarios(world: int) -> dict[str, dict[str, Any]]:
    micro = 4 // world
    out = {}
    for stage in (0, 2, 3):
        out[f"fp16_stage{stage}"] = base_config(
            stage, world=world, micro=micro, fp16={"enabled": True, "initial_scale_power": 8}
        )
        out[f"bf16_stage{stage}"] = base_config(stage, world=world, micro=micro, bf16={"enabled": True})
    return out


def test_default_scale_overflows_then_recovers(world1_default_scale: dict[str, Any]) -> None:
    # 2**16 is too large for this model's first gradients: DeepSpeed's behaviour is to skip and halve
    out = world1_default_scale["fp16_default"]
    assert out["stats"].skipped_steps > 0
    assert out["stats"].loss_scale < 2.0**16
    assert out["losses"][-1] < 0.5 * out["losses"][0]


@pytest.fixture(scope="module")
def world1_default_scale() -> dict[str, Any]:
    return run_scenarios({"fp16_default": base_config(1, world=1, micro=4, fp16={"enabled": True})})


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(20, 4)


@pytest.fixture(scope="module")
def world1_precision() -> dict[str, Any]:
    return run_scenarios(_precision_scenarios(1))


@pytest.fixture(scope="module")
def world2_precision() -> list[dict[str, Any]]:
    return spawn(run_scenarios, _precision_scenarios(2), world=2, start_method="forkserver")


@pytest.mark.parametrize("name", list(_precision_scenarios(1)))
def test_half_precision_tracks_fp32_with_fp32_masters(
    name: str,
    world1_precision: dict[str, Any],
    world2_precision: list[dict[str, Any]],
    reference: list[float],
) -> None:
    dtype = "torch.float16" if name.startswith("fp16") else "torch.bfloat16"
    tol = 0.01 if name.startswith("fp16") else 0.02
    for out in (world1_precision[name], world2_precision[0][name]):
        assert out["dtypes"] == [dtype]
        assert out["master_dtypes"] == ["torch.float32"]
        assert out["stats"].skipped_steps == 0
        losses = out["losses"]
        assert losses == pytest.approx(reference, rel=tol, abs=tol)
        assert losses[-1] < 0.5 * losses[0]
    # the two ranks agree on every loss and end with identical weights
    assert world2_precision[1][name]["losses"] == world2_precision[0][name]["losses"]
    assert world2_precision[1][name]["checksum"] == world2_precision[0][name]["checksum"]


def test_fp16_inputs_are_cast_and_fp32_loss_scaled() -> None:
    model = torch.nn.Linear(4, 1)
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True},
    }
    engine, _, _, _ = dstrain.initialize(model=model, config=cfg)
    out = engine(torch.ones(2, 4))  # fp32 input, fp16 model
    assert out.dtype == torch.float16
    assert engine.loss_scale == 2.0**16
    engine.close()
