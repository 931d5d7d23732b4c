"""1-bit Adam and 0/1 Adam composed into dstrain: a gradient `Reducer` that reduces only when the
optimizer asks, and a `Stepper` over `OneBitAdam` / `ZeroOneAdam` (the engine is not touched;
`dstrain.initialize` calls `build_routes` and `build_stepper` here when `applies`: the config's
optimizer is one of `NAMES`).

When the optimizer asks (1-bit Adam's warm-up, 0/1 Adam's variance steps) the reducer sums gradients
over the data-parallel group like the default reducer (the loss was pre-scaled by 1/dp, so the sum is
the mean). Otherwise it sends nothing and undoes the pre-scale, so each rank's optimizer sees its own
full-scale local gradient and averages what it needs with the compressed all-reduce.

What composes, for both optimizers (each tested: tests/dstrain/onebit/test_onebit_stage1.py): ZeRO stage 0
(parameters, gradients and optimizer state replicated) and ZeRO stage 1 (master weights and optimizer
state partitioned: see `dstrain.onebit.adam` and `dstrain.onebit.zeroone` for what stays whole), each
with fp32, bf16 and fp16 (fp32 masters, dynamic loss scaling: an overflow step is skipped on every
rank), gradient clipping, gradient accumulation, LR schedules, ``overlap_comm`` and MoE layers with
``ep_size`` 1. The routes are ``full_grad``: at stage 1 ZeRO keeps the whole gradient as the fp32
master gradient, so the engine unscales, measures and clips exactly what stage 0 does and the optimizer
reads it whole (stage 1 equals stage 0 bitwise). Refused at initialize with a `ConfigError` naming the
field: ZeRO stages 2 and 3, optimizer offload, ``fused: false`` at stage 1, pipeline parallelism and
expert parallelism (``ep_size`` > 1).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.dist.comm import Comm
from dstrain.dist.topology import Topology
from dstrain.errors import ConfigError
from dstrain.onebit.adam import OneBitAdam, Partition
from dstrain.onebit.compressed import CompressedStatistics
from dstrain.onebit.lamb import OneBitLamb
from dstrain.onebit.zeroone import ZeroOneAdam
from dstrain.optim.lamb import per_parameter_groups
from dstrain.optim.stepper import StepperStatistics, TorchStepper
from dstrain.zero.dp import DataParallelZero
from dstrain.zero.reduce import DefaultReducer, Handle, Route

__all__ = [
    "NAMES",
    "applies",
    "build_routes",
    "build_stepper",
    "OneBitReducer",
    "OneBitStepper",
    "OneBitStepperStatistics",
    "lamb_options",
    "onebit_options",
    "zeroone_options",
]

NAMES = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
"""The config's ``optimizer.type`` names this room builds."""


def applies(config: Any, model: torch.nn.Module | None = None) -> bool:
    """Whether this room builds the routes and the stepper: the config's optimizer is one of `NAMES`."""
    return config is not None and config.optimizer is not None and config.optimizer.name in NAMES


log = logging.getLogger("dstrain")

_TRANSPORT_ONLY = ("cuda_aware", "comm_backend_name")
_KEYS = ("lr", "betas", "eps", "weight_decay", "freeze_step", "bias_correction", "deepspeed_compat", "fused")
_ZEROONE_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
    "bias_correction",
    "deepspeed_compat",
    "fused",
)


def onebit_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """OneBitAdam's keyword arguments from the config's ``optimizer.params`` (DeepSpeed's names and
    defaults; ``cuda_aware`` / ``comm_backend_name`` are accepted and logged as not needed)."""
    return _options(params, _KEYS, "OneBitAdam")


def zeroone_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """ZeroOneAdam's keyword arguments from the config's ``optimizer.params`` (DeepSpeed 0.16.5's names
    and defaults). ``amsgrad`` and ``eps_inside_sqrt`` are accepted when false (DeepSpeed refused the
    first and ignored the second); true raises `ConfigError`."""
    out = dict(params)
    for flag in ("amsgrad", "eps_inside_sqrt"):
        if out.pop(flag, False):
            raise ConfigError(f"optimizer.params.{flag}", "not supported by 0/1 Adam; use false")
    return _options(out, _ZEROONE_KEYS, "ZeroOneAdam")


_LAMB_KEYS = (
    "lr",
    "freeze_step",
    "betas",
    "eps",
    "weight_decay",
    "max_coeff",
    "min_coeff",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
)


def lamb_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """OneBitLamb's keyword arguments (DeepSpeed 0.16.5's names and defaults). DeepSpeed's OnebitLamb takes
    ``bias_correction`` and ``eps_inside_sqrt`` and uses neither: both are accepted with no effect when
    they ask for DeepSpeed's arithmetic (any ``bias_correction``; ``eps_inside_sqrt: false``); ``amsgrad``
    and ``eps_inside_sqrt: true`` raise `ConfigError`."""
    out = dict(params)
    out.pop("bias_correction", None)
    for flag in ("amsgrad", "eps_inside_sqrt"):
        if out.pop(flag, False):
            raise ConfigError(f"optimizer.params.{flag}", "not supported by 1-bit LAMB; use false")
    return _options(out, _LAMB_KEYS, "OneBitLamb")


def _options(params: Mapping[str, Any], keys: tuple[str, ...], name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _TRANSPORT_ONLY:
            log.info(
                "optimizer.params.%s=%r: not needed, dstrain's 1-bit Adam runs on torch.distributed",
                key,
                value,
            )
        elif key in keys:
            out[key] = tuple(value) if key == "betas" else value
        elif key == "max_grad_norm":
            if value:
                raise ConfigError("optimizer.params.max_grad_norm", "use the top-level gradient_clipping")
        else:
            raise ConfigError(
                f"optimizer.params.{key}",
                f"not a {name} parameter; accepted: {', '.join(keys + _TRANSPORT_ONLY)}",
            )
    return out


class OneBitReducer:
    """Sums gradients during warm-up; after the freeze, sends nothing (1-bit Adam averages momentum)."""

    def __init__(self) -> None:
        self.optimizer: OneBitAdam | ZeroOneAdam | OneBitLamb | None = None
        self._default = DefaultReducer()
        self.skipped = 0

    def reduce(
        self, flat: torch.Tensor, comm: Comm, *, out: torch.Tensor | None = None, async_op: bool = True
    ) -> Handle:
        if self.optimizer is None or self.optimizer.reduces_gradients():
            return self._default.reduce(flat, comm, out=out, async_op=async_op)
        self.skipped += 1
        flat.mul_(comm.world_size)  # undo the 1/dp loss pre-scale: the local gradient at full scale
        if out is not None:  # a reduce-scatter caller (the Reducer protocol; full_grad routes never ask)
            out.copy_(flat.view(comm.world_size, -1)[comm.rank])
        return _Done()


class _Done:
    def wait(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True, slots=True)
class OneBitStepperStatistics(StepperStatistics):
    """`StepperStatistics` plus the freeze and the compressed all-reduce's counters."""

    frozen: bool
    skipped_reductions: int
    """Gradient reductions not sent (1-bit Adam after the freeze; 0/1 Adam off its variance steps)."""
    compressed: CompressedStatistics
    local_steps: int = 0
    """0/1 Adam: frozen-phase steps that sent nothing at all (skipped communication)."""
    local_syncs: int = 0
    """0/1 Adam: frozen-phase steps that averaged the momentum accumulator."""


class OneBitStepper(TorchStepper):
    """`Stepper` over `OneBitAdam` or `ZeroOneAdam` (a `TorchStepper` with 1-bit statistics); binds its
    `OneBitReducer` to the optimizer, which tells it when to reduce."""

    reshapable_state = False
    """Its error feedback is per rank (a worker's compression error of the whole flat, a server's of its
    chunk): a checkpoint of it loads only at the world size and stage it was saved with."""

    def __init__(
        self,
        optimizer: OneBitAdam | ZeroOneAdam | OneBitLamb,
        reducer: OneBitReducer,
        zero_groups: Sequence[Any] = (),
    ) -> None:
        super().__init__(optimizer)
        self.optimizer: OneBitAdam | ZeroOneAdam | OneBitLamb = optimizer
        self.reducer = reducer
        reducer.optimizer = optimizer
        self._zero_groups = list(zero_groups)  # ZeRO's flat groups: told when 0/1 Adam holds replicas

    def step(self) -> None:
        super().step()
        self._tell_zero()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._tell_zero()

    def _tell_zero(self) -> None:
        # 0/1 Adam at stage 1 after its freeze writes every rank's whole replica: ZeRO must not gather
        replicated = isinstance(self.optimizer, ZeroOneAdam) and self.optimizer.replicated
        for g in self._zero_groups:
            g.replicated = replicated

    def statistics(self) -> OneBitStepperStatistics:
        opt = self.optimizer
        local = (opt.local_steps_skipped, opt.local_syncs) if isinstance(opt, ZeroOneAdam) else (0, 0)
        return OneBitStepperStatistics(
            steps=self._steps,
            prepares=self._prepares,
            frozen=opt.frozen,
            skipped_reductions=self.reducer.skipped,
            compressed=opt.backend.statistics(),
            local_steps=local[0],
            local_syncs=local[1],
        )


def build_routes(groups: list[dict[str, Any]], topology: Topology) -> list[Route]:
    """Every param group reduced by one shared `OneBitReducer` over the data-parallel group.

    Pipeline stages (pp > 1) and expert parallelism (ep > 1) are refused with a `ConfigError` naming
    ``optimizer.type``: neither has been built or tested with the compressed momentum average (an expert
    group would have to average over its expert-data-parallel group, a pipeline stage's clipping norm
    over every stage). MoE layers with ``ep_size`` 1 are plain data-parallel parameters and compose.
    """
    for kind, size in (
        ("pipeline parallelism", topology.layout.pp),
        ("expert parallelism", topology.layout.ep),
    ):
        if size > 1:
            raise ConfigError("optimizer.type", f"1-bit optimizers do not compose with {kind} (size {size})")
    reducer = OneBitReducer()
    return [Route(reducer, topology.dp, full_grad=True) for _ in groups]


def build_stepper(zero: Any, config: Any) -> OneBitStepper:
    """The `OneBitStepper` over ZeRO's master param groups, bound to the `OneBitReducer` of its routes.

    ``config`` is the `DSConfig`. Both optimizers: ZeRO stage 0 or 1 (stage 1: ``fused`` only).
    """
    name = config.optimizer.name
    stage = config.zero_optimization.stage
    if stage not in (0, 1):
        raise ConfigError(
            "zero_optimization.stage",
            f"{name} composes with ZeRO stage 0 or 1 (got {stage}): it needs every rank's whole local "
            "gradient and momentum",
        )
    routes = [g.route for g in zero.groups] if isinstance(zero, DataParallelZero) else []
    reducers = {id(r.reducer) for r in routes}
    if len(reducers) != 1 or not isinstance(routes[0].reducer, OneBitReducer):
        raise ConfigError(
            "optimizer.type", f"{name} needs its own gradient routes (dstrain.onebit.compose.build_routes)"
        )
    group = routes[0].comm.group
    if name == "OneBitLamb":
        if stage != 0:
            raise ConfigError(
                "zero_optimization.stage",
                "OneBitLamb composes with ZeRO stage 0 (its update needs whole parameters)",
            )
        groups = per_parameter_groups(zero.groups)  # LAMB's trust ratio is per parameter, as in DeepSpeed
        lamb = OneBitLamb(groups, group=group, **lamb_options(config.optimizer.params))
        lamb.backend.counter = routes[0].comm  # engine.statistics().comm counts the compressed traffic
        return OneBitStepper(lamb, routes[0].reducer)
    zeroone = name == "ZeroOneAdam"
    options = zeroone_options(config.optimizer.params) if zeroone else onebit_options(config.optimizer.params)
    partitions = None
    if stage == 1:
        if not options.get("fused", True):
            raise ConfigError("optimizer.params.fused", f"{name} at ZeRO stage 1 compresses fused buffers")
        partitions = []
        for g in zero.groups:
            if g.flat_grad is None or g.master_grad.numel() != g.flat.numel():
                raise ConfigError("zero_optimization.stage", f"{name} needs the whole flat gradient")
            lo, hi = g.range
            partitions.append(Partition(g.master_grad, lo, hi, flat=g.flat))
    opt: OneBitAdam | ZeroOneAdam
    if zeroone:
        opt = ZeroOneAdam(zero.param_groups(), group=group, partitions=partitions, **options)
    else:
        opt = OneBitAdam(zero.param_groups(), group=group, partitions=partitions, **options)
    opt.backend.counter = routes[0].comm  # engine.statistics().comm counts the compressed traffic
    return OneBitStepper(opt, routes[0].reducer, zero.groups if stage == 1 else [])
