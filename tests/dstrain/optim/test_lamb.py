"""LAMB (dstrain.optim.Lamb): DeepSpeed FusedLamb's update rule (trust ratio clamp, bias correction,
eps placement) against the kernel's formulas in float64, and through dstrain.initialize per parameter."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import dstrain
from dstrain.errors import ConfigError
from dstrain.optim.lamb import Lamb, lamb_coeff


def _kernel_reference(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], **kw: Any
) -> tuple[list[torch.Tensor], list[list[float]]]:
    """fused_lamb_cuda_kernel.cu in float64, per tensor: part1 (moments, update, norms), part3 (clamped
    ratio, step). Returns the final parameters and every step's ratios."""
    lr, (b1, b2), eps = kw["lr"], kw["betas"], kw["eps"]
    wd, maxc, minc = kw["weight_decay"], kw["max_coeff"], kw["min_coeff"]
    ps = [p.double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    ratios = []
    for t, step_grads in enumerate(grads, start=1):
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if kw["bias_correction"] else lr
        row = []
        for p, m, v, g in zip(ps, ms, vs, step_grads, strict=True):
            g = g.double()
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            denom = (v + eps).sqrt() if kw["eps_inside_sqrt"] else v.sqrt() + eps
            update = m / denom + wd * p
            w, u = float(p.norm()), float(update.norm())
            coeff = 1.0 if w == 0 or u == 0 else min(max(w / u, minc), maxc)
            row.append(coeff)
            p.sub_(step_size * coeff * update)
        ratios.append(row)
    return ps, ratios


CASES = {
    "default": dict(
        bias_correction=True, eps_inside_sqrt=False, weight_decay=0.0, max_coeff=10.0, min_coeff=0.01
    ),
    "decay, no bias correction": dict(
        bias_correction=False, eps_inside_sqrt=False, weight_decay=0.1, max_coeff=10.0, min_coeff=0.01
    ),
    "eps inside sqrt, clamped": dict(
        bias_correction=True, eps_inside_sqrt=True, weight_decay=0.01, max_coeff=0.3, min_coeff=0.2
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_rule_matches_the_fused_kernel(case: str) -> None:
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, **CASES[case])
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32) * 0.01, torch.zeros(8)]  # a zero tensor: ratio 1
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = Lamb(leaves, **kw)
    got_ratios = []
    for step_grads in grads:
        for p, g in zip(leaves, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
        got_ratios.append(opt.get_lamb_coeffs())
    want, want_ratios = _kernel_reference(params, grads, **kw)
    for p, w in zip(leaves, want, strict=True):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    for got, ref in zip(got_ratios, want_ratios, strict=True):
        assert got == pytest.approx(ref, rel=1e-5)
    if case == "eps inside sqrt, clamped":  # the clamp held the first tensor's ratio inside [0.2, 0.3]
        assert all(0.2 <= r[0] <= 0.3 for r in got_ratios) and any(r[0] in (0.2, 0.3) for r in got_ratios)
    assert got_ratios[0][2] == 1.0  # the zero tensor's first step: ||p|| = 0, ratio 1 (then it has moved)


def test_trust_ratio_clamp_and_zero_norms() -> None:
    assert lamb_coeff(1.0, 1e-6, 10.0, 0.01) == 10.0
    assert lamb_coeff(1e-9, 1.0, 10.0, 0.01) == 0.01
    assert lamb_coeff(0.0, 1.0, 10.0, 0.01) == 1.0 and lamb_coeff(1.0, 0.0, 10.0, 0.01) == 1.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))).squeeze(-1), y)


def test_lamb_from_the_config_has_a_ratio_per_parameter() -> None:
    """At ZeRO stage 0 the engine's Lamb steps per-parameter views of the flat master: its losses follow a
    plain loop of Lamb over the model's own parameters (not one ratio over the flat buffer)."""
    params = {"lr": 1e-2, "weight_decay": 0.01, "max_coeff": 10.0, "min_coeff": 0.01}
    cfg = {"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": params}, "steps_per_print": 1000}
    torch.manual_seed(0)
    engine, opt, _, _ = dstrain.initialize(model=_Net(), config=cfg)
    torch.manual_seed(0)
    plain = _Net()
    ref = Lamb(plain.parameters(), **params)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        ref.zero_grad()
        want = plain(x, y)
        want.backward()
        ref.step()
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert len(opt.get_lamb_coeffs()) == 4  # one ratio per parameter tensor
    assert opt.get_lamb_coeffs() == pytest.approx(ref.get_lamb_coeffs(), rel=1e-5)
    engine.close()


def test_config_refuses_max_grad_norm() -> None:
    cfg = {"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}}
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=_Net(), config=cfg)
    assert e.value.field == "optimizer.params.max_grad_norm"
