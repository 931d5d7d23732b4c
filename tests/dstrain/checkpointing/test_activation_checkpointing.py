"""Activation checkpointing (dstrain.checkpointing): bitwise equal to no checkpointing with dropout on, the
inputs kept on the device, in host memory or on NVMe with bounded host memory, the config section, the API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import dstrain
import dstrain.checkpointing as ckpt
from dstrain.errors import ConfigError, NotImplementedConfigError, RecomputeError

DIM, DEPTH, BATCH = 64, 6, 8


class Block(nn.Module):
    def __init__(self, dim: int, tracked: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.2)
        self.tracked = tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C) -> (B, C)
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.tracked:  # Megatron-style: tensor-parallel dropout draws from the tracker's stream
            with ckpt.get_cuda_rng_tracker().fork():
                h = self.drop(h)
        else:
            h = self.drop(h)
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, *, use_ckpt: bool, depth: int = DEPTH, tracked: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(DIM, tracked) for _ in range(depth))
        self.out = nn.Linear(DIM, 1)
        self.use_ckpt = use_ckpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (B, C)
        for block in self.blocks:
            h = ckpt.checkpoint(block, h) if self.use_ckpt else block(h)
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def _net(use_ckpt: bool, **kw: Any) -> Net:
    torch.manual_seed(0)
    return Net(use_ckpt=use_ckpt, **kw)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, generator=g)


def _section(placement: str, tmp_path: Any) -> dict[str, Any]:
    if placement == "device":
        return {"partition_activations": False, "cpu_checkpointing": False}
    if placement == "host":
        return {"cpu_checkpointing": True}
    return {"cpu_checkpointing": True, "nvme_path": str(tmp_path), "nvme_window": 2}


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    ckpt.reset()
    yield
    ckpt.reset()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
@pytest.mark.parametrize("tracked", [False, True])
def test_loss_grads_and_rng_equal_to_no_checkpointing(placement: str, tracked: bool, tmp_path) -> None:
    ckpt.configure(deepspeed_config={"activation_checkpointing": _section(placement, tmp_path)})
    results = []
    for use in (False, True):
        model = _net(use, tracked=tracked)
        ckpt.model_parallel_cuda_manual_seed(7)  # resets the tracker: both runs start from the same states
        torch.manual_seed(1)
        x, y = _batch(0)
        losses = []
        for _ in range(2):  # two micro-steps: grads accumulate, RNG advances between them
            loss = model(x, y)
            loss.backward()
            losses.append(loss.detach())
        results.append((losses, _grads(model), torch.get_rng_state(), torch.rand(3)))
    (l0, g0, r0, n0), (l1, g1, r1, n1) = results
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert torch.equal(r0, r1) and torch.equal(n0, n1)  # recompute left the generator where forward did
    s = ckpt.statistics()
    assert s.placement == placement and s.checkpoints == 2 * DEPTH and s.recomputes == 2 * DEPTH
    assert s.saved_bytes == 0


def test_without_rng_replay_the_gradients_differ(monkeypatch) -> None:
    """The equality above needs the replay: a recompute drawing dropout afresh gives other gradients."""
    import contextlib

    from dstrain.checkpointing import function

    grads = []
    for use in (False, True):
        model = _net(use)
        torch.manual_seed(1)
        model(*_batch(0)).backward()
        grads.append(_grads(model))
        monkeypatch.setattr(function.rng, "replay", lambda state: contextlib.nullcontext())
    assert not all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class _SavedBytes:
    """Bytes autograd keeps for backward (parameters excluded: weights are not activations)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        n = 0 if t.untyped_storage().data_ptr() in self.params else t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        return (t, n)

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed[0]


def _forward_saved(model: Net) -> tuple[torch.Tensor, _SavedBytes]:
    counter = _SavedBytes(model)
    x, y = _batch(0)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = model(x, y)
    return loss, counter


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_activation_bytes_held_are_measured_and_bounded(placement: str, tmp_path) -> None:
    depth = 12
    input_bytes = BATCH * DIM * 4  # each checkpoint keeps its (B, C) fp32 input
    _, plain = _forward_saved(_net(False, depth=depth))
    assert plain.peak > depth * 9 * input_bytes  # a block keeps ~9 inputs' worth (fc1 in, gelu, mask, fc2 in)

    active = ckpt.configure(deepspeed_config={"activation_checkpointing": _section(placement, tmp_path)})
    loss, inside = _forward_saved(_net(True, depth=depth))
    s = ckpt.statistics()
    assert inside.peak < 3 * input_bytes  # only the layers outside checkpoints keep tensors for autograd
    assert s.peak_saved_bytes == depth * input_bytes == s.saved_bytes
    if placement == "nvme":
        page = -(-input_bytes // 4096) * 4096
        assert s.host_buffer_bytes == 2 * page  # the host memory it uses: the window, not the depth
        assert s.peak_host_buffers <= 2
        assert s.nvme_written_bytes <= depth * page  # the last writes may still be in flight
        active.drain()
        assert ckpt.statistics().nvme_written_bytes == depth * page
    else:
        assert s.host_buffer_bytes == 0 and s.nvme_written_bytes == 0
    loss.backward()
    s = ckpt.statistics()
    assert s.saved_bytes == 0
    if placement == "nvme":  # every input read back after its write, in one page-rounded buffer each
        assert s.nvme_read_bytes == s.nvme_written_bytes == depth * page
        assert s.peak_host_buffers <= 2


def test_host_copies_do_not_alias_the_inputs(tmp_path) -> None:
    """cpu_checkpointing keeps its own copy (an input changed after forward does not change backward)."""
    ckpt.configure(checkpoint_in_cpu=True)
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = x * 1.0
    out = ckpt.checkpoint(lambda t: lin(t).pow(2).sum(), h)
    ref = torch.autograd.grad(lin(h).pow(2).sum(), lin.weight, retain_graph=True)[0]
    with torch.no_grad():
        h.add_(1.0)  # DeviceStore would recompute from the changed tensor
    out.backward()
    assert torch.equal(lin.weight.grad, ref)


def test_dropped_graph_gives_nvme_slots_back(tmp_path) -> None:
    active = ckpt.configure(deepspeed_config={"activation_checkpointing": _section("nvme", tmp_path)})
    model = _net(True)
    for _ in range(3):  # forward only (e.g. evaluation with grad on): the graph is freed unread
        loss, _ = _forward_saved(model)
        del loss
    assert ckpt.statistics().saved_bytes == 0
    loss, _ = _forward_saved(model)
    loss.backward()
    active.drain()
    s = ckpt.statistics()
    assert s.saved_bytes == 0 and s.nvme_read_bytes == s.nvme_written_bytes // 4  # 4 forwards, 1 backward


def test_section_keys_and_refusals() -> None:
    c = ckpt.ActivationCheckpointingConfig.from_dict(
        {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": 4,
            "cpu_checkpointing": True,
            "synchronize_checkpoint_boundary": True,
            "profile": True,
        }
    )
    assert c.placement == "host" and c.number_checkpoints == 4
    with pytest.raises(NotImplementedConfigError) as e:
        ckpt.ActivationCheckpointingConfig.from_dict({"partition_activations": True})
    assert e.value.field == "activation_checkpointing.partition_activations"
    with pytest.raises(ConfigError) as e:
        ckpt.ActivationCheckpointingConfig.from_dict({"contiguous_memory_optimization": True})
    assert e.value.field == "activation_checkpointing.contiguous_memory_optimization"
    with pytest.raises(ConfigError) as e:
        ckpt.ActivationCheckpointingConfig.from_dict({"cpu_checkpoint": True})
    assert "cpu_checkpointing" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ckpt.ActivationCheckpointingConfig.from_dict({"nvme_window": 0})
    assert e.value.field == "activation_checkpointing.nvme_window"
    cfg = dstrain.DSConfig.load({"train_batch_size": 1, "activation_checkpointing": {"profile": True}})
    assert cfg.activation_checkpointing is not None and cfg.activation_checkpointing.profile


def test_configure_api_and_nvme_buffer_too_small(tmp_path) -> None:
    assert not ckpt.is_configured()
    c = ckpt.configure(
        None, deepspeed_config={"activation_checkpointing": {"profile": True}}, checkpoint_in_cpu=True
    )
    assert ckpt.is_configured() and c.config.cpu_checkpointing and c.config.profile
    _net(True)(*_batch(0)).backward()
    s = ckpt.statistics()
    assert s.forward_seconds > 0 and s.recompute_seconds > 0
    ckpt.reset()
    assert not ckpt.is_configured()
    ckpt.configure(
        deepspeed_config={"activation_checkpointing": {"nvme_path": str(tmp_path), "nvme_buffer_bytes": 4096}}
    )
    with pytest.raises(ConfigError) as e:
        _net(True)(torch.randn(64, DIM), torch.randn(64))  # (64, 64) fp32 = 16 KiB > one 4 KiB buffer
    assert e.value.field == "activation_checkpointing.nvme_buffer_bytes"


def test_tracker_refuses_duplicates() -> None:
    t = ckpt.RNGStatesTracker()
    t.add("a", 1)
    with pytest.raises(dstrain.DstrainError):
        t.add("a", 2)
    with pytest.raises(dstrain.DstrainError):
        t.add("b", 1)
    with pytest.raises(dstrain.DstrainError), t.fork("missing"):
        pass


def _train(cfg: dict[str, Any], use_ckpt: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    model = _net(use_ckpt)
    engine, opt, _, _ = dstrain.initialize(model=model, config=cfg)
    torch.manual_seed(3)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [t.clone() for t in engine.full_state_dict().values()]
    engine.close()
    if hasattr(opt, "close"):
        opt.close()
    return losses, params


def _cfg(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_batch_size": BATCH,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
        **extra,
    }


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_training_equal_through_initialize(placement: str, tmp_path) -> None:
    ref = _train(_cfg(1), use_ckpt=False)
    got = _train(_cfg(1, activation_checkpointing=_section(placement, tmp_path)), use_ckpt=True)
    assert ref[0] == got[0]
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))
    assert ckpt.statistics().placement == placement


def test_nvme_activations_with_zero3_param_and_optimizer_offload(tmp_path) -> None:
    params = tmp_path / "params"
    acts = tmp_path / "acts"
    params.mkdir()
    acts.mkdir()
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 4096,
        "offload_param": {"device": "nvme", "nvme_path": str(params)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(params)},
    }
    ref = _train({**_cfg(3), "zero_optimization": zero}, use_ckpt=False)
    cfg = {**_cfg(3), "zero_optimization": zero, "activation_checkpointing": _section("nvme", acts)}
    got = _train(cfg, use_ckpt=True)
    assert list(acts.iterdir()) == []  # engine.close closed the activation swap file (and its directory)
    s = ckpt.statistics()
    assert s.placement == "nvme" and s.nvme_read_bytes == s.nvme_written_bytes > 0
    assert s.peak_host_buffers <= 2
    assert ref[0] == got[0]
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))


def test_public_surface_is_deepspeeds_names() -> None:
    assert set(ckpt.__all__) == {
        "ActivationCheckpointer",
        "ActivationCheckpointingConfig",
        "ActivationStatistics",
        "CudaRNGStatesTracker",
        "RNGStatesTracker",
        "checkpoint",
        "configure",
        "get_cuda_rng_tracker",
        "is_configured",
        "model_parallel_cuda_manual_seed",
        "reset",
        "statistics",
    }


def test_recompute_stops_at_the_last_saved_tensor() -> None:
    """What follows the last tensor autograd saves (here the count and a sum, which saves nothing) is not
    recomputed: the early stop of the non-reentrant scheme (torch.utils.checkpoint's default)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    calls = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = lin(t)  # saves t and the weight: the last tensors saved
        calls.append(1)
        return h.sum()

    x = torch.randn(4, 8, requires_grad=True)
    ckpt.checkpoint(fn, x).backward()
    assert len(calls) == 1 and ckpt.statistics().recomputes == 1
    ref_x, ref_w = torch.autograd.grad(lin(x).sum(), (x, lin.weight))
    assert torch.equal(x.grad, ref_x) and torch.equal(lin.weight.grad, ref_w)


def test_recompute_under_the_forwards_autocast() -> None:
    """Backward runs outside forward's autocast; the recompute replays it (else it would save fp32 where
    forward saved bf16, and the gradients would differ)."""
    grads = []
    for use in (False, True):
        model = _net(use)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*_batch(0))
        loss.backward()
        grads.append(_grads(model))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_inputs_without_grad_nested_checkpoints_and_a_changed_recompute() -> None:
    torch.manual_seed(0)
    block = Block(DIM)
    x = torch.randn(BATCH, DIM)  # requires no grad: the parameters still get theirs
    torch.manual_seed(1)
    block(x).pow(2).sum().backward()
    ref = _grads(block)
    block.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ckpt.checkpoint(lambda t: ckpt.checkpoint(block, t).pow(2).sum(), x).backward()  # nested: one frame
    assert all(torch.equal(a, b) for a, b in zip(ref, _grads(block), strict=True))
    assert ckpt.statistics().recomputes == 1

    rows = iter([BATCH, BATCH // 2])  # the second call (the recompute) saves another shape

    def changing(t: torch.Tensor) -> torch.Tensor:
        return (t[: next(rows)] * block.fc1.weight[:1]).sum()

    out = ckpt.checkpoint(changing, x)
    with pytest.raises(RecomputeError):
        out.backward()
