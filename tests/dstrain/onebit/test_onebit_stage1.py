"""1-bit Adam and 0/1 Adam at ZeRO stage 1: bitwise equal to stage 0 (fp32, bf16, fp16 with overflow
steps skipped, gradient clipping), state partitioned where it can be, checkpoints (error feedback
and, for 0/1 Adam after its freeze, each rank's replica) restored bitwise, unsupported combinations
refused with a typed error."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dstrain_helpers import DIM, VOCAB, Tiny, base_config, make_model
from _onebit_workers import engine_run, register, shared_runs

import dstrain
from dstrain.errors import ConfigError
from dstrain.moe import MoE

FREEZE = 3
# 0/1 Adam: variance updates at steps 1-4, 6, 8, 10, 12, then every 4 steps; frozen after step 21, then
# local intervals 1 (4 steps), 2 (4 steps), 4 (the clipper): 40 steps cross every phase
ZEROONE = {"var_freeze_step": 20, "var_update_scaler": 4, "local_step_scaler": 4, "local_step_clipper": 4}
ZO_STEPS = 40
FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
# overflows: 1-bit Adam once in warm-up (rank 0) and once after the freeze (rank 1); 0/1 Adam in its
# variance phase, at a local step and at a synchronisation step (steps are 0-based here)
ONEBIT_INJECT = ((1, 0), (6, 1))
ZEROONE_INJECT = ((5, 0), (26, 1), (29, 0))


def _config(stage: int, world: int = 2, **extra: Any) -> dict[str, Any]:
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": FREEZE}}
    return base_config(stage, world=world, optimizer=opt, **extra)


def _zo_config(stage: int, world: int = 2, **extra: Any) -> dict[str, Any]:
    opt = {"type": "ZeroOneAdam", "params": {"lr": 1e-2, **ZEROONE}}
    return base_config(stage, world=world, optimizer=opt, **extra)


WARMUP = {
    "type": "WarmupLR",
    "params": {"warmup_num_steps": 20, "warmup_min_lr": 0.001, "warmup_max_lr": 0.005},
}


class _TinyMoE(Tiny):
    """The tiny model with an MoE layer (2 experts, ep_size 1) after its block; the aux loss added."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE(DIM, torch.nn.Linear(DIM, DIM), num_experts=2, ep_size=1, k=1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]  # (B, T, C)
        x = x + self.block(x)
        out, l_aux, _ = self.moe(x)  # (B, T, C)
        logits = self.head(self.ln(x + out))  # (B, T, V)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * l_aux


def _moe_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _TinyMoE()


def _worker(root: str) -> dict[str, Any]:
    def ck(name: str) -> str:
        return os.path.join(root, name)

    out: dict[str, Any] = {}
    for stage in (0, 1):
        # 1-bit Adam, 8 steps, freeze at 3
        out[f"s{stage}"] = engine_run(_config(stage), 8, root=ck(f"ob{stage}") if stage else None)
        out[f"s{stage}_bf16"] = engine_run(_config(stage, bf16={"enabled": True}), 8)
        out[f"s{stage}_fp16"] = engine_run(_config(stage, fp16=FP16), 12, inject=ONEBIT_INJECT)
        out[f"s{stage}_clip"] = engine_run(_config(stage, gradient_clipping=0.05), 8)
        # 0/1 Adam, 40 steps: checkpoints inside a local interval (fp32) and in the variance phase (bf16)
        out[f"zo{stage}"] = engine_run(_zo_config(stage), ZO_STEPS, root=ck(f"zo{stage}"), split=31)
        out[f"zo{stage}_bf16"] = engine_run(
            _zo_config(stage, bf16={"enabled": True}), ZO_STEPS, root=ck(f"zb{stage}"), split=10
        )
        out[f"zo{stage}_fp16"] = engine_run(
            _zo_config(stage, fp16=FP16, gradient_clipping=0.05), ZO_STEPS, inject=ZEROONE_INJECT
        )
    # composition: gradient accumulation + an LR schedule + overlap_comm; MoE layers with ep_size 1
    for stage in (0, 1):
        for name, make in (("ob", _config), ("zo", _zo_config)):
            cfg = make(stage, gas=2, micro=2, scheduler=WARMUP)
            cfg["zero_optimization"]["overlap_comm"] = True
            out[f"{name}{stage}_more"] = engine_run(cfg, 24)
            out[f"{name}{stage}_moe"] = engine_run(make(stage), 24, model_fn=_moe_model)
    # gloo's own collectives (what NCCL uses): stage 1 of a 1-bit optimizer still all-reduces the whole
    # gradient (last in the worker: the variable stays set)
    os.environ["DSTRAIN_GLOO_NATIVE_COLLECTIVES"] = "1"
    out["s1_native"] = engine_run(_config(1), 8)
    return out


register("stage1", _worker)


def _composition_refusals(root: str) -> dict[str, str | None]:
    """What is refused on 2 ranks: a 2-stage pipeline, MoE with ep_size 2 (each: the field named)."""
    from torch import nn

    from dstrain.moe import MoE
    from dstrain.pipe.module import LayerSpec, PipelineModule

    def pipe() -> nn.Module:
        layers = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 8)]
        return PipelineModule(layers, num_stages=2, loss_fn=lambda out, y: (out - y).pow(2).mean())

    def moe() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=2))

    out: dict[str, str | None] = {}
    for name, make in (("pipeline", pipe), ("moe_ep2", moe)):
        for opt in ("OneBitAdam", "ZeroOneAdam"):
            dp = 1 if name == "pipeline" else 2  # batch sizes count data-parallel ranks
            cfg = base_config(0, world=dp, optimizer={"type": opt, "params": {"lr": 1e-2}})
            try:
                engine, _, _, _ = dstrain.initialize(model=make(), config=cfg)
                engine.close()
                out[f"{name}/{opt}"] = None
            except ConfigError as e:
                out[f"{name}/{opt}"] = e.field
    return out


register("stage1_refusals", _composition_refusals)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return shared_runs("stage1")


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["skipped"] == b["skipped"] and a["loss_scale"] == b["loss_scale"]
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("suffix", ["", "_bf16", "_fp16", "_clip"])
def test_onebit_stage_1_equals_stage_0_bitwise(runs, suffix: str) -> None:
    for r in range(2):
        _assert_same(runs[r]["s0" + suffix], runs[r]["s1" + suffix])
    st = runs[0]["s1" + suffix]["stats"]
    steps = runs[0]["s1" + suffix]["stats"].steps
    assert st.frozen and st.compressed.calls == steps - FREEZE
    assert st.compressed.wire_bytes * 28 <= st.compressed.fp32_allreduce_bytes


@pytest.mark.parametrize("suffix", ["", "_bf16", "_fp16"])
def test_zeroone_stage_1_equals_stage_0_bitwise_over_40_steps(runs, suffix: str) -> None:
    for r in range(2):
        _assert_same(runs[r]["zo0" + suffix], runs[r]["zo1" + suffix])
    st = runs[0]["zo1" + suffix]["stats"]
    assert st.frozen and st.local_steps > 0 and st.local_syncs > 0
    assert st.skipped_reductions > 0 and st.compressed.calls > st.local_syncs  # + variance-phase averages
    assert st.compressed.wire_bytes * 28 <= st.compressed.fp32_allreduce_bytes


def test_fp16_overflow_steps_are_skipped_on_every_rank_as_at_stage_0(runs) -> None:
    for key, injected, steps in (("s1_fp16", ONEBIT_INJECT, 12), ("zo1_fp16", ZEROONE_INJECT, ZO_STEPS)):
        for r in range(2):
            run = runs[r][key]
            assert run["skipped"] == len(injected)  # each injected step, on both ranks, and no other
            assert run["stats"].steps == steps - len(injected)
            assert math.isinf(run["losses"][injected[0][0]]) and math.isfinite(run["losses"][-1])
            assert run["loss_scale"] == 2.0 ** (8 - len(injected))


def test_clipping_clips_the_whole_gradient_as_at_stage_0(runs) -> None:
    for key, plain in (("s1_clip", "s1"), ("zo1_fp16", None)):
        run = runs[0][key]
        assert run["engine_stats"].last_grad_norm > 0.05  # the norm was over the bound: clipping acted
        if plain is not None:
            assert run["losses"][1:] != runs[0][plain]["losses"][1:]


def test_native_collectives_still_all_reduce_the_whole_gradient(runs) -> None:
    """No reduce-scatter at stage 1 (the optimizer reads the whole gradient), so gloo's native
    collectives change nothing: bitwise stage 0, and the reduction still stops at the freeze."""
    for r in range(2):
        native = runs[r]["s1_native"]
        assert native["losses"] == runs[r]["s0"]["losses"]
        assert native["engine_stats"].comm.reduce_scatter_calls == 0
        assert native["stats"].skipped_reductions == 8 - FREEZE


def _numel(state: dict[Any, Any], key: str) -> int:
    return sum(s[key].numel() for s in state.values() if key in s)


def test_onebit_stage_1_partitions_variance_and_keeps_the_momentum_full(runs) -> None:
    s0, s1 = runs[0]["s0"]["state"], runs[0]["s1"]["state"]
    assert _numel(s1, "exp_avg_sq") * 2 == _numel(s0, "exp_avg_sq")  # v: half per rank on 2 ranks
    assert _numel(s1, "full_exp_avg") == _numel(s0, "exp_avg")  # the momentum is whole after the freeze
    assert _numel(s1, "worker_error") == _numel(s0, "worker_error")
    assert "full_exp_avg" not in str(list(s0.values())[0].keys())


def test_zeroone_stage_1_partitions_until_the_freeze_then_holds_replicas(runs) -> None:
    early0, early1 = runs[0]["zo0_bf16"]["saved"]["state"], runs[0]["zo1_bf16"]["saved"]["state"]
    for key in ("exp_avg", "exp_avg_sq", "momentum_accumulator"):  # step 10: partitioned
        assert _numel(early1, key) * 2 == _numel(early0, key), key
    assert _numel(early1, "full_exp_avg") == 0
    late0, late1 = runs[0]["zo0_bf16"]["state"], runs[0]["zo1_bf16"]["state"]
    for key in ("exp_avg", "exp_avg_sq", "momentum_accumulator"):  # after the freeze: whole, once
        assert _numel(late1, "full_" + key) == _numel(late0, key), key
        assert _numel(late1, key) == 0, key  # the slices' copies were dropped
    assert _numel(late1, "full_master") == _numel(late0, "exp_avg")  # bf16: the fp32 replica


@pytest.mark.parametrize(("key", "split"), [("s1", 5), ("zo1", 31), ("zo1_bf16", 10)])
def test_stage_1_checkpoint_restores_error_feedback_and_resumes_bitwise(runs, key: str, split: int) -> None:
    for r in range(2):
        run = runs[r][key]
        assert run["again"] == run["losses"][split:]
        for a, b in zip(run["params"], run["resumed_params"], strict=True):
            assert torch.equal(a, b)
        for idx, saved in run["saved"]["state"].items():
            for name, value in saved.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, run["restored"]["state"][idx][name]), name
    w0 = next(s["worker_error"] for s in runs[0][key]["saved"]["state"].values() if "worker_error" in s)
    w1 = next(s["worker_error"] for s in runs[1][key]["saved"]["state"].values() if "worker_error" in s)
    assert not torch.equal(w0, w1)  # per rank


def test_zeroone_checkpoint_after_the_freeze_carries_each_ranks_replica(runs) -> None:
    # the replicas differ between ranks in the last bits (a sync undoes local steps with rounding), so
    # stage 1 saves each rank's whole fp32 replica, not only its slice
    saved = [
        next(s for s in runs[r]["zo1"]["saved"]["state"].values() if "full_master" in s) for r in range(2)
    ]
    assert saved[0]["full_master"].numel() == _numel(runs[0]["zo0"]["state"], "exp_avg")
    assert runs[0]["zo1"]["saved"]["zeroone"]["frozen"]


def test_unsupported_combinations_are_refused() -> None:
    for make in (_config, _zo_config):
        engine, _, _, _ = dstrain.initialize(model=make_model(), config=make(1, world=1))  # valid
        engine.close()
        cfg = make(1, world=1)
        cfg["optimizer"]["params"]["fused"] = False
        with pytest.raises(ConfigError) as info:
            dstrain.initialize(model=make_model(), config=cfg)
        assert info.value.field == "optimizer.params.fused"
        for stage in (2, 3):
            with pytest.raises(ConfigError) as info:
                dstrain.initialize(model=make_model(), config=make(stage, world=1))
            assert info.value.field == "zero_optimization.stage"


def test_pipeline_and_expert_parallelism_are_refused_with_the_field() -> None:
    for rank in shared_runs("stage1_refusals"):
        assert rank == {
            f"{kind}/{opt}": "optimizer.type"
            for kind in ("pipeline", "moe_ep2")
            for opt in ("OneBitAdam", "ZeroOneAdam")
        }


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_offload_is_refused_with_the_field(stage: int) -> None:
    for make in (_config, _zo_config):
        cfg = make(stage, world=1)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        with pytest.raises(ConfigError) as info:
            dstrain.initialize(model=make_model(), config=cfg)
        assert info.value.field == "optimizer.type"


@pytest.mark.parametrize("kind", ["more", "moe"])
def test_stage_1_composes_with_accumulation_lr_schedule_overlap_and_moe(runs, kind: str) -> None:
    """Gradient accumulation (2 micro-steps) + WarmupLR + overlap_comm, and an MoE layer with ep_size 1:
    stage 1 equals stage 0 bitwise for both optimizers, one reduction decision per optimizer step."""
    for name in ("ob", "zo"):
        for r in range(2):
            _assert_same(runs[r][f"{name}0_{kind}"], runs[r][f"{name}1_{kind}"])
        run = runs[0][f"{name}1_{kind}"]
        assert run["stats"].steps == 24 and run["stats"].frozen
        assert math.isfinite(run["losses"][-1]) and run["losses"][-1] < run["losses"][0]
        if kind == "more":
            assert run["lr"] == [0.005]  # the schedule's, not the config's 1e-2: the optimizer reads it
    # 1-bit Adam: one (skipped) reduction per optimizer step after the freeze, not one per micro-step
    assert runs[0]["ob1_more"]["stats"].skipped_reductions == 24 - FREEZE
