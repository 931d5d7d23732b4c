"""1-bit Adam at ZeRO stage 1: bitwise equal to stage 0 (fp32 and bf16), its state partitioned where
it can be, checkpoints (error feedback included) restored bitwise, unsupported combinations refused."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import dstrain
from dstrain.errors import ConfigError
from tests.dstrain._dstrain_helpers import base_config, engine_losses, make_model, spawn

FREEZE = 3


def _config(stage: int, world: int = 2, **extra: Any) -> dict[str, Any]:
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": FREEZE}}
    return base_config(stage, world=world, optimizer=opt, **extra)


def _run(stage: int, root: str | None, **extra: Any) -> dict[str, Any]:
    """8 steps (freeze at 3); with ``root``: a checkpoint after step 5, and a resumed run from it."""
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=_config(stage, **extra))
    first = engine_losses(engine, 5)
    if root is not None:
        engine.save_checkpoint(os.path.join(root, f"ck{stage}"))
    saved = engine.stepper.state_dict()
    rest = engine_losses(engine, 3, start=5)
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    st = engine.stepper.statistics()
    opt_state = engine.stepper.state_dict()["state"]
    engine.close()
    out = {"losses": first + rest, "params": params, "stats": st, "state": opt_state, "saved": saved}
    if root is None:
        return out

    resumed, _, _, _ = dstrain.initialize(model=make_model(seed=7), config=_config(stage, **extra))
    resumed.load_checkpoint(os.path.join(root, f"ck{stage}"))
    restored = resumed.stepper.state_dict()
    again = engine_losses(resumed, 3, start=5)
    resumed_params = [p.detach().float().clone() for p in resumed.module.parameters()]
    resumed.close()
    return {**out, "again": again, "resumed_params": resumed_params, "restored": restored}


def _worker(root: str) -> dict[str, Any]:
    return {
        "s0": _run(0, None),
        "s1": _run(1, root),
        "s0_bf16": _run(0, None, bf16={"enabled": True}),
        "s1_bf16": _run(1, None, bf16={"enabled": True}),
        "s1_native": _native_reduce_scatter_run(),
    }


def _native_reduce_scatter_run() -> dict[str, Any]:
    # gloo's own reduce-scatter (what NCCL uses at stage 1): the reducer fills `out` with this rank's
    # slice of the local gradient after the freeze (last in the worker: the variable stays set)
    os.environ["DSTRAIN_GLOO_NATIVE_COLLECTIVES"] = "1"
    return _run(1, None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_worker, str(tmp_path_factory.mktemp("onebit_stage1")), world=2)


@pytest.mark.parametrize("suffix", ["", "_bf16"])
def test_stage_1_equals_stage_0_bitwise(runs, suffix: str) -> None:
    for r in range(2):
        s0, s1 = runs[r]["s0" + suffix], runs[r]["s1" + suffix]
        assert s1["losses"] == s0["losses"]
        for a, b in zip(s0["params"], s1["params"], strict=True):
            assert torch.equal(a, b)
    st = runs[0]["s1" + suffix]["stats"]
    assert st.frozen and st.compressed.calls == 8 - FREEZE
    assert st.compressed.wire_bytes * 28 <= st.compressed.fp32_allreduce_bytes


def test_stage_1_with_a_true_reduce_scatter_tracks_stage_0(runs) -> None:
    """The reduce-scatter sums in another order than the all-reduce, so not bitwise: close, and the
    gradient reduction really stopped at the freeze."""
    for r in range(2):
        native, s0 = runs[r]["s1_native"], runs[r]["s0"]
        assert native["losses"][:FREEZE] == pytest.approx(s0["losses"][:FREEZE], rel=1e-6)
        assert native["losses"] == pytest.approx(s0["losses"], rel=1e-3)
        assert native["stats"].skipped_reductions == 8 - FREEZE


def test_stage_1_partitions_variance_and_keeps_the_momentum_full(runs) -> None:
    def numel(state: dict[Any, Any], key: str) -> int:
        return sum(s[key].numel() for s in state.values() if key in s)

    s0, s1 = runs[0]["s0"]["state"], runs[0]["s1"]["state"]
    assert numel(s1, "exp_avg_sq") * 2 == numel(s0, "exp_avg_sq")  # v: half per rank on 2 ranks
    full = numel(s1, "full_exp_avg")
    assert full == numel(s0, "exp_avg")  # the momentum is whole after the freeze
    assert numel(s1, "worker_error") == numel(s0, "worker_error")
    assert "full_exp_avg" not in str(list(s0.values())[0].keys())


def test_stage_1_checkpoint_restores_error_feedback_and_resumes_bitwise(runs) -> None:
    for r in range(2):
        run = runs[r]["s1"]
        assert run["again"] == run["losses"][5:]
        for a, b in zip(run["params"], run["resumed_params"], strict=True):
            assert torch.equal(a, b)
        for idx, saved in run["saved"]["state"].items():
            for key in ("worker_error", "server_error", "full_exp_avg", "exp_avg", "exp_avg_sq"):
                if key in saved:
                    assert torch.equal(saved[key], run["restored"]["state"][idx][key]), key
    w0 = next(s["worker_error"] for s in runs[0]["s1"]["saved"]["state"].values() if "worker_error" in s)
    w1 = next(s["worker_error"] for s in runs[1]["s1"]["saved"]["state"].values() if "worker_error" in s)
    assert not torch.equal(w0, w1)  # per rank


def test_unsupported_stage_1_combinations_are_refused() -> None:
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=_config(1, world=1))  # valid
    engine.close()
    for extra, field in (
        ({"fp16": {"enabled": True}}, "fp16.enabled"),
        ({"gradient_clipping": 1.0}, "gradient_clipping"),
    ):
        with pytest.raises(ConfigError) as info:
            dstrain.initialize(model=make_model(), config=_config(1, world=1, **extra))
        assert info.value.field == field
    cfg = _config(1, world=1)
    cfg["optimizer"]["params"]["fused"] = False
    with pytest.raises(ConfigError) as info:
        dstrain.initialize(model=make_model(), config=cfg)
    assert info.value.field == "optimizer.params.fused"
    with pytest.raises(ConfigError) as info:
        dstrain.initialize(model=make_model(), config=_config(2, world=1))
    assert info.value.field == "zero_optimization.stage"
