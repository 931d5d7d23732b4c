"""0/1 Adam (Lu et al., arXiv:2202.06009): adaptive variance freezing and skipped communication, on
the same error-feedback 1-bit all-reduce as 1-bit Adam (torch.distributed: gloo and NCCL, CPU and CUDA).

The design, in full: docs/onebit.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from dstrain.dist.comm import all_gather_single
from dstrain.onebit.adam import Partition, adam_defaults
from dstrain.onebit.compressed import CompressedAllReduce

__all__ = ["ZeroOneAdam"]

_MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_accumulator")

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


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive pieces of ``flat`` shaped like ``like``."""
    out, offset = [], 0
    for x in like:
        out.append(flat[offset : offset + x.numel()].view_as(x))
        offset += x.numel()
    if offset != flat.numel():
        raise ValueError(f"{offset} elements of parameters for a buffer of {flat.numel()}")
    return out


def _master(st: dict[str, Any], part: Partition) -> torch.Tensor:
    """This rank's whole fp32 master replica after the freeze: the flat buffer itself (fp32), else a copy."""
    if "full_master" in st:
        return st["full_master"]
    if part.flat is None:
        raise ValueError("ZeRO stage 1 partitions of 0/1 Adam need the flat buffer")
    return part.flat


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
        partitions: list[Partition] | None = None,
    ) -> None:
        defaults = adam_defaults(lr, betas, eps, weight_decay, fused=fused, partitions=partitions)
        self.var_freeze_step = _check_int("var_freeze_step", var_freeze_step, 1)
        self.var_update_scaler = _check_int("var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = _check_int("local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = _check_int("local_step_clipper", local_step_clipper, 1)
        super().__init__(params, defaults)
        self.bias_correction = bias_correction and not deepspeed_compat
        self.deepspeed_compat = deepspeed_compat
        self.fused = fused
        self.backend = CompressedAllReduce(group)
        self.partitions = partitions
        if partitions is not None and len(partitions) != len(self.param_groups):
            raise ValueError(f"{len(partitions)} partitions for {len(self.param_groups)} param groups")
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

    @property
    def replicated(self) -> bool:
        """ZeRO stage 1 after the freeze: every rank holds (and writes) its whole replica of the flat
        buffers, so ZeRO must not gather the parameters after a step."""
        if self.partitions is None:
            return False
        return "full_exp_avg" in self.state.get(self.param_groups[0]["params"][0], {})

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
            part = self.partitions[gi] if self.partitions is not None else None
            if not params:
                continue
            if self.frozen and part is not None:
                self._frozen_replica_step(gi, group, params, part, t)
            elif self.frozen:
                items = [(p, _grad(p), self._state(p)) for p in params]
                self._frozen_step(gi, group, items, t, partial(self._compressed, group, params))
            else:
                self._variance_phase_step(group, params, t, var_step, part)
        self._advance_schedule(t, var_step)
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if "exp_avg" not in st:
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
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        t: int,
        var_step: bool,
        part: Partition | None = None,
    ) -> None:
        beta1, beta2 = group["betas"]
        grads = [_grad(p) for p in params]
        if not var_step and self.backend.world > 1 and part is not None:
            # stage 1: average the whole local gradient (what stage 0 compresses), keep our slice
            avg = self._compress_flat(group, part.flat_grad)
            grads = _split(avg[part.lo : part.hi], params)
        elif not var_step and self.backend.world > 1:
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

    def _frozen_step(
        self,
        gi: int,
        group: dict[str, Any],
        items: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
        t: int,
        compress: Any,
    ) -> None:
        """One frozen-phase step of ``items`` (parameter, fp32 gradient, state with the moments and the
        accumulator); ``compress`` averages a list of accumulators with the compressed all-reduce."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        c1, c2 = self._corrections(beta1, beta2, t)
        self._lrs[gi] += lr
        for p, g, st in items:
            st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            update = self._update(p, st, group, c1, c2)
            p.add_(-lr * update)
            st["momentum_accumulator"].add_(-lr * update)
        if t % self.local_step_interval:
            return  # a local step: nothing sent
        # synchronize: undo the local steps, average what they did, apply the average instead
        dens = []
        for p, _, st in items:
            u = st["momentum_accumulator"]
            p.add_(-1 * u)
            den = self._denominator(st["exp_avg_sq"], c2, group["eps"])
            u.mul_(den)
            dens.append(den)
        if self.backend.world > 1:
            us = [st["momentum_accumulator"] for _, _, st in items]
            for u, avg in zip(us, compress(us), strict=True):
                u.copy_(avg)
        for (p, _, st), den in zip(items, dens, strict=True):
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
        return _split(self._compress_flat(group, torch.cat([b.reshape(-1) for b in bufs])), bufs)

    def _compress_flat(self, group: dict[str, Any], flat: torch.Tensor) -> torch.Tensor:
        """The compressed average of one flat fp32 buffer with the group's error feedback."""
        st = self.state[group["params"][0]]  # the group's error buffers live with its first parameter
        if "worker_error" not in st or st["worker_error"].numel() != self.backend.padded_numel(flat.numel()):
            st["worker_error"], st["server_error"] = self.backend.new_errors(flat.numel(), flat.device)
        return self.backend.all_reduce(flat, st["worker_error"], st["server_error"])

    # -- ZeRO stage 1 after the freeze: each rank's whole replica --------------------------------

    def _frozen_replica_step(
        self, gi: int, group: dict[str, Any], params: list[torch.Tensor], part: Partition, t: int
    ) -> None:
        """Stage 0's frozen step on the whole flat: the group's whole m, v, accumulator and fp32 master
        (gathered from the slices at the first frozen step), then the flat and our slice written back."""
        st = self._replica(group, params, part)
        master = _master(st, part)
        full = {k: st["full_" + k] for k in _MOMENTS}
        self._frozen_step(
            gi, group, [(master, part.flat_grad, full)], t, lambda us: [self._compress_flat(group, us[0])]
        )
        if part.flat is not None and master is not part.flat:  # fp16/bf16: the model computes in its dtype
            part.flat.copy_(master)
            for p, src in zip(params, _split(master[part.lo : part.hi], params), strict=True):
                p.copy_(src)

    def _replica(self, group: dict[str, Any], params: list[torch.Tensor], part: Partition) -> dict[str, Any]:
        st = self.state[group["params"][0]]
        if "full_exp_avg" in st:
            return st
        # the first frozen step: gather m, v and the accumulator (zero so far), and the fp32 master
        # where it is not the flat buffer itself; the slices' own copies are dropped
        for key in _MOMENTS:
            st["full_" + key] = self._gather([self._state(p)[key] for p in params], part)
        if part.flat is None or part.flat.dtype != torch.float32:
            st["full_master"] = self._gather(params, part)
        for p in params:
            for key in _MOMENTS:
                self.state[p].pop(key, None)
        return st

    def _gather(self, slices: list[torch.Tensor], part: Partition) -> torch.Tensor:
        local = torch.cat([x.detach().reshape(-1).float() for x in slices])  # (hi - lo,)
        if local.numel() != part.hi - part.lo:
            raise ValueError(f"parameters of {local.numel()} elements for a range of {part.hi - part.lo}")
        full = torch.empty(part.flat_grad.numel(), dtype=torch.float32, device=local.device)
        if self.backend.world > 1:
            all_gather_single(full, local, group=self.backend.group)
        else:
            full.copy_(local)
        return full

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        meta = {k: getattr(self, k) for k in _SCHEDULE}
        sd["zeroone"] = {**meta, "lrs": list(self._lrs), "world": self.backend.world}
        first = 0
        for group, part in zip(self.param_groups, self.partitions or [], strict=False):
            st = self.state[group["params"][0]]
            if "full_exp_avg" in st and "full_master" not in st and part.flat is not None:
                # fp32 at stage 1 after the freeze: this rank's whole replica is the flat buffer itself
                sd["state"][first] = {**sd["state"][first], "full_master": part.flat.detach().clone()}
            first += len(group["params"])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        meta = sd.pop("zeroone", None)
        super().load_state_dict(sd)
        for group, part in zip(self.param_groups, self.partitions or [], strict=False):
            st = self.state[group["params"][0]]
            if "full_master" in st and part.flat is not None:  # stage 1 after the freeze: our replica
                if part.flat.dtype == torch.float32:
                    part.flat.copy_(st.pop("full_master"))
                else:
                    part.flat.copy_(st["full_master"])
                    params = group["params"]
                    for p, src in zip(
                        params, _split(st["full_master"][part.lo : part.hi], params), strict=True
                    ):
                        p.data.copy_(src)
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
