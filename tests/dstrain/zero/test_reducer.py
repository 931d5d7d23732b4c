"""Gradient reduction seam: every ZeRO path reduces through the param group's `Reducer`; the queue
finishes reductions in order and bounds what is in flight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, spawn
from _zero_helpers import reducer_run

from dstrain.zero.reduce import DefaultReducer, Reducer, ReductionQueue


class _Handle:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(f"wait {self.name}")
        return True


def test_queue_bounds_in_flight_and_keeps_order() -> None:
    log: list[str] = []
    q = ReductionQueue(limit=2, keep=1)
    for i in range(3):
        q.push(_Handle(log, str(i)), lambda i=i: log.append(f"then {i}"))
    # the third push exceeded the limit: finished down to one in flight, oldest first
    assert log == ["wait 0", "then 0", "wait 1", "then 1"] and len(q) == 1
    q.drain()
    assert log[-2:] == ["wait 2", "then 2"] and len(q) == 0
    now = ReductionQueue(limit=0)
    now.push(_Handle(log, "x"))
    assert log[-1] == "wait x" and len(now) == 0


def test_default_reducer_is_a_reducer() -> None:
    assert isinstance(DefaultReducer(), Reducer)


def _configs() -> dict[str, dict[str, Any]]:
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    return {
        "stage0_overlap": base_config(
            0, world=2, micro=2, optimizer=sgd, zero_optimization={"stage": 0, "overlap_comm": True}
        ),
        "stage1": base_config(1, world=2, micro=2, optimizer=sgd),
        "stage2_overlap": base_config(
            2,
            world=2,
            micro=2,
            optimizer=sgd,
            zero_optimization={"stage": 2, "overlap_comm": True, "reduce_bucket_size": 500},
        ),
        "stage3": base_config(3, world=2, micro=2, optimizer=sgd),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(reducer_run, _configs(), world=2, start_method="forkserver")


@pytest.mark.parametrize("name", list(_configs()))
def test_every_stage_reduces_through_the_group_reducer(name: str, runs: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        r = runs[rank][name]
        assert r["default"]["calls"] == []  # the default run really used initialize's own routes
        # a reducer that only delegates changes nothing, bitwise, and is called for both groups
        assert r["recording"]["losses"] == r["default"]["losses"]
        assert all(c > 0 for c in r["recording"]["calls"])
        # a reducer that drops group 1's gradients: group 1 never moves, training still runs
        assert r["dropping"]["group1_unchanged"] and not r["default"]["group1_unchanged"]
        assert r["dropping"]["calls"][1] > 0
        assert r["dropping"]["losses"] != r["default"]["losses"]
    assert runs[0][name]["dropping"]["losses"] == runs[1][name]["dropping"]["losses"]


def test_routes_must_match_groups() -> None:
    from dstrain.config_sections import ZeroConfig
    from dstrain.dist.comm import Comm
    from dstrain.zero.dp import DataParallelZero
    from dstrain.zero.reduce import Route

    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError):
        DataParallelZero(
            [{"params": [p]}],
            stage=1,
            config=ZeroConfig(stage=1),
            comm=Comm(),
            dtype=torch.float32,
            routes=[Route(DefaultReducer(), Comm())] * 2,
        )
