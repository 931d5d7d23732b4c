"""1-bit Adam composed into dstrain.initialize: the reducer stops at the freeze, the stepper compresses
momentum, losses equal a hand-written loop, checkpoints carry the error feedback, bad configs refused."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dstrain_helpers import base_config, engine_losses, global_batch, make_model, spawn
from _onebit_workers import engine_run, register, shared_runs

import dstrain
from dstrain.errors import ConfigError
from dstrain.onebit import OneBitAdam, ZeroOneAdam
from dstrain.zero.flat import ALIGN

FREEZE = 3


# 0/1 Adam: variance steps 1, 2 and 4 (step 3 averages its gradient compressed), frozen after 4,
# then local intervals 1, 1, 2, 2: steps 5, 6, 8 synchronise, step 7 sends nothing
ZEROONE = {"var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 2}


def _config(world: int = 2, **params: Any) -> dict[str, Any]:
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": FREEZE, **params}}
    return base_config(0, world=world, optimizer=opt)


def _zeroone_config(**params: Any) -> dict[str, Any]:
    opt = {"type": "ZeroOneAdam", "params": {"lr": 1e-2, **ZEROONE, **params}}
    return base_config(0, world=2, optimizer=opt)


def _onebit(params: list[torch.Tensor]) -> OneBitAdam:
    return OneBitAdam(params, lr=1e-2, freeze_step=FREEZE)


def _zeroone(params: list[torch.Tensor]) -> ZeroOneAdam:
    return ZeroOneAdam(params, lr=1e-2, **ZEROONE)


def _reference(steps: int, make_opt: Any = _onebit) -> list[float]:
    """The same training written by hand: per-rank micro-batches, gradients averaged while the optimizer
    asks for it, OneBitAdam over the parameters in module order, zero-padded to a whole number of
    ``world x ALIGN`` elements (the engine's flat layout)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    params = list(model.parameters())  # tied weights appear once, as in the engine's flat buffer
    total = sum(p.numel() for p in params)
    pad = torch.zeros(-total % (world * ALIGN))
    opt = make_opt([torch.nn.Parameter(torch.cat([*(p.detach().reshape(-1) for p in params), pad]))])
    flat = opt.param_groups[0]["params"][0]
    losses = []
    for step in range(steps):
        offset = 0
        for p in params:  # the module computes with views of the flat master
            p.data = flat.data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        idx, targets = global_batch(step, 8)
        lo = rank * 4
        for p in params:
            p.grad = None
        loss = model(idx[lo : lo + 4], targets[lo : lo + 4])
        (loss / world).backward()
        grad = torch.cat([*(p.grad.reshape(-1) for p in params), pad])
        if opt.reduces_gradients():
            dist.all_reduce(grad)
        else:
            grad.mul_(world)
        flat.grad = grad
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append((t / world).item())
    return losses


def _worker(root: str) -> dict[str, Any]:
    onebit = engine_run(_config(cuda_aware=False, comm_backend_name="nccl"), 8, root=os.path.join(root, "ob"))
    zeroone = engine_run(_zeroone_config(comm_backend_name="nccl"), 8, root=os.path.join(root, "zo"))
    return {
        **onebit,
        "reference": _reference(8),
        "zeroone": {**zeroone, "reference": _reference(8, _zeroone)},
    }


register("engine", _worker)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return shared_runs("engine")


def test_engine_equals_hand_written_loop_bitwise(runs) -> None:
    assert runs[0]["losses"] == runs[0]["reference"]


def test_gradients_stop_being_reduced_at_the_freeze(runs) -> None:
    st = runs[0]["stats"]
    assert st.frozen and st.steps == 8
    assert st.skipped_reductions == 8 - FREEZE  # one flat gradient per step after the freeze
    assert st.compressed.calls == 8 - FREEZE
    assert st.compressed.wire_bytes * 28 <= st.compressed.fp32_allreduce_bytes
    for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
        assert torch.equal(a, b)  # replicas stay identical without any gradient all-reduce


def test_checkpoint_resume_after_freeze_is_bitwise(runs) -> None:
    for r in range(2):
        assert runs[r]["again"] == runs[r]["losses"][5:]
        for a, b in zip(runs[r]["params"], runs[r]["resumed_params"], strict=True):
            assert torch.equal(a, b)


def test_zeroone_engine_equals_hand_written_loop_and_resumes_bitwise(runs) -> None:
    for r in range(2):
        zo = runs[r]["zeroone"]
        assert zo["losses"] == zo["reference"]
        assert zo["again"] == zo["losses"][5:]
        for a, b in zip(zo["params"], zo["resumed_params"], strict=True):
            assert torch.equal(a, b)
    st = runs[0]["zeroone"]["stats"]
    assert st.frozen and st.steps == 8
    assert st.skipped_reductions == 8 - 3  # reduced on variance steps 1, 2, 4 only
    assert (st.local_syncs, st.local_steps) == (3, 1)
    assert st.compressed.calls == 1 + 3  # step 3's gradient, three synchronisations
    assert st.compressed.wire_bytes * 28 <= st.compressed.fp32_allreduce_bytes


def test_zeroone_config_refusals() -> None:
    for key, value, field in (
        ("amsgrad", True, "optimizer.params.amsgrad"),
        ("eps_inside_sqrt", True, "optimizer.params.eps_inside_sqrt"),
        ("local_step_clipper", 0, "optimizer.params"),
        ("freeze_step", 3, "optimizer.params"),
    ):
        cfg = _zeroone_config(**{key: value})
        cfg["train_batch_size"] = 4
        with pytest.raises(ConfigError) as info:
            dstrain.initialize(model=make_model(), config=cfg)
        assert info.value.field.startswith(field), (key, info.value.field)
    cfg = _zeroone_config(amsgrad=False, cuda_aware=False)
    cfg["train_batch_size"] = 4
    cfg["zero_optimization"]["stage"] = 2  # stage 1: tests/dstrain/onebit/test_onebit_stage1.py
    with pytest.raises(ConfigError) as info:
        dstrain.initialize(model=make_model(), config=cfg)
    assert info.value.field == "zero_optimization.stage"
    for stage in (0, 1):
        cfg["zero_optimization"]["stage"] = stage
        engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
        assert isinstance(engine.optimizer, ZeroOneAdam)
        engine.close()


def test_stage_2_and_unknown_keys_are_refused() -> None:
    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=_config(world=1)
    )  # the valid config works
    assert isinstance(engine.optimizer, OneBitAdam)
    engine.close()
    cfg = _config(world=1)
    cfg["zero_optimization"]["stage"] = 2  # stage 1: tests/dstrain/onebit/test_onebit_stage1.py
    with pytest.raises(ConfigError, match="stage"):
        dstrain.initialize(model=make_model(), config=cfg)
    with pytest.raises(ConfigError, match="freeze_steps"):
        dstrain.initialize(model=make_model(), config=_config(world=1, freeze_steps=3))
    with pytest.raises(ConfigError, match="freeze_step"):
        dstrain.initialize(model=make_model(), config=_config(world=1, freeze_step=0))


# -- CUDA / NCCL (the lead runs these on the 2x H200 machine: pytest -m gpu) ----------------------


def _nccl_engines() -> dict[str, Any]:
    out = {}
    for name, cfg in (
        ("onebit_s0", _config()),
        ("onebit_s1", _stage(_config(), 1)),
        ("onebit_s1_bf16", {**_stage(_config(), 1), "bf16": {"enabled": True}}),
        ("zeroone", _zeroone_config()),
        ("zeroone_s1", _stage(_zeroone_config(), 1)),
        (
            "zeroone_s1_fp16",
            {**_stage(_zeroone_config(), 1), "fp16": {"enabled": True}, "gradient_clipping": 1.0},
        ),
    ):
        engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
        assert next(engine.module.parameters()).is_cuda
        losses = engine_losses(engine, 8)
        out[name] = {"losses": losses, "stats": engine.stepper.statistics()}
        engine.close()
    return out


def _stage(cfg: dict[str, Any], stage: int) -> dict[str, Any]:
    cfg["zero_optimization"]["stage"] = stage
    return cfg


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group")
def test_onebit_and_zeroone_engines_on_nccl_cuda(runs) -> None:
    """The engine on CUDA over NCCL: 1-bit Adam at stages 0 and 1, 0/1 Adam at stages 0 and 1 (fp32, and
    fp16 with clipping): the same schedule as on gloo, losses close to the gloo runs (CUDA rounds
    differently: not bitwise)."""
    res = spawn(_nccl_engines, world=2, backend="nccl")[0]
    for name in ("onebit_s0", "onebit_s1"):
        assert res[name]["losses"] == pytest.approx(runs[0]["losses"], rel=1e-3), name
        st = res[name]["stats"]
        assert st.frozen and st.skipped_reductions == 8 - FREEZE and st.compressed.calls == 8 - FREEZE
    assert all(math.isfinite(x) for x in res["onebit_s1_bf16"]["losses"])
    assert res["onebit_s1_bf16"]["losses"][-1] < res["onebit_s1_bf16"]["losses"][0]
    for name in ("zeroone", "zeroone_s1"):  # 0/1 Adam at stages 0 and 1 (replicas after the freeze)
        zo = res[name]
        assert zo["losses"] == pytest.approx(runs[0]["zeroone"]["losses"], rel=1e-3), name
        assert (zo["stats"].local_syncs, zo["stats"].local_steps, zo["stats"].skipped_reductions) == (3, 1, 5)
    fp16 = res["zeroone_s1_fp16"]["losses"]
    assert all(math.isfinite(x) for x in fp16[2:]) and fp16[-1] < fp16[0]
