"""The Stepper seam: the engine steps, checkpoints and schedules through whatever `Stepper` it is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, engine_losses, make_model

import dstrain
from dstrain.optim import Stepper, StepperStatistics, TorchStepper


class RecordingSGD:
    """A Stepper doing plain SGD by hand over ZeRO's param groups, recording every call."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, log: list[str]) -> None:
        self._groups = [dict(g, lr=lr) for g in groups]
        self.log = log
        self.loaded: dict[str, Any] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._groups

    def prepare(self) -> None:
        self.log.append("prepare")

    def step(self) -> None:
        self.log.append("step")
        with torch.no_grad():
            for g in self._groups:
                for p in g["params"]:
                    p.add_(p.grad, alpha=-g["lr"])

    def state_dict(self) -> dict[str, Any]:
        self.log.append("state_dict")
        return {"lrs": torch.tensor([g["lr"] for g in self._groups])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log.append("load_state_dict")
        self.loaded = state

    def statistics(self) -> StepperStatistics:
        return StepperStatistics(steps=self.log.count("step"), prepares=self.log.count("prepare"))

    def close(self) -> None:
        self.log.append("close")


def test_fake_stepper_is_a_stepper_and_torch_optimizer_is_not() -> None:
    assert isinstance(RecordingSGD([], 0.1, []), Stepper)
    assert isinstance(TorchStepper(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])), Stepper)
    assert not isinstance(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), Stepper)


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_steps_only_through_the_stepper(stage: int, tmp_path: Path) -> None:
    log: list[str] = []
    cfg = base_config(stage, world=1, micro=2, gas=2, optimizer={"type": "SGD", "params": {"lr": 0.05}})
    engine, opt, _, _ = dstrain.initialize(
        model=make_model(), config=cfg, optimizer=lambda groups: RecordingSGD(groups, 0.05, log)
    )
    assert isinstance(opt, RecordingSGD) and engine.stepper is opt
    ours = engine_losses(engine, 3)
    # one prepare per accumulation boundary, always before that step; the engine never stepped itself
    assert log == ["prepare", "step"] * 3
    assert engine.get_lr() == [0.05]
    # the same SGD through torch's optimizer gives the same losses, bitwise
    ref, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    assert isinstance(ref.stepper, TorchStepper)
    assert engine_losses(ref, 3) == ours
    assert ref.stepper.statistics() == StepperStatistics(steps=3, prepares=3)
    engine.save_checkpoint(tmp_path)
    assert "state_dict" in log
    engine.load_checkpoint(tmp_path)
    assert opt.loaded is not None and torch.equal(opt.loaded["lrs"], torch.tensor([0.05]))
    engine.close()
    ref.close()
    assert log[-1] == "close"


def test_skipped_fp16_step_prepares_but_does_not_step() -> None:
    log: list[str] = []
    cfg = base_config(1, world=1, fp16={"enabled": True, "initial_scale_power": 8})
    engine, opt, _, _ = dstrain.initialize(
        model=make_model(), config=cfg, optimizer=lambda groups: RecordingSGD(groups, 0.01, log)
    )

    def poison(step: int, micro: int) -> None:
        if step == 0:
            next(engine.module.parameters()).register_hook(lambda g: g * float("inf"))

    engine_losses(engine, 2, hook=poison)
    assert engine.skipped_steps >= 1
    assert log.count("prepare") == 2 and log.count("step") == 2 - engine.skipped_steps
    engine.close()


def test_callable_returning_something_else_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        dstrain.initialize(
            model=make_model(), config=base_config(0, world=1), optimizer=lambda groups: object()
        )
