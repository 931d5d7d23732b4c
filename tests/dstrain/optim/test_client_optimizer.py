"""Client optimizers (``initialize(optimizer=...)``): their param groups and per-group options survive
every ZeRO stage and offload setting; schedulers passed as objects keep driving them; what dstrain
cannot step is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, global_batch, make_model

import dstrain
from dstrain.errors import DstrainError, NotImplementedConfigError, UnsupportedOptimizerError
from dstrain.scheduler import WarmupLR

STEPS, BATCH = 3, 4


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two groups with different lr and weight decay (matrices decayed, the rest not)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": 2e-2},
        {"params": rest, "weight_decay": 0.0, "lr": 5e-3},
    ]


OPTIMIZERS = {
    "AdamW": lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.99)),
    "Adam": lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.05),
    "SGD": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True),
    "Adagrad": lambda g: torch.optim.Adagrad(g, lr=1e-2, initial_accumulator_value=0.1),
}


def _reference(make: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    opt = make(_groups(model))
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step, BATCH))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(
    make: Any, stage: int, offload: str, tmp_path: Any
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    model = make_model()
    client = make(_groups(model))
    cfg = base_config(stage, world=1, micro=BATCH)
    del cfg["optimizer"]
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path)}
    engine, opt, _, _ = dstrain.initialize(model=model, optimizer=client, config=cfg)
    losses = []
    for step in range(STEPS):
        loss = engine(*global_batch(step, BATCH))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    engine.close()
    return losses, state, groups


CASES = [(0, "none")] + [(s, o) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]


@pytest.mark.parametrize(("stage", "offload"), CASES)
def test_adamw_groups_match_plain_pytorch(stage: int, offload: str, tmp_path: Any, one_thread: None) -> None:
    ref_losses, ref_state = _reference(OPTIMIZERS["AdamW"])
    losses, state, groups = _engine(OPTIMIZERS["AdamW"], stage, offload, tmp_path)
    assert [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in groups] == [
        (2e-2, 0.1, (0.8, 0.99)),
        (5e-3, 0.0, (0.8, 0.99)),
    ]
    # the same AdamW update on fp32 masters; the offloaded one runs torch's fused kernel instead of
    # the for-each loop, which rounds differently in the last bits
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    # the groups matter: one shared weight decay / lr would move the weights elsewhere
    _, flat_state = _reference(lambda g: torch.optim.AdamW([p for x in g for p in x["params"]], lr=1e-2))
    assert not torch.allclose(flat_state["block.0.weight"], state["block.0.weight"], atol=1e-4)


@pytest.mark.parametrize("name", ["Adam", "SGD", "Adagrad"])
@pytest.mark.parametrize("stage", [0, 3])
def test_other_torch_optimizers_keep_their_groups(
    name: str, stage: int, tmp_path: Any, one_thread: None
) -> None:
    ref_losses, ref_state = _reference(OPTIMIZERS[name])
    losses, state, groups = _engine(OPTIMIZERS[name], stage, "none", tmp_path)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and [g["lr"] for g in groups] == [2e-2, 5e-3]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_adam_offload_keeps_l2_weight_decay_per_group(tmp_path: Any, one_thread: None) -> None:
    ref_losses, ref_state = _reference(OPTIMIZERS["Adam"])
    losses, state, _ = _engine(OPTIMIZERS["Adam"], 2, "cpu", tmp_path)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_the_client_object_is_what_is_stepped(one_thread: None) -> None:
    model = make_model()
    client = torch.optim.AdamW(_groups(model), lr=1e-2)
    cfg = base_config(3, world=1)
    del cfg["optimizer"]
    engine, opt, _, _ = dstrain.initialize(model=model, optimizer=client, config=cfg)
    assert opt is client and engine.optimizer is client
    masters = {id(p) for g in engine.zero.param_groups() for p in g["params"]}
    assert {id(p) for g in client.param_groups for p in g["params"]} == masters
    engine.close()


@pytest.mark.parametrize("kind", ["torch", "dstrain"])
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_scheduler_object_drives_the_groups(kind: str, offload: str, tmp_path: Any, one_thread: None) -> None:
    model = make_model()
    client = torch.optim.AdamW(_groups(model), lr=1e-2)
    if kind == "torch":
        sched: Any = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 0.5**step)
    else:
        sched = WarmupLR(
            client, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=4, warmup_type="linear"
        )
    cfg = base_config(2, world=1, micro=BATCH)
    del cfg["optimizer"]
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
    engine, opt, _, returned = dstrain.initialize(
        model=model, optimizer=client, lr_scheduler=sched, config=cfg
    )
    assert returned is sched and sched.optimizer is engine.optimizer
    seen = []
    for step in range(3):
        loss = engine(*global_batch(step, BATCH))
        engine.backward(loss)
        engine.step()
        seen.append(engine.get_lr())
    if kind == "torch":
        assert seen == [[2e-2 * 0.5**k, 5e-3 * 0.5**k] for k in (1, 2, 3)]
    else:
        assert seen == [
            [pytest.approx(2.5e-3 * k)] * 2 for k in (0, 1, 2)
        ]  # DeepSpeed: step k at iteration k-1
    engine.close()


def test_scheduler_bound_elsewhere_is_refused() -> None:
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    other = torch.optim.SGD(make_model().parameters(), lr=1.0)
    cfg = base_config(0, world=1)
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="another optimizer"):
        dstrain.initialize(
            model=model, optimizer=client, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1), config=cfg
        )


def test_what_cannot_be_stepped_is_refused(tmp_path: Any) -> None:
    cfg = base_config(0, world=1)
    del cfg["optimizer"]
    model = make_model()
    with pytest.raises(UnsupportedOptimizerError, match="closure"):
        dstrain.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()), config=cfg)
    used = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(*global_batch(0, 2)).backward()
    used.step()
    with pytest.raises(UnsupportedOptimizerError, match="state"):
        dstrain.initialize(model=model, optimizer=used, config=cfg)
    cfg = base_config(2, world=1)
    del cfg["optimizer"]
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = make_model()
    with pytest.raises(NotImplementedConfigError):  # only Adam(W) is offloaded
        dstrain.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    m = make_model()
    groups = _groups(m)
    groups[1]["amsgrad"] = True
    with pytest.raises(NotImplementedConfigError, match="param group 1"):
        dstrain.initialize(model=m, optimizer=torch.optim.Adam(groups, lr=1e-2), config=cfg)


def test_no_optimizer_is_accepted_and_step_says_so() -> None:
    cfg = base_config(3, world=1)
    del cfg["optimizer"]
    engine, opt, _, sched = dstrain.initialize(model=make_model(), config=cfg)
    assert opt is None and sched is None and engine.optimizer is None
    with torch.no_grad():
        loss = engine(*global_batch(0, 4))
    assert torch.isfinite(loss)
    engine.backward(engine(*global_batch(0, 4)))
    with pytest.raises(DstrainError, match="no optimizer"):
        engine.step()
    engine.close()
