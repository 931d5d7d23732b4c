"""DeepSpeed's LR schedules, step by step against DeepSpeed's own code (its lrs recorded by
scripts/record_deepspeed_lr.py into fixtures/deepspeed_lr_schedules.json), and through the engine:
optimizer step k runs at the lr of iteration k - 1, so the first step's lr is warmup_min_lr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, global_batch, make_model

import dstrain
from dstrain import scheduler as schedules
from dstrain.config_sections import SchedulerConfig
from dstrain.scheduler import build_scheduler

CASES = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_lr_schedules.json").read_text())["cases"]


def _groups() -> list[dict[str, Any]]:
    return [
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.01},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.002},
    ]


def _snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    betas = [list(g["betas"]) for g in opt.param_groups] if "betas" in opt.defaults else None
    return {"lr": [float(g["lr"]) for g in opt.param_groups], "betas": betas}


@pytest.mark.parametrize("case", CASES, ids=[f"{c['type']}-{i}" for i, c in enumerate(CASES)])
def test_equal_to_deepspeed_step_by_step(case: dict[str, Any]) -> None:
    kind = case["optimizer"]
    opt = torch.optim.Adam(_groups()) if kind == "adam" else torch.optim.SGD(_groups(), lr=0.01, momentum=0.9)
    sched = getattr(schedules, case["type"])(opt, **case["params"])
    trace = [_snapshot(opt)]
    for _ in range(len(case["trace"]) - 1):
        sched.step()
        trace.append(_snapshot(opt))
    assert trace == case["trace"]  # the same float arithmetic as DeepSpeed's: equal, not close


@pytest.mark.parametrize("case", CASES, ids=[f"{c['type']}-{i}" for i, c in enumerate(CASES)])
def test_config_section_builds_the_same_schedule(case: dict[str, Any]) -> None:
    opt = torch.optim.Adam(_groups()) if case["optimizer"] == "adam" else torch.optim.SGD(_groups(), lr=0.01)
    sched = build_scheduler(opt, SchedulerConfig(type=case["type"], params=dict(case["params"])))
    sched.step()
    assert [float(g["lr"]) for g in opt.param_groups] == case["trace"][1]["lr"]


def test_state_dict_resumes_where_it_was() -> None:
    case = next(c for c in CASES if c["type"] == "WarmupCosineLR")
    opt = torch.optim.Adam(_groups())
    sched = schedules.WarmupCosineLR(opt, **case["params"])
    for _ in range(4):
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.Adam(_groups())
    resumed = schedules.WarmupCosineLR(opt2, **case["params"])
    resumed.load_state_dict(state)
    assert [g["lr"] for g in opt2.param_groups] == case["trace"][4]["lr"]
    resumed.step()
    assert [g["lr"] for g in opt2.param_groups] == case["trace"][5]["lr"]


def test_engine_first_step_runs_at_warmup_min_lr() -> None:
    cfg = base_config(0, world=1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.1,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
    }
    engine, _, _, sched = dstrain.initialize(model=make_model(), config=cfg)
    used, changed = [], []
    for step in range(4):
        before = engine.full_state_dict()["block.0.weight"]
        used.append(engine.get_lr()[0])  # what this optimizer step runs at
        loss = engine(*global_batch(step, 4))
        engine.backward(loss)
        engine.step()
        changed.append(not torch.equal(before, engine.full_state_dict()["block.0.weight"]))
    engine.close()
    # DeepSpeed: iteration -1 (min), then 0 (min + 0 x delta), 1, 2
    assert used == [0.0, 0.0, 0.025, 0.05]
    assert changed == [False, False, True, True]  # lr 0 moves nothing: the lr really is the one applied
    assert sched.last_batch_iteration == 3
