"""The optimizer's parameters are safe to read in every offload setting. With parameters and
optimizer state both on NVMe the fp32 master (and, over the budget, the gradients) live in files:
each of the optimizer's master views then holds an empty tensor of its own, ``ds_shape`` /
``ds_numel`` keep its shape and it has no ``.grad`` (reading views over storage of 0 bytes was a
segfault: ``optimizer.param_groups[0]["params"][0].sum()``); where the master stays in memory the
views hold its values. The reads (sum, clone, tolist, repr, ``.grad``, ``clip_grad_norm_``, the
state dict's shapes) run in a child process, so a crash is a failed test naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dstrain_helpers import run_child

HERE = Path(__file__).resolve().parent
EMPTIED = ["paramopt-fp32", "paramopt-bf16", "paramopt-fp32-grads", "paramopt-bf16-grads"]
RESIDENT = ["param-nvme-opt-cpu", "param-cpu-opt-cpu", "opt-nvme"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("optparams")
    out = run_child(
        HERE / "_optimizer_params_child.py",
        root,
        [HERE.parent, HERE],
        "reading the optimizer's parameters",
        forked=True,
    )
    assert sorted(out) == sorted(EMPTIED + RESIDENT)
    return out


@pytest.mark.parametrize("setting", EMPTIED)
def test_stored_master_views_read_as_empty(results: dict[str, dict], setting: str) -> None:
    res = results[setting]
    assert res["grads_on_nvme"] == setting.endswith("-grads")  # both cases are exercised
    for when in ("initialized", "trained"):
        reads = res[when]
        n = len(reads["numel"])
        assert reads["numel"] == [0] * n and reads["clone"] == [0] * n and reads["tolist"] == [0] * n
        assert reads["sum"] == [0.0] * n and all(reads["repr"])
        assert reads["grad"] == [None] * n  # no .grad over the gradient file or a view's old range
        assert reads["clip_norm"] == 0.0
        # the whole shapes stay readable, and they cover the master exactly
        assert sum(reads["ds_numel"]) == res["master_numel"]
        assert [[k] for k in reads["ds_numel"]] == reads["ds_shape"]
        if when == "trained":  # the state is per view, of the view's whole shape
            assert reads["state_shapes"] == reads["ds_shape"]
    assert res["finite"]


@pytest.mark.parametrize("setting", RESIDENT)
def test_resident_master_views_hold_values(results: dict[str, dict], setting: str) -> None:
    res = results[setting]
    reads = res["trained"]
    assert sum(reads["numel"]) == res["master_numel"]  # the views cover the master in memory
    assert reads["clone"] == reads["numel"] and reads["tolist"] == reads["numel"]
    assert all(s != 0.0 for s in reads["sum"])  # the trained values, not an empty tensor
    assert all(g == 0.0 for g in reads["grad"])  # the gradient views, zeroed after the step
    assert reads["clip_norm"] == 0.0
    assert reads["state_shapes"] == [[k] for k in reads["numel"]]
    assert reads["ds_numel"] == [None] * len(reads["numel"])
    assert res["finite"]


def test_emptied_views_train_as_resident_ones(results: dict[str, dict]) -> None:
    """Emptying the views changes nothing the optimizer steps: the losses match the run whose master
    stays in memory (parameters on NVMe, optimizer state on CPU: the same fp32 arithmetic)."""
    assert results["paramopt-fp32"]["losses"] == results["param-nvme-opt-cpu"]["losses"]
    assert results["paramopt-fp32-grads"]["losses"] == results["param-nvme-opt-cpu"]["losses"]
