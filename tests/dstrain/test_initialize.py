"""`dstrain.initialize`: the DeepSpeed entry point, optimizer/scheduler/dataloader wiring, statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dstrain_helpers import base_config, engine_losses, make_model
from torch.utils.data import TensorDataset

import dstrain
from dstrain.scheduler import WarmupLR


def test_deepspeed_style_loop_with_dataloader() -> None:
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model = torch.nn.Linear(4, 1)

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.inner(x), y)

    cfg = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, optimizer, loader, sched = dstrain.initialize(
        model=Wrapped(), model_parameters=model.parameters(), config=cfg, training_data=data
    )
    assert loader is not None and sched is None
    assert isinstance(optimizer, torch.optim.SGD)
    seen = 0
    for x, y in loader:
        assert x.shape == (4, 4)  # micro batch
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        seen += 1
    assert seen == 8
    stats = engine.statistics()
    assert dataclasses.is_dataclass(stats)
    assert (stats.micro_steps, stats.global_steps, stats.samples) == (8, 4, 32)
    assert stats.forward_seconds > 0 and stats.backward_seconds > 0 and stats.step_seconds > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.global_steps = 0  # type: ignore[misc]
    engine.close()


def test_param_groups_keep_their_options() -> None:
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    cfg = base_config(2, world=1)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, optimizer, _, _ = dstrain.initialize(model=model, model_parameters=groups, config=cfg)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) >= sum(
        p.numel() for p in decay + no_decay
    )
    losses = engine_losses(engine, 5)
    assert losses[-1] < losses[0]
    engine.close()


def test_deepspeed_adam_is_adamw_unless_adam_w_mode_false() -> None:
    cfg = base_config(0, world=1)
    _, opt, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.0
    cfg["optimizer"] = {"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": False}}
    _, opt, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    assert type(opt) is torch.optim.Adam
    assert opt.defaults["fused"] is True  # torch's fused kernel by default
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "foreach": False}}
    _, opt, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    assert not opt.defaults["fused"] and opt.defaults["foreach"] is False


def test_client_optimizer_and_scheduler_are_rebuilt_over_masters() -> None:
    model = make_model()
    cfg = base_config(1, world=1)
    del cfg["optimizer"]
    client = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, opt, _, sched = dstrain.initialize(
        model=model, optimizer=client, config=cfg, lr_scheduler=lambda o: WarmupLR(o, warmup_num_steps=10)
    )
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9
    assert isinstance(sched, WarmupLR) and sched.optimizer is opt
    engine.close()


def test_seed_from_config_is_applied() -> None:
    # The RNG is left in a different state before each initialize() (make_model() reseeds, so the
    # disturbance comes after it): only initialize's own seeding can make the draws agree.
    def draw_after_initialize(seed: int, disturb: int) -> torch.Tensor:
        model = make_model()
        torch.rand(disturb)
        dstrain.initialize(model=model, config=base_config(0, world=1, seed=seed))
        return torch.rand(3)

    a = draw_after_initialize(7, disturb=5)
    assert torch.equal(a, draw_after_initialize(7, disturb=11))
    assert not torch.equal(a, draw_after_initialize(8, disturb=5))  # the seed value matters
