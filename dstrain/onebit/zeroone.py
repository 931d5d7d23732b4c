"""0/1 Adam (Lu et al., arXiv:2202.06009): adaptive variance freezing and skipped communication, on
the same error-feedback 1-bit all-reduce as 1-bit Adam (torch.distributed: gloo and NCCL, CPU and CUDA).

Two phases, with DeepSpeed 0.16.5's parameter names and defaults:

*Variance phase* (until step ``var_freeze_step``). Step ``t`` updates the variance only when
``t % var_interval == 0``; the interval starts at 1 and doubles after every ``var_update_scaler``
variance updates. On those steps the engine all-reduces the gradients (`reduces_gradients` tells it
one step ahead) and both moments take the averaged gradient. On the other steps the engine sends
nothing: each rank's *local* gradient is averaged with the 1-bit compressed all-reduce and only the
momentum takes it. Either way the parameters take an Adam step.

*Frozen phase* (after ``var_freeze_step``). The variance is fixed, the engine never reduces gradients,
and ranks talk only every ``local_step_interval`` steps: in between, each rank takes local Adam steps
with its own gradients and sums them in a momentum accumulator ``u``. At a synchronization step the
local steps are undone, ``u`` (rescaled by the Adam denominator) is averaged with the compressed
all-reduce, the momentum is rebuilt from it (``m = -u_avg / sum(lr)``) and the averaged step is applied,
so all replicas agree again. The interval starts at 1 and doubles, up to ``local_step_clipper``, after
every ``local_step_scaler`` frozen steps. The error-feedback buffers are zeroed once at the freeze
(before it they carried gradient error, after it they carry accumulator error).

First step and bias correction:

- dstrain's default (``bias_correction=True``): the first call is a real step; the momentum is divided
  by ``1 - beta1^t`` and the variance by ``1 - beta2^n`` (``n`` variance updates so far, frozen with it).
  In the frozen phase the rebuilt momentum is multiplied back by ``1 - beta1^t`` so what is stored is
  always the uncorrected momentum.
- ``deepspeed_compat=True``: DeepSpeed 0.16.5's behaviour, for the anchor comparison: the first call
  only counts (its gradient is dropped, nothing moves), and no bias correction at all.

``fused=True`` (default) compresses all tensors of a param group as one flat buffer; ``fused=False``
compresses tensor by tensor, as DeepSpeed does. Differences from DeepSpeed 0.16.5, on purpose: with one
rank the momentum still takes the gradient on non-variance steps (DeepSpeed skipped the update), and
the error feedback, momentum accumulator and schedule counters are saved in ``state_dict()`` and
restored bitwise (DeepSpeed's ``load_state_dict`` dropped them). ZeRO stage 0 (replicated state).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dstrain.onebit.compressed import CompressedAllReduce

__all__ = ["ZeroOneAdam"]

_SCHEDULE = (
    "steps",
    "var_interval",
    "var_counter",
    "var_updates",
    "local_step_interval",
    "local_step_counter",
    "frozen",
    "reduce_next",
    "local_syncs",
    "local_steps_skipped",
)


def _check_int(name: str, value: object, low: int) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The fp32 gradient of a parameter the step selected for having one."""
    if p.grad is None:
        raise RuntimeError("a parameter without a gradient was selected")  # unreachable
    return p.grad.float()


class ZeroOneAdam(torch.optim.Optimizer):
    """0/1 Adam over ``params`` (every rank holds all of them), averaging over ``group``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        *,
        bias_correction: bool = True,
        deepspeed_compat: bool = False,
        fused: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        if eps < 0 or weight_decay < 0:
            raise ValueError("eps and weight_decay must be >= 0")
        self.var_freeze_step = _check_int("var_freeze_step", var_freeze_step, 1)
        self.var_update_scaler = _check_int("var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = _check_int("local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = _check_int("local_step_clipper", local_step_clipper, 1)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.bias_correction = bias_correction and not deepspeed_compat
        self.deepspeed_compat = deepspeed_compat
        self.fused = fused
        self.backend = CompressedAllReduce(group)
        self.steps = 0
        """Calls to `step` (DeepSpeed's counting: its compatible first call included)."""
        self.var_interval = 1
        self.var_counter = 0
        self.var_updates = 0
        """Variance updates so far (the exponent of its bias correction)."""
        self.local_step_interval = 1
        self.local_step_counter = 0
        self.frozen = False
        """True once the variance is frozen (after ``var_freeze_step``): local steps from then on."""
        self.reduce_next = True
        self.local_syncs = 0
        """Frozen-phase steps that averaged the momentum accumulator."""
        self.local_steps_skipped = 0
        """Frozen-phase steps that sent nothing at all (local steps)."""
        self._lrs = [0.0 for _ in self.param_groups]  # sum of lr over the local steps since the last sync

    # -- what the engine asks ------------------------------------------------------------------

    def reduces_gradients(self) -> bool:
        """Whether the engine must average the gradients of the coming step (variance steps only)."""
        return self.reduce_next and not self.frozen

    # -- the update ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        if self.deepspeed_compat and self.steps == 0:
            # DeepSpeed 0.16.5's first call only allocates (its gradient is dropped) but counts as step 1
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._state(p)
            self.steps = 1
            return loss
        t = self.steps + 1
        var_step = not self.frozen and t % self.var_interval == 0
        if var_step:
            self.var_updates += 1
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                if self.frozen:
                    self._frozen_step(gi, group, params, t)
                else:
                    self._variance_phase_step(group, params, t, var_step)
        self._advance_schedule(t, var_step)
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            st["momentum_accumulator"] = torch.zeros_like(p, dtype=torch.float32)
        return st

    def _corrections(self, beta1: float, beta2: float, t: int) -> tuple[float, float]:
        if not self.bias_correction:
            return 1.0, 1.0
        return 1 - beta1**t, 1 - beta2 ** max(self.var_updates, 1)

    def _denominator(self, v: torch.Tensor, c2: float, eps: float) -> torch.Tensor:
        # DeepSpeed's exact expression without bias correction: sqrt(v) + eps
        return (v.sqrt() if c2 == 1.0 else (v / c2).sqrt_()).add_(eps)

    def _update(
        self, p: torch.Tensor, st: dict[str, Any], group: dict[str, Any], c1: float, c2: float
    ) -> torch.Tensor:
        m, v = st["exp_avg"], st["exp_avg_sq"]
        update = (m if c1 == 1.0 else m / c1) / self._denominator(v, c2, group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p.data
        return update

    def _variance_phase_step(
        self, group: dict[str, Any], params: list[torch.Tensor], t: int, var_step: bool
    ) -> None:
        beta1, beta2 = group["betas"]
        grads = [_grad(p) for p in params]
        if not var_step and self.backend.world > 1:
            # this step's gradients were not reduced: average them here, 1 bit per element
            grads = self._compressed(group, params, grads)
        for p, g in zip(params, grads, strict=True):
            st = self._state(p)
            if var_step:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        c1, c2 = self._corrections(beta1, beta2, t)
        for p in params:
            p.add_(-group["lr"] * self._update(p, self.state[p], group, c1, c2))

    def _frozen_step(self, gi: int, group: dict[str, Any], params: list[torch.Tensor], t: int) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        c1, c2 = self._corrections(beta1, beta2, t)
        self._lrs[gi] += lr
        for p in params:
            st = self._state(p)
            st["exp_avg"].mul_(beta1).add_(_grad(p), alpha=1 - beta1)
            update = self._update(p, st, group, c1, c2)
            p.add_(-lr * update)
            st["momentum_accumulator"].add_(-lr * update)
        if t % self.local_step_interval:
            return  # a local step: nothing sent
        # synchronize: undo the local steps, average what they did, apply the average instead
        dens = []
        for p in params:
            st = self.state[p]
            u = st["momentum_accumulator"]
            p.add_(-1 * u)
            den = self._denominator(st["exp_avg_sq"], c2, group["eps"])
            u.mul_(den)
            dens.append(den)
        if self.backend.world > 1:
            us = [self.state[p]["momentum_accumulator"] for p in params]
            for u, avg in zip(us, self._compressed(group, params, us), strict=True):
                u.copy_(avg)
        for p, den in zip(params, dens, strict=True):
            st = self.state[p]
            u = st["momentum_accumulator"]
            st["exp_avg"].zero_().add_(u / self._lrs[gi], alpha=-1)
            if c1 != 1.0:
                st["exp_avg"].mul_(c1)  # store the uncorrected momentum
            p.add_(u / den)
            u.zero_()
        self._lrs[gi] = 0.0

    def _advance_schedule(self, t: int, var_step: bool) -> None:
        if not self.frozen:
            if var_step:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
            self.reduce_next = (t + 1) % self.var_interval == 0
        else:
            if t % self.local_step_interval == 0:
                self.local_syncs += 1
            else:
                self.local_steps_skipped += 1
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
        self.steps = t
        if t > self.var_freeze_step and not self.frozen:
            self.frozen = True
            self.reduce_next = False
            # the error feedback measured gradients until now; from here it measures the accumulator
            for st in self.state.values():
                for key in ("worker_error", "server_error"):
                    if key in st:
                        st[key].zero_()

    def _compressed(
        self, group: dict[str, Any], params: list[torch.Tensor], bufs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The compressed average of ``bufs`` (one per parameter): as one flat buffer or one by one."""
        if not self.fused:
            out = []
            for p, b in zip(params, bufs, strict=True):
                st = self._state(p)
                if "worker_error" not in st:
                    st["worker_error"], st["server_error"] = self.backend.new_errors(p.numel(), p.device)
                out.append(self.backend.all_reduce(b.contiguous(), st["worker_error"], st["server_error"]))
            return out
        flat = torch.cat([b.reshape(-1) for b in bufs])
        st = self._state(group["params"][0])  # the group's error buffers live with its first parameter
        if "worker_error" not in st or st["worker_error"].numel() != self.backend.padded_numel(flat.numel()):
            st["worker_error"], st["server_error"] = self.backend.new_errors(flat.numel(), flat.device)
        avg = self.backend.all_reduce(flat, st["worker_error"], st["server_error"])
        out, offset = [], 0
        for b in bufs:
            out.append(avg[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        return out

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        meta = {k: getattr(self, k) for k in _SCHEDULE}
        sd["zeroone"] = {**meta, "lrs": list(self._lrs), "world": self.backend.world}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        meta = sd.pop("zeroone", None)
        super().load_state_dict(sd)
        if meta is None:
            return
        for key in _SCHEDULE:
            setattr(self, key, type(getattr(self, key))(meta[key]))
        self._lrs = [float(x) for x in meta["lrs"]]
        if meta.get("world") != self.backend.world:
            # error feedback is per rank: another world size cannot reuse it; start it from zero
            for st in self.state.values():
                st.pop("worker_error", None)
                st.pop("server_error", None)
