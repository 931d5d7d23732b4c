"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Step accounting is DeepSpeed's: a schedule starts at ``last_batch_iteration = -1`` and sets the lr of
iteration -1 at construction (``warmup_min_lr``, ``cycle_min_lr``, ``lr_range_test_min_lr``; 0 for
WarmupCosineLR), which is the lr of the first optimizer step. After each optimizer step that was not
skipped the engine calls `step`, which advances ``last_batch_iteration`` by one and sets the lr of that
iteration for the next optimizer step. So optimizer step k (from 0) runs at the lr of iteration k - 1.
Per-group values may be lists (one per param group), as in DeepSpeed.
tests/dstrain/test_lr_schedules.py checks every schedule step by step against DeepSpeed's own code.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from dstrain.config_sections import SchedulerConfig

__all__ = [
    "LRRangeTest",
    "LRSchedule",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]


class HasParamGroups(Protocol):
    """What a schedule edits: a torch optimizer, or a dstrain `Stepper`."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def _per_group(optimizer: HasParamGroups, value: Any, name: str) -> list[float]:
    """A scalar for every group, or one value per group (DeepSpeed's ``_format_param``)."""
    n = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"expected {n} values for {name} (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * n


def _set_lrs(optimizer: HasParamGroups, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        # a tensor lr (torch's capturable / fused options) stays a tensor
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(g["lr"]) for g in optimizer.param_groups]


class LRSchedule:
    """Base: `lrs_at` gives each group's lr at an iteration (-1: before the first `step`)."""

    def __init__(self, optimizer: HasParamGroups, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr = [float(g["lr"]) for g in optimizer.param_groups]
        if self.last_batch_iteration == -1:  # the lr of the first optimizer step
            self._apply()

    def lrs_at(self, iteration: int) -> list[float]:
        """Learning rate of each param group at ``iteration`` (-1 before the first `step`)."""
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.lrs_at(self.last_batch_iteration))

    def step(self, last_batch_iteration: int | None = None) -> None:
        """After an optimizer step: advance one iteration (or jump to ``last_batch_iteration``), set the lrs."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else int(last_batch_iteration)
        )
        self._apply()

    def get_lr(self) -> list[float]:
        """The lrs of the current iteration (what the next optimizer step uses)."""
        return self.lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last set on the param groups."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the iteration (DeepSpeed's format; older dstrain states also carry ``base_lrs``)."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


def _warmup_gamma(iteration: int, warmup_steps: int, kind: str) -> float:
    if kind == "log":  # DeepSpeed's arithmetic: (1 / log(n)) x log(k + 1), for equal roundings
        return (1.0 / math.log(warmup_steps)) * math.log(iteration + 1)
    return iteration / warmup_steps


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


class WarmupLR(LRSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr) over ``warmup_num_steps``
    (log or linear), then flat."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return max(
            0.0,
            float(self.total_num_steps - iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(LRSchedule):
    """Ratio of each group's lr: warm up from ``warmup_min_ratio`` to 1, then cosine to ``cos_min_ratio``
    at ``total_num_steps`` (0 before the first `step`, as in DeepSpeed)."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(
            1.0,
            (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps),
        )
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "org_lrs": list(self.org_lrs)}  # dstrain: the ratios' base

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "org_lrs" in state:
            self.org_lrs = [float(v) for v in state["org_lrs"]]
        elif "base_lrs" in state:  # dstrain before DeepSpeed's accounting
            self.org_lrs = [float(v) for v in state["base_lrs"]]
        super().load_state_dict(state)


class LRRangeTest(LRSchedule):
    """The LR range test: from ``lr_range_test_min_lr`` up by ``step_rate`` every ``step_size`` steps
    (continuously, or in stairs with ``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if (
            isinstance(lr_range_test_step_size, bool)
            or not isinstance(lr_range_test_step_size, int)
            or lr_range_test_step_size <= 0
        ):
            raise ValueError(
                f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}"
            )
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lr * increase for lr in self.min_lrs]


class OneCycle(LRSchedule):
    """DeepSpeed's 1Cycle: lr from ``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
    steps and back over ``cycle_second_step_size`` (optionally in stairs), then decayed by
    ``decay_lr_rate`` every ``decay_step_size`` steps; with ``cycle_momentum`` and an optimizer with
    ``betas``, beta1 cycles the other way between ``cycle_max_mom`` and ``cycle_min_mom`` (beta2 is set to
    0.99, as DeepSpeed does)."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size!r}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        # DeepSpeed cycles momentum only for optimizers with betas (Adam-like); SGD keeps its momentum
        self.cycle_momentum = bool(cycle_momentum) and all("betas" in g for g in optimizer.param_groups)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        super().__init__(optimizer, last_batch_iteration)

    def _scale_factor(self, iteration: int) -> float:
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:  # flat across each stair, quantised from the integer offset (as DeepSpeed)
            at = batch % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[tuple[float, float]]:
        """``betas`` of each group at ``iteration``."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The momentum (betas) of the current iteration, None without momentum cycling."""
        return self.moms_at(self.last_batch_iteration) if self.cycle_momentum else None

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            for group, betas in zip(
                self.optimizer.param_groups, self.moms_at(self.last_batch_iteration), strict=True
            ):
                group["betas"] = betas


_SCHEDULES: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(optimizer: HasParamGroups, config: SchedulerConfig) -> LRSchedule:
    """The schedule ``config`` names, bound to ``optimizer``."""
    params = dict(config.params)
    for key in ("warmup_num_steps", "lr_range_test_step_size"):  # JSON may say 1e3
        if isinstance(params.get(key), float) and params[key].is_integer():
            params[key] = int(params[key])
    return _SCHEDULES[config.type](optimizer, **params)
