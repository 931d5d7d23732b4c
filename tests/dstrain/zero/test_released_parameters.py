"""A released ZeRO-3 parameter (outside forward, outside `GatheredParameters`) holds an empty tensor,
as DeepSpeed's do: ``p.data``, ``p.sum()``, ``p.tolist()``, ``print(p)``, ``p.clone()`` and
``module.state_dict()`` read as empty, never the unit's freed buffer (that read was a segfault).
``p.ds_shape`` / ``p.ds_numel`` and the checkpoint layout keep the whole shape. Every offload setting
(none / cpu / nvme), fp32 and bf16, and models built under zero.Init. The reads run in a child
process, so a crash is a failed test naming the setting, not a dead test run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _dstrain_helpers import run_child

HERE = Path(__file__).resolve().parent
SETTINGS = [
    "none-fp32",
    "none-bf16",
    "cpu-fp32",
    "cpu-bf16",
    "nvme-fp32",
    "nvme-bf16",
    "init-none",
    "init-nvme",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("released")
    out = run_child(
        HERE / "_released_child.py",
        root,
        [HERE.parent, HERE.parent / "offload"],
        "reading a released parameter",
        forked=True,
    )
    assert sorted(out) == sorted(SETTINGS)
    return out


@pytest.mark.parametrize("setting", SETTINGS)
def test_released_parameter_reads_as_empty(results: dict[str, dict], setting: str) -> None:
    res = results[setting]
    for when in ("initialized", "trained", "after_gather"):
        reads = res[when]
        n = len(reads["numel"])
        assert n == len(res["whole"]) > 0
        assert reads["numel"] == reads["data"] == reads["clone"] == [0] * n, when
        assert reads["sum"] == [0.0] * n and reads["tolist"] == [[]] * n and all(reads["repr"]), when
        assert reads["state_dict"] and all(k == 0 for k in reads["state_dict"]), when
        assert all(reads["grads"]), when  # gradients went into the shards: no .grad left behind


@pytest.mark.parametrize("setting", SETTINGS)
def test_whole_shape_is_kept_and_gathered_again(results: dict[str, dict], setting: str) -> None:
    res = results[setting]
    whole = [tuple(s) for s in res["whole"]]
    assert [tuple(s) for s in res["ds_shape"]] == whole
    assert res["ds_numel"] == [math.prod(s) for s in whole]
    assert sorted(tuple(s) for s in res["trainable_shapes"].values()) == sorted(whole)
    assert res["profiled_params"] == sum(math.prod(s) for s in whole)
    assert [tuple(s) for s in res["gathered_shapes"]] == whole
    assert any(s != 0.0 for s in res["gathered_sums"])  # the trained values, not the empty tensors
    assert res["state_dict_gathered"] >= sum(math.prod(s) for s in whole)
    assert math.isfinite(res["loss_after"])


@pytest.mark.parametrize("setting", SETTINGS)
def test_tensors_taken_inside_a_gather_stay_valid(results: dict[str, dict], setting: str) -> None:
    # p.data, p.cpu(), views and state_dict() values taken inside GatheredParameters keep the memory
    # they view after the block (the unit takes a new buffer): they read the gathered values
    res = results[setting]
    taken = res["taken_after_block"]
    n = len(res["whole"])
    assert taken["data"] == taken["cpu"] == taken["view"] == [True] * n
    assert sorted(taken["state_dict"]) == sorted(res["full_state_dict"]) != []
    assert res["taken_after_release_all"] == res["full_state_dict"]
