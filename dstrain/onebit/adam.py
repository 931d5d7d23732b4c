"""1-bit Adam: Adam whose momentum is averaged by an error-feedback 1-bit all-reduce after a warm-up.

The design, in full: docs/onebit.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dstrain.dist.comm import all_gather_single
from dstrain.onebit.compressed import CompressedAllReduce

__all__ = ["OneBitAdam", "Partition", "adam_defaults"]


@dataclass(frozen=True, slots=True)
class Partition:
    """ZeRO stage 1: a param group's whole fp32 gradient and this rank's range ``[lo, hi)`` of it (the
    optimizer's parameters of that group are that range, in order)."""

    flat_grad: torch.Tensor
    """(padded,) fp32: the whole gradient, exactly what stage 0's optimizer reads: all-reduced when the
    optimizer asked for it, else this rank's own local gradient; unscaled and clipped by the engine."""
    lo: int
    hi: int
    flat: torch.Tensor | None = None
    """(padded,) the group's flat parameter buffer (the model's dtype; fp32 training: the master
    itself). 0/1 Adam writes its whole replica here after its freeze."""


def adam_defaults(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    *,
    fused: bool,
    partitions: list[Partition] | None,
) -> dict[str, Any]:
    """The param groups' defaults of the compressed Adams (`OneBitAdam`, 0/1 Adam), checked: a
    ``ValueError`` names the argument; ZeRO stage 1 ``partitions`` need the fused step."""
    if partitions is not None and not fused:
        raise ValueError("fused must be True with ZeRO stage 1 partitions")
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {betas!r}")
    if eps < 0 or weight_decay < 0:
        raise ValueError("eps and weight_decay must be >= 0")
    return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}


class OneBitAdam(torch.optim.Optimizer):
    """Adam with 1-bit compressed momentum averaging after ``freeze_step`` steps.

    ``params`` are the parameters this rank updates (every rank holds all of them: 1-bit Adam is
    data parallel, ZeRO stage 0 or 1 at most). ``group`` is the data-parallel process group.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        deepspeed_compat: bool = False,
        fused: bool = True,
        group: dist.ProcessGroup | None = None,
        partitions: list[Partition] | None = None,
    ) -> None:
        defaults = adam_defaults(lr, betas, eps, weight_decay, fused=fused, partitions=partitions)
        if not (isinstance(freeze_step, int) and freeze_step >= 1):
            raise ValueError(f"freeze_step must be an integer >= 1, got {freeze_step!r}")
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.bias_correction = bias_correction and not deepspeed_compat
        self.deepspeed_compat = deepspeed_compat
        self.fused = fused
        self.backend = CompressedAllReduce(group)
        self.partitions = partitions
        if partitions is not None and len(partitions) != len(self.param_groups):
            raise ValueError(f"{len(partitions)} partitions for {len(self.param_groups)} param groups")
        self.steps = 0
        """Calls to `step` (the DeepSpeed-compatible first call included)."""

    # -- what the engine asks ------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen and momentum goes through the compressed all-reduce."""
        return self.steps >= self.freeze_step

    def reduces_gradients(self) -> bool:
        """Whether the engine must average gradients before `step` (True during warm-up only)."""
        return not self.frozen

    # -- the update ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        first_compat_call = self.deepspeed_compat and self.steps == 0
        compress = self.frozen and self.backend.world > 1
        if first_compat_call:
            # DeepSpeed 0.16.5's first call only allocates its buffers: the moments stay zero (its
            # compressed all-reduce of the zero momentum returns zeros) and the parameters do not move
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and not self.state[p]:
                        self.state[p].update(
                            step=0,
                            exp_avg=torch.zeros_like(p, dtype=torch.float32),
                            exp_avg_sq=torch.zeros_like(p, dtype=torch.float32),
                        )
            self.steps += 1
            return loss
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            partition = self.partitions[gi] if self.partitions is not None else None
            for p in params:
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                if compress and partition is not None:
                    continue  # stage 1 after the freeze: the full momentum takes the full gradient below
                g = p.grad.float()
                st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                if not self.frozen:
                    st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if compress and partition is not None:
                self._average_full_momentum(group, params, partition)
            elif compress:
                self._average_momentum(group, params)
            for p in params:
                st = self.state[p]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if self.bias_correction:
                    t = st["step"]
                    t_v = min(t, self.freeze_step)
                    denom = (v / (1 - beta2**t_v)).sqrt_().add_(group["eps"])
                    update = (m / (1 - beta1**t)) / denom
                else:
                    update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p.data
                p.add_(-group["lr"] * update)
        self.steps += 1
        return loss

    def _average_momentum(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if self.fused:
            ms = [self.state[p]["exp_avg"] for p in params]
            flat = torch.cat([m.reshape(-1) for m in ms])
            gs = self._group_state(group, flat.numel())
            avg = self.backend.all_reduce(flat, gs["worker_error"], gs["server_error"])
            offset = 0
            for m in ms:
                m.copy_(avg[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
            return
        for p in params:
            st = self.state[p]
            if "worker_error" not in st:
                st["worker_error"], st["server_error"] = self.backend.new_errors(p.numel(), p.device)
            m = st["exp_avg"]
            m.copy_(self.backend.all_reduce(m, st["worker_error"], st["server_error"]))

    def _average_full_momentum(
        self, group: dict[str, Any], params: list[torch.Tensor], part: Partition
    ) -> None:
        # ZeRO stage 1: m (full) = beta1 m + (1 - beta1) g_local (full), averaged, then our slice kept
        ms = [self.state[p]["exp_avg"] for p in params]
        gs = self.state[group["params"][0]]
        full = gs.get("full_exp_avg")
        if full is None:  # first frozen step: gather the momentum slices of every rank, once
            local = torch.cat([m.reshape(-1) for m in ms])  # (hi - lo,)
            if local.numel() != part.hi - part.lo:
                raise ValueError(f"parameters of {local.numel()} elements for a range of {part.hi - part.lo}")
            full = torch.empty(part.flat_grad.numel(), dtype=torch.float32, device=local.device)
            all_gather_single(full, local, group=self.backend.group)
            gs["full_exp_avg"] = full
        beta1 = group["betas"][0]
        full.mul_(beta1).add_(part.flat_grad.float(), alpha=1 - beta1)
        errors = self._group_state(group, full.numel())
        full.copy_(self.backend.all_reduce(full, errors["worker_error"], errors["server_error"]))
        offset = part.lo
        for m in ms:
            m.copy_(full[offset : offset + m.numel()].view_as(m))
            offset += m.numel()

    def _group_state(self, group: dict[str, Any], numel: int) -> dict[str, Any]:
        # fused error buffers belong to the group; kept in the state of its first parameter so that
        # torch's state_dict() saves and restores them with everything else
        st = self.state[group["params"][0]]
        if "worker_error" not in st or st["worker_error"].numel() != self.backend.padded_numel(numel):
            st["worker_error"], st["server_error"] = self.backend.new_errors(numel, group["params"][0].device)
        return st

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["onebit"] = {"steps": self.steps, "freeze_step": self.freeze_step, "world": self.backend.world}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        meta = sd.pop("onebit", None)
        super().load_state_dict(sd)
        self.steps = int(meta["steps"]) if meta else 0
        if meta and meta.get("world") != self.backend.world:
            # error feedback is per rank: another world size cannot reuse it; start it from zero
            for st in self.state.values():
                st.pop("worker_error", None)
                st.pop("server_error", None)
                st.pop("full_exp_avg", None)  # sized for the old world; re-gathered from the slices
