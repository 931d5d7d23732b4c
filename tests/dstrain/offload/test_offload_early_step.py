"""Stepping offloaded sub-groups during the boundary backward (`dstrain.offload.optimizer.early_step`): where it
is composed, what it refuses, and that an async checkpoint save still gets the state of its step.

Bitwise equality with stepping after backward (none / cpu / nvme, gradient accumulation, bf16, 2 gloo
ranks) is checked in test_offload_parity.py; these run in one process (world size 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, global_batch, make_model
from _offload_helpers import final_params, offload_config, slow_swap_reads

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
from dsio._bridge import run_sync  # noqa: E402
from dsio.checkpoint import Checkpointer  # noqa: E402
from dstrain.errors import EarlyStepError  # noqa: E402


def _engine(tmp_path: Any, stage: int = 3, device: str = "nvme", dim: int = 16, **extra: Any) -> Any:
    cfg = offload_config(stage, device, str(tmp_path), sub_group=1024, **extra.pop("zero", {}))
    for key, value in extra.items():
        cfg[key] = value
    return dstrain.initialize(model=make_model(dim=dim), config=cfg)[:2]


def _backward(engine: Any, step: int) -> None:
    idx, targets = global_batch(step, engine.config.train_batch_size)
    engine.backward(engine(idx, targets))


@pytest.mark.parametrize(
    ("why", "stage", "extra"),
    [
        ("stage 2 reduces after backward", 2, {}),
        ("clipping needs every gradient", 3, {"gradient_clipping": 0.5}),
        ("fp16 checks overflow over every gradient", 3, {"fp16": {"enabled": True}}),
        ("switched off", 3, {"zero": {"offload_optimizer": {"step_in_backward": False}}}),
    ],
)
def test_steps_after_backward_where_not_legal(tmp_path, why: str, stage: int, extra: dict) -> None:
    if "zero" in extra:  # merged into the offload_optimizer section
        cfg = offload_config(stage, "nvme", str(tmp_path), sub_group=1024)
        cfg["zero_optimization"]["offload_optimizer"].update(extra["zero"]["offload_optimizer"])
        engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    else:
        engine, opt = _engine(tmp_path, stage, **extra)
    try:
        assert not opt.steps_in_backward, why
        engine_losses(engine, 3)
        assert opt.statistics().stepped_in_backward == 0
    finally:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_reads_follow_the_order_backward_finishes_gradients(tmp_path, device: str) -> None:
    engine, opt = _engine(tmp_path, device=device)
    try:
        assert opt.steps_in_backward
        n = len(opt.sub_groups)
        assert n >= 3
        engine_losses(engine, 1)  # the first step records how often each unit reduces
        assert opt.statistics().stepped_in_backward == 0
        order = [sg.index for sg in opt._order]
        # the head's (last) sub-group is final first; the tied embedding's (first) only at the end
        assert sorted(order) == list(range(n)) and order[0] == n - 1 and order[-1] == 0
        engine_losses(engine, 2, start=1, hook=lambda step, micro: opt.drain())  # reads in first
        st = opt.statistics()
        assert st.stepped_in_backward > 0
        if device == "cpu":  # nothing to wait for: every sub-group final before after_backward steps
            assert st.stepped_in_backward >= 2 * (n - 1)
    finally:
        engine.close()


def test_lr_changed_between_backward_and_step_is_refused(tmp_path) -> None:
    engine, opt = _engine(tmp_path, device="cpu")
    try:
        engine_losses(engine, 1)
        _backward(engine, 1)
        assert opt.statistics().stepped_in_backward > 0  # stepped with the old lr already
        opt.param_groups[0]["lr"] *= 0.5
        with pytest.raises(EarlyStepError):
            engine.step()
    finally:
        engine.close()


def test_a_second_boundary_backward_before_step_is_refused(tmp_path) -> None:
    """Its gradient would be added to sub-groups already stepped with the first one's."""
    engine, opt = _engine(tmp_path, device="cpu")
    try:
        engine_losses(engine, 1)
        _backward(engine, 1)
        assert opt.statistics().stepped_in_backward > 0
        with pytest.raises(EarlyStepError):
            _backward(engine, 2)
    finally:
        engine.close()


def test_state_read_between_backward_and_step_is_refused(tmp_path) -> None:
    engine, opt = _engine(tmp_path, device="nvme")
    try:
        engine_losses(engine, 1)
        opt.drain()  # the next step's first reads are in: backward steps those sub-groups
        _backward(engine, 1)
        assert opt.statistics().stepped_in_backward > 0
        with pytest.raises(EarlyStepError):
            opt.state_dict()
        engine.step()  # the step finishes the rest and everything is consistent again
        assert opt.state_dict()["state"]
    finally:
        engine.close()


def test_a_unit_reduced_again_after_its_sub_group_stepped_is_an_error(tmp_path) -> None:
    """A model whose control flow changes so that a unit reduces more often than the pass before
    (a parameter used across reentrant checkpoints): the sub-group was not final when stepped."""
    engine, opt = _engine(tmp_path, device="cpu")
    try:
        engine_losses(engine, 1)
        _backward(engine, 1)
        stepped = next(i for i in range(len(opt.sub_groups)) if opt.stepped(i))
        sg = opt.sub_groups[stepped]
        group = engine.zero.groups[sg.group]
        unit = next(
            u for u in group.units if group.offsets[u.index] < sg.master_start + sg.numel
        )  # a unit the sub-group covers
        with pytest.raises(EarlyStepError):
            engine.zero._reduced(group.index, group.offsets[unit.index], unit.layout.shard)
    finally:
        engine.close()


READ_DELAY = 0.02


@pytest.fixture
def slow_save(monkeypatch):
    """The save's swap-file reads are slow, so its staging outlasts forward and backward."""
    slow_swap_reads(monkeypatch, READ_DELAY)


def test_async_save_holds_stepping_in_backward_for_the_step_it_gates(tmp_path, slow_save) -> None:
    """The step after an async save steps nothing during backward (it waits for the save sub-group by
    sub-group in `step`), so the checkpoint holds exactly the saved step; the next step steps in
    backward again."""
    engine, opt = _engine(tmp_path, device="nvme", dim=96)
    try:
        assert opt.steps_in_backward and len(opt.sub_groups) >= 8
        engine_losses(engine, 2)
        expected = opt.state_dict()["state"]
        master = [m.clone() for m in engine.zero.state_dict()["master"]]
        engine.save_checkpoint(tmp_path / "ck", async_save=True)
        before = opt.statistics().stepped_in_backward
        engine_losses(engine, 1, start=2)
        assert opt.statistics().stepped_in_backward == before
        engine.wait_checkpoint()
        engine_losses(engine, 2, start=3)
        assert opt.statistics().stepped_in_backward > before
    finally:
        engine.close()

    async def load() -> Any:
        async with Checkpointer(str(tmp_path / "ck")) as ckpt:
            return await ckpt.load()

    saved = run_sync(load())
    for i, e in expected.items():
        got = saved["stepper"]["state"][i]
        assert torch.equal(got["exp_avg"].view(-1), e["exp_avg"].view(-1))
        assert torch.equal(got["exp_avg_sq"].view(-1), e["exp_avg_sq"].view(-1))
    for a, b in zip(saved["zero"]["master"], master, strict=True):
        assert torch.equal(a, b)


def _early_vs_reference(root: str, device: str, model_device: str) -> None:
    """Sub-groups step during backward with the masters on ``model_device`` (state on the host or
    NVMe, stepped there by the same fused kernel), bitwise equal to no offload."""
    out: dict[str, Any] = {}
    # With the optimizer offloaded (CPU or NVMe) and the model on CUDA, ZeRO-Offload / -Infinity step the
    # fp32 master on the host (another Adam kernel than the GPU's): the reference is then the same
    # placement stepped after backward.
    host_master = model_device.startswith("cuda")
    for name, where in (("ref", device if host_master else "none"), ("early", device)):
        cfg = offload_config(3, where, root, sub_group=1024)
        if name == "ref" and host_master:
            cfg["zero_optimization"]["offload_optimizer"]["step_in_backward"] = False
        engine, opt = dstrain.initialize(model=make_model().to(model_device), config=cfg)[:2]
        try:
            drain = getattr(opt, "drain", None)  # the state read in before each backward: deterministic
            losses = engine_losses(engine, 4, hook=lambda step, micro, d=drain: d() if d else None)
            params = [t.detach().cpu() for t in final_params(engine)]
            stats = opt.statistics() if hasattr(opt, "statistics") else None
        finally:
            engine.close()
        out[name] = (losses, params, stats)
    assert out["early"][0] == out["ref"][0]
    for a, b in zip(out["early"][1], out["ref"][1], strict=True):
        assert torch.equal(a, b)
    st = out["early"][2]
    assert st.stepped_in_backward >= 3 * (st.sub_groups - 1) > 0  # every step after the first


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_steps_in_backward_with_cpu_masters(tmp_path, device: str) -> None:
    _early_vs_reference(str(tmp_path), device, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_steps_in_backward_with_cuda_masters(tmp_path, device: str) -> None:
    _early_vs_reference(str(tmp_path), device, f"cuda:{torch.cuda.current_device()}")
