"""1-bit Adam composed into dstrain: a gradient `Reducer` that stops reducing at the freeze, and a
`Stepper` over `OneBitAdam` (the engine is not touched; `dstrain.initialize` calls `build_routes` and
`build_stepper` here when the config's optimizer is ``OneBitAdam``).

Warm-up: the reducer sums gradients over the data-parallel group like the default reducer (the loss
was pre-scaled by 1/dp, so the sum is the mean). After ``freeze_step`` it sends nothing and undoes the
pre-scale, so each rank's optimizer sees its own full-scale local gradient; `OneBitAdam` then averages
the momentum with the compressed all-reduce. Composes with ZeRO stage 0 (parameters, gradients and
optimizer state replicated), fp32 and bf16/fp16 (fp32 masters); other stages are refused at initialize.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.dist.comm import Comm
from dstrain.errors import ConfigError
from dstrain.onebit.adam import OneBitAdam
from dstrain.onebit.compressed import CompressedStatistics
from dstrain.optim.stepper import StepperStatistics, TorchStepper
from dstrain.zero.reduce import DefaultReducer, Handle, Route

__all__ = ["OneBitReducer", "OneBitStepper", "OneBitStepperStatistics", "onebit_options"]

log = logging.getLogger("dstrain")

_TRANSPORT_ONLY = ("cuda_aware", "comm_backend_name")
_KEYS = ("lr", "betas", "eps", "weight_decay", "freeze_step", "bias_correction", "deepspeed_compat", "fused")


def onebit_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """OneBitAdam's keyword arguments from the config's ``optimizer.params`` (DeepSpeed's names and
    defaults; ``cuda_aware`` / ``comm_backend_name`` are accepted and logged as not needed)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _TRANSPORT_ONLY:
            log.info(
                "optimizer.params.%s=%r: not needed, dstrain's 1-bit Adam runs on torch.distributed",
                key,
                value,
            )
        elif key in _KEYS:
            out[key] = tuple(value) if key == "betas" else value
        elif key == "max_grad_norm":
            if value:
                raise ConfigError("optimizer.params.max_grad_norm", "use the top-level gradient_clipping")
        else:
            raise ConfigError(
                f"optimizer.params.{key}",
                f"not a OneBitAdam parameter; accepted: {', '.join(_KEYS + _TRANSPORT_ONLY)}",
            )
    return out


class OneBitReducer:
    """Sums gradients during warm-up; after the freeze, sends nothing (1-bit Adam averages momentum)."""

    def __init__(self) -> None:
        self.optimizer: OneBitAdam | None = None
        self._default = DefaultReducer()
        self.skipped = 0

    def reduce(
        self, flat: torch.Tensor, comm: Comm, *, out: torch.Tensor | None = None, async_op: bool = True
    ) -> Handle:
        if self.optimizer is None or self.optimizer.reduces_gradients():
            return self._default.reduce(flat, comm, out=out, async_op=async_op)
        if out is not None:
            raise ConfigError(
                "zero_optimization.stage", "1-bit Adam needs each rank's full local gradient (stage 0)"
            )
        self.skipped += 1
        flat.mul_(comm.world_size)  # undo the 1/dp loss pre-scale: the local gradient at full scale
        return _Done()


class _Done:
    def wait(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True, slots=True)
class OneBitStepperStatistics(StepperStatistics):
    """`StepperStatistics` plus the freeze and the compressed all-reduce's counters."""

    frozen: bool
    skipped_reductions: int
    """Gradient reductions not sent because the variance was frozen."""
    compressed: CompressedStatistics


class OneBitStepper(TorchStepper):
    """`Stepper` over `OneBitAdam` (a `TorchStepper` with 1-bit statistics); binds its `OneBitReducer`
    to the optimizer, which tells it when the freeze begins."""

    def __init__(self, optimizer: OneBitAdam, reducer: OneBitReducer) -> None:
        super().__init__(optimizer)
        self.optimizer: OneBitAdam = optimizer
        self.reducer = reducer
        reducer.optimizer = optimizer

    def statistics(self) -> OneBitStepperStatistics:
        return OneBitStepperStatistics(
            steps=self._steps,
            prepares=self._prepares,
            frozen=self.optimizer.frozen,
            skipped_reductions=self.reducer.skipped,
            compressed=self.optimizer.backend.statistics(),
        )


def build_routes(groups: list[dict[str, Any]], dp: Comm) -> list[Route]:
    """Every param group reduced by one shared `OneBitReducer` over the data-parallel group."""
    reducer = OneBitReducer()
    return [Route(reducer, dp) for _ in groups]


def build_stepper(zero: Any, params: Mapping[str, Any], stage: int) -> OneBitStepper:
    """The `OneBitStepper` over ZeRO's master param groups, bound to the `OneBitReducer` of its routes
    (ZeRO stage 0 only)."""
    if stage != 0:
        raise ConfigError(
            "zero_optimization.stage",
            f"OneBitAdam composes with ZeRO stage 0 in this release (got stage {stage}): it needs every rank's "
            "full local momentum; stage 1 is planned",
        )
    routes = [g.route for g in getattr(zero, "groups", [])]
    reducers = {id(r.reducer) for r in routes}
    if len(reducers) != 1 or not isinstance(routes[0].reducer, OneBitReducer):
        raise ConfigError(
            "optimizer.type", "OneBitAdam needs its own gradient routes (dstrain.onebit.room.build_routes)"
        )
    opt = OneBitAdam(zero.param_groups(), group=routes[0].comm.group, **onebit_options(params))
    return OneBitStepper(opt, routes[0].reducer)
