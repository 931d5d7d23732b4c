"""Record DeepSpeed's learning rates (and OneCycle's betas) step by step into
tests/dstrain/fixtures/deepspeed_lr_schedules.json, the reference of tests/dstrain/test_lr_schedules.py.

    $DSIO_DEEPSPEED_VENV/bin/python scripts/record_deepspeed_lr.py

Each case builds a torch optimizer over two param groups (lrs 0.01 and 0.002), DeepSpeed's schedule
from ``deepspeed.runtime.lr_schedules`` with the case's params, and records the groups' lr (and
betas) after construction and after each of ``steps`` calls of ``scheduler.step()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime import lr_schedules

OUT = Path(__file__).resolve().parents[1] / "tests" / "dstrain" / "fixtures" / "deepspeed_lr_schedules.json"

CASES = [
    (
        "WarmupLR",
        "adam",
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"},
        8,
    ),
    ("WarmupLR", "adam", {"warmup_num_steps": 10}, 12),  # log, max = each group's lr
    (
        "WarmupLR",
        "sgd",
        {"warmup_min_lr": [0.0, 0.001], "warmup_max_lr": [0.02, 0.004], "warmup_num_steps": 4},
        6,
    ),
    (
        "WarmupDecayLR",
        "adam",
        {
            "total_num_steps": 12,
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
        15,
    ),
    ("WarmupDecayLR", "adam", {"total_num_steps": 20, "warmup_num_steps": 6}, 22),
    (
        "WarmupCosineLR",
        "adam",
        {
            "total_num_steps": 15,
            "warmup_num_steps": 5,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
            "warmup_type": "linear",
        },
        18,
    ),
    ("WarmupCosineLR", "adam", {"total_num_steps": 10, "warmup_num_steps": 3}, 12),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 6,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.1,
        },
        20,
    ),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": [1e-4, 1e-5],
            "cycle_max_lr": [1e-2, 1e-3],
            "cycle_first_step_size": 6,
            "cycle_first_stair_count": 3,
        },
        16,
    ),
    ("OneCycle", "sgd", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}, 10),
    (
        "LRRangeTest",
        "adam",
        {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0},
        10,
    ),
    (
        "LRRangeTest",
        "adam",
        {"lr_range_test_min_lr": [1e-3, 1e-4], "lr_range_test_step_size": 2, "lr_range_test_staircase": True},
        8,
    ),
]


def groups() -> list[dict]:
    return [
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.01},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.002},
    ]


def snapshot(opt: torch.optim.Optimizer) -> dict:
    return {
        "lr": [float(g["lr"]) for g in opt.param_groups],
        "betas": [list(g["betas"]) for g in opt.param_groups] if "betas" in opt.defaults else None,
    }


def main() -> None:
    out = []
    for name, kind, params, steps in CASES:
        opt = (
            torch.optim.Adam(groups()) if kind == "adam" else torch.optim.SGD(groups(), lr=0.01, momentum=0.9)
        )
        sched = getattr(lr_schedules, name)(opt, **params)
        trace = [snapshot(opt)]
        for _ in range(steps):
            sched.step()
            trace.append(snapshot(opt))
        out.append({"type": name, "optimizer": kind, "params": params, "trace": trace})
    OUT.write_text(json.dumps({"deepspeed": deepspeed.__version__, "cases": out}, indent=1) + "\n")
    print(f"{len(out)} cases -> {OUT}")


if __name__ == "__main__":
    main()
