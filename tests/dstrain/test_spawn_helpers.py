"""The multi-rank test launcher itself: ranks forked from the session's fork server are fresh processes
with the caller's environment (tests/_forkserver.py, `_dstrain_helpers.spawn`)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dstrain_helpers import spawn


def _probe() -> dict[str, Any]:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {
        "pid": os.getpid(),
        "env": os.environ.get("DSTRAIN_SPAWN_PROBE"),
        "leftover": os.environ.get("DSTRAIN_SPAWN_LEFTOVER"),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "seed": torch.initial_seed(),
        "np": int(np.random.randint(2**31)),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "dynamo_preloaded": "torch._dynamo" in sys.modules,  # nothing here imports it: the server did
    }


def _probe_then_poison() -> dict[str, Any]:
    out = _probe()
    torch.manual_seed(5)  # state a reused process would carry over to the next run
    os.environ["DSTRAIN_SPAWN_LEFTOVER"] = "1"
    return out


def test_forked_ranks_are_fresh_and_get_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSTRAIN_SPAWN_PROBE", "set by the test")
    first = spawn(_probe_then_poison, world=2, start_method="forkserver")
    monkeypatch.setenv("DSTRAIN_SPAWN_PROBE", "changed")
    second = spawn(_probe, world=2, start_method="forkserver")
    for rank, out in enumerate(second):
        assert out["env"] == "changed"  # the caller's environment now, not the server's
        assert out["leftover"] is None  # nothing of an earlier run's process
        assert out["rank_env"] == (str(rank), "2")
        assert out["sum"] == 3.0 and out["threads"] == 1
    assert first[0]["env"] == "set by the test"
    runs = first + second
    assert len({o["pid"] for o in runs}) == 4 and os.getpid() not in {o["pid"] for o in runs}
    # each a seed of its own, as new interpreters have (forks of one server would share one)
    assert len({o["seed"] for o in runs}) == 4 and 5 not in {o["seed"] for o in runs}
    assert len({o["np"] for o in runs}) == 4
    if os.environ.get("DSTRAIN_TESTS_SPAWN_ONLY") != "1":  # forked: what a training rank imports came along
        assert all(o["dynamo_preloaded"] for o in runs)  # a torch optimizer's first use imports it


def test_unknown_start_method_and_forked_nccl_are_refused() -> None:
    with pytest.raises(ValueError):
        spawn(_probe, world=2, start_method="fork")
    with pytest.raises(ValueError):
        spawn(_probe, world=2, backend="nccl", start_method="forkserver")
