"""`Lamb`: DeepSpeed's FusedLamb update rule, per tensor, in torch ops (CPU and CUDA alike).

For each parameter ``p`` with gradient ``g`` (DeepSpeed's ``fused_lamb_cuda_kernel.cu``):

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    update = m / (sqrt(v) + eps) + weight_decay p            (sqrt(v + eps) with eps_inside_sqrt)
    coeff  = clamp(||p|| / ||update||, min_coeff, max_coeff)  (1 when either norm is 0)
    p     -= step_size coeff update,   step_size = lr sqrt(1 - b2^t) / (1 - b1^t)  (lr without bias_correction)

The coefficients of the last step are `get_lamb_coeffs` (DeepSpeed's name). Gradient clipping is the
engine's (``gradient_clipping``): FusedLamb's per-call ``max_grad_norm`` is not taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb", "lamb_coeff", "per_parameter_groups"]


def lamb_coeff(weight_norm: float, update_norm: float, max_coeff: float, min_coeff: float) -> float:
    """The trust ratio ``||p|| / ||update||`` clamped to ``[min_coeff, max_coeff]``; 1 if a norm is 0."""
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    return min(max(weight_norm / update_norm, min_coeff), max_coeff)


def per_parameter_groups(groups: Iterable[Any]) -> list[dict[str, Any]]:
    """Param groups of per-parameter views of ZeRO stage 0's flat masters (`dstrain.zero.flat.FlatGroup`,
    whose master and master gradient cover the whole flat buffer), each view's ``.grad`` a view of the
    master gradient: LAMB's trust ratio is a per-parameter quantity, so it must not see ZeRO's flat
    pieces. (At stages 1-3 the optimizer steps pieces of this rank's partition, as DeepSpeed's ZeRO
    steps its flat partitions: there the ratio is per piece.)"""
    out = []
    for g in groups:
        if g.range != (0, g.layout.padded) or g.master_grad.numel() != g.layout.padded:
            raise ValueError("per-parameter views need ZeRO stage 0's whole master and master gradient")
        views = []
        with torch.no_grad():
            for off, n, shape in zip(g.layout.offsets, g.layout.numels, g.layout.shapes, strict=True):
                view = g.master[off : off + n].view(shape)
                view.requires_grad_(True)  # a leaf view the optimizer steps in place
                view.grad = g.master_grad[off : off + n].view(shape)
                views.append(view)
        out.append({"params": views, **g.options})
    return out


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's ``FusedLamb`` semantics (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        self.lamb_coeffs = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                t = state["step"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
                update = m / denom
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                coeff = lamb_coeff(
                    float(p.norm()), float(update.norm()), group["max_coeff"], group["min_coeff"]
                )
                step_size = group["lr"]
                if group["bias_correction"]:
                    step_size = group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
                p.add_(update, alpha=-step_size * coeff)
                self.lamb_coeffs.append(coeff)
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per parameter stepped (DeepSpeed's name)."""
        return list(self.lamb_coeffs)
