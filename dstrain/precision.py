"""Mixed precision: the compute dtype, loss scaling and overflow handling; master weights are fp32.

`Precision` owns the loss scale and nothing else: no communication. The ZeRO strategy owns the fp32 master
copy; the engine unscales its gradients here, computes the global norm with `dstrain.optim.clip` (an
overflow is a non-finite norm) and reports the outcome back with `Precision.update`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dstrain.config_sections import FP16Config

__all__ = ["LossScaler", "LossScalerStatistics", "Precision"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScalerStatistics:
    """Loss-scaler counters."""

    scale: float
    overflows: int
    """Steps skipped because a gradient was inf or nan."""
    hysteresis_left: int


class LossScaler:
    """DeepSpeed's dynamic loss scaler (or a fixed scale when ``config.loss_scale > 0``).

    On overflow the step is skipped; the scale is halved once ``hysteresis`` overflows have been
    absorbed (and never below ``min_loss_scale``). After ``loss_scale_window`` overflow-free steps the
    scale doubles and the hysteresis budget refills.
    """

    def __init__(self, config: FP16Config) -> None:
        self.dynamic = config.loss_scale == 0
        self.scale = float(2**config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.min_scale = config.min_loss_scale
        self.hysteresis_left = config.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        """Account for one step's outcome."""
        if overflow:
            self.overflows += 1
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.overflows = int(state["overflows"])

    def statistics(self) -> LossScalerStatistics:
        return LossScalerStatistics(
            scale=self.scale, overflows=self.overflows, hysteresis_left=self.hysteresis_left
        )


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Precision:
    """Compute dtype plus (for fp16) a `LossScaler`."""

    def __init__(self, name: str, fp16: FP16Config | None = None) -> None:
        self.name = name
        self.dtype = _DTYPES[name]
        self.scaler = LossScaler(fp16 or FP16Config(enabled=True)) if name == "fp16" else None

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def cast_inputs(self, value: Any) -> Any:
        """Cast floating-point tensors in (nested) inputs to the compute dtype."""
        if isinstance(value, torch.Tensor):
            return value.to(self.dtype) if value.is_floating_point() and value.dtype != self.dtype else value
        if isinstance(value, tuple | list):
            return type(value)(self.cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self.cast_inputs(v) for k, v in value.items()}
        return value

    def scale_loss(self, loss: torch.Tensor, accumulation_steps: int, prescale: float = 1.0) -> torch.Tensor:
        """The tensor to call backward on: loss x scale x prescale / accumulation steps, in fp32."""
        return loss.float() * (self.loss_scale * prescale / accumulation_steps)

    @property
    def checks_overflow(self) -> bool:
        """True when steps depend on an overflow check (fp16): the engine then needs the global norm."""
        return self.scaler is not None

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide fp32 master gradients by the loss scale, in place (nothing to do unless fp16)."""
        if self.scaler is not None and self.scaler.scale != 1.0:
            inv = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv)

    def update(self, overflow: bool) -> None:
        """Account for one step's outcome (the loss scaler's window and hysteresis)."""
        if self.scaler is not None:
            self.scaler.update(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
