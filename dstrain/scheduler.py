"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR.

The learning rate of optimizer step k (counting from 0) is ``lr(k)``; `step` is called by the engine
after each optimizer step that was not skipped.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from dstrain.config_sections import SchedulerConfig

__all__ = ["LRSchedule", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]


class HasParamGroups(Protocol):
    """What a schedule edits: a torch optimizer, or a dstrain `Stepper`."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class LRSchedule:
    """Base: sets every param group's ``lr`` to `lr_at` (or `lr_at` x the group's base LR for ratios)."""

    def __init__(self, optimizer: HasParamGroups, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self.step()

    def lrs_at(self, step: int) -> list[float]:
        """Learning rate of each param group at optimizer step ``step``."""
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``) and set the LRs."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        for group, lr in zip(
            self.optimizer.param_groups, self.lrs_at(self.last_batch_iteration), strict=True
        ):
            group["lr"] = lr

    def get_lr(self) -> list[float]:
        """The LRs in effect now."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_lrs = list(state["base_lrs"])
        self.step(int(state["last_batch_iteration"]))


def _warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


class WarmupLR(LRSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (log or linear), then flat."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lr = warmup_min_lr
        self.max_lr = warmup_max_lr
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, step: int) -> float:
        return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def lrs_at(self, step: int) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self.gamma(step)
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: HasParamGroups, total_num_steps: int, **kwargs: Any) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, **kwargs)

    def gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return super().gamma(step)
        return max(
            0.0, (self.total_num_steps - step) / max(1.0, self.total_num_steps - self.warmup_num_steps)
        )


class WarmupCosineLR(LRSchedule):
    """Ratio of each group's base LR: warm up from ``warmup_min_ratio`` to 1, then cosine to ``cos_min_ratio``."""

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
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            gamma = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = (step - self.warmup_num_steps) / max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(1.0, progress))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, step: int) -> list[float]:
        return [base * self.ratio(step) for base in self.base_lrs]


_SCHEDULES: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(optimizer: HasParamGroups, config: SchedulerConfig) -> LRSchedule:
    """The schedule ``config`` names, bound to ``optimizer``."""
    return _SCHEDULES[config.type](optimizer, **config.params)
