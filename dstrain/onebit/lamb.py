"""1-bit LAMB (Li et al., arXiv:2104.06069): LAMB whose momentum is averaged with the error-feedback 1-bit
all-reduce after ``freeze_step``, as DeepSpeed 0.16.5's ``OnebitLamb`` does it.

Warm-up (gradients averaged by the engine): LAMB without bias correction, per parameter

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2;   update = m / (sqrt(v) + eps) + wd p
    coeff = clamp(||p|| / ||update||, min_coeff, max_coeff);   p -= lr coeff update

and the frozen coefficient ``c_freeze`` follows an EMA of ``coeff`` (``coeff_beta``; steps whose coeff is
exactly 1 are left out, as in DeepSpeed). At step ``freeze_step`` the variance ``v`` freezes and a fresh
copy ``v_fresh`` starts. Compressed phase (the engine sends no gradients): each rank updates its momentum
with its own gradient, scales it by a per-parameter ``scaling_coeff`` (the mean of every parameter's RMS
momentum over this one's, fixed at the first compressed step, so all parameters reach the 1-bit
compressor at one scale), averages the flat momentum with `CompressedAllReduce`, unscales it, and
reconstructs the averaged gradient ``(m - b1 m_prev) / (1 - b1)`` to keep ``v_fresh`` current. The step
uses the frozen ``v`` and a coefficient ``c_freeze x factor``, ``factor = max(denom / denom_fresh)``
(mixed towards 1 by the share of weight decay in the update), clamped to ``[factor_min, factor_max]``
and to within ``factor_threshold`` of the previous step's.

As in DeepSpeed 0.16.5, the first `step` only allocates state (its step count becomes 1, the parameters
do not move), so the warm-up takes ``freeze_step - 1`` updates. The arithmetic follows DeepSpeed's
expressions one for one (tests/dstrain/onebit/test_onebit_lamb.py compares per-step losses with 0.16.5's
sources run on CPU: bench/onebit_anchor.py ... lamb).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dstrain.onebit.compressed import CompressedAllReduce

__all__ = ["OneBitLamb"]


class OneBitLamb(torch.optim.Optimizer):
    """1-bit LAMB over ``params`` (every rank holds all of them: data parallel, ZeRO stage 0);
    ``group``: the data-parallel process group."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not (isinstance(freeze_step, int) and freeze_step >= 1):
            raise ValueError(f"freeze_step must be an integer >= 1, got {freeze_step!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not 0.0 <= min_coeff <= max_coeff or not 0.0 < factor_min <= factor_max:
            raise ValueError("need 0 <= min_coeff <= max_coeff and 0 < factor_min <= factor_max")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.backend = CompressedAllReduce(group)
        self.steps = 0
        """Calls to `step` (the first, allocating one included)."""
        self.compressing = False
        """DeepSpeed's ``lamb_freeze_key``: set at the end of the warm-up step that reached ``freeze_step``."""
        self.lamb_coeffs: list[float] = []

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen and momentum goes through the compressed all-reduce."""
        return self.compressing

    def reduces_gradients(self) -> bool:
        """Whether the engine must average gradients before `step` (True during warm-up only)."""
        return not self.compressing

    def _params(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.lamb_coeffs = []
        params = self._params()
        if self.steps == 0:  # DeepSpeed's first call: allocate, count the step, move nothing
            for _, p in params:
                self.state[p].update(
                    step=1,
                    lamb_coeff_freeze=0.0,
                    last_factor=1.0,
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                    exp_avg_sq_fresh=torch.zeros_like(p),
                )
            self.steps += 1
            return loss
        if self.compressing:
            self._compressed_step(params)
        else:
            self._warmup_step(params)
        self.steps += 1
        return loss

    def _warmup_step(self, params: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        last = None
        for group, p in params:
            state = self.state[p]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            beta1, beta2 = group["betas"]
            state["step"] += 1
            grad = p.grad
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if state["step"] == self.freeze_step:
                state["exp_avg_sq_fresh"] = v.detach().clone()
            weight_norm = p.data.pow(2).sum().sqrt()
            update = m / (v.sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p.data
            update_norm = update.pow(2).sum().sqrt()
            lamb_coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                lamb_coeff = (weight_norm / update_norm).item()
                lamb_coeff = min(max(lamb_coeff, group["min_coeff"]), group["max_coeff"])
            if lamb_coeff != 1.0:
                state["lamb_coeff_freeze"] = (
                    self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * lamb_coeff
                )
            self.lamb_coeffs.append(lamb_coeff)
            p.add_(-group["lr"] * lamb_coeff * update)
            last = state
        if last is not None and last["step"] >= self.freeze_step:
            self.compressing = True

    def _compressed_step(self, params: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        first = self.state[params[0][1]]
        if "scaling_coeff" not in first:  # fixed once, at the first compressed step
            scales = [
                (
                    torch.linalg.vector_norm(self.state[p]["exp_avg"])
                    / np.sqrt(torch.numel(self.state[p]["exp_avg"]))
                ).item()
                for _, p in params
            ]
            united = sum(scales) / len(scales)
            for (_, p), s in zip(params, scales, strict=True):
                self.state[p]["scaling_coeff"] = united / s
        previous = [self.state[p]["exp_avg"].detach().clone() for _, p in params]
        for group, p in params:
            state = self.state[p]
            state["step"] += 1
            state["exp_avg"].mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
            state["exp_avg"].mul_(state["scaling_coeff"])
        if self.backend.world > 1:
            ms = [self.state[p]["exp_avg"] for _, p in params]
            numel = sum(m.numel() for m in ms)
            padded = self.backend.padded_numel(numel)
            if "worker_error" not in first or first["worker_error"].numel() != padded:
                first["worker_error"], first["server_error"] = self.backend.new_errors(numel, ms[0].device)
                first["exp_avg_padding"] = torch.zeros(padded - numel, device=ms[0].device)
            # DeepSpeed keeps one padded flat momentum buffer: its padding is never reset, so it carries the
            # previous call's output into the next compression. Kept here the same way (state, checkpointed).
            flat = torch.cat([m.reshape(-1) for m in ms] + [first["exp_avg_padding"]])  # (padded,)
            avg = self.backend.all_reduce(flat, first["worker_error"], first["server_error"])
            offset = 0
            for m in ms:
                m.copy_(avg[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
            first["exp_avg_padding"].copy_(avg[numel:])
        for (group, p), m_prev in zip(params, previous, strict=True):
            state = self.state[p]
            m, v, v_fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
            beta1, beta2 = group["betas"]
            m.div_(state["scaling_coeff"])
            grad_reconstruct = (m - m_prev * beta1) / (1 - beta1)
            v_fresh.mul_(beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - beta2)
            denom = v.sqrt() + group["eps"]
            update_prelim = m / denom
            if group["weight_decay"] > 0.0:
                update = update_prelim + group["weight_decay"] * p.data
            else:
                update = update_prelim
            update_norm = update.pow(2).sum().sqrt()
            denom_real = v_fresh.sqrt() + group["eps"]
            factor = (denom / denom_real).max().item()
            if group["weight_decay"] > 0.0:
                update_ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
                factor = factor * update_ratio + (1.0 - update_ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(factor, state["last_factor"] * (1.0 + self.factor_threshold))
            factor = max(factor, state["last_factor"] * (1.0 - self.factor_threshold))
            state["last_factor"] = factor
            lamb_coeff = state["lamb_coeff_freeze"] * factor
            self.lamb_coeffs.append(lamb_coeff)
            p.add_(-group["lr"] * lamb_coeff * update)

    def get_lamb_coeffs(self) -> list[float]:
        """The coefficients of the last step (DeepSpeed's name)."""
        return list(self.lamb_coeffs)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["onebit_lamb"] = {
            "steps": self.steps,
            "compressing": self.compressing,
            "world": self.backend.world,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        meta = sd.pop("onebit_lamb", None)
        super().load_state_dict(sd)
        self.steps = int(meta["steps"]) if meta else 0
        self.compressing = bool(meta["compressing"]) if meta else False
        if meta and meta.get("world") != self.backend.world:  # error feedback is per rank
            for st in self.state.values():
                st.pop("worker_error", None)
                st.pop("server_error", None)
                st.pop("exp_avg_padding", None)
