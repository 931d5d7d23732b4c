"""`Stepper`: how the engine updates the master weights, without knowing what does it.

The engine never calls ``optimizer.step()`` or ``optimizer.state_dict()`` itself; it calls a
`Stepper`. `TorchStepper` wraps a torch optimizer (the default). An offloading stepper (optimizer
state on CPU/NVMe: read ahead, step, write behind per sub-group), CPU Adam or 1-bit Adam implement the
same protocol and plug in through `dstrain.initialize`'s ``build_stepper`` without touching the engine.

Order of calls per optimizer step (at a gradient-accumulation boundary)::

    prepare()        start of the boundary micro-step's backward (an offloading stepper starts reading
                     the state it will need; gradients are not final yet)
    ... backward, reduction, unscale, overflow check, clipping ...
    step()           only when the step is not skipped (fp16 overflow); gradients are final
    (the LR schedule edits ``param_groups[i]["lr"]`` after a step)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dstrain.errors import DstrainError

__all__ = ["GatedStepper", "NoOptimizer", "Stepper", "StepperStatistics", "TorchStepper", "WrapsOptimizer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepperStatistics:
    """Counters of a stepper (an offloading stepper adds its own snapshot type)."""

    steps: int
    """Optimizer steps taken (skipped steps not counted)."""
    prepares: int
    """`Stepper.prepare` calls (one per accumulation boundary, skipped steps included)."""


@runtime_checkable
class Stepper(Protocol):
    """What the engine steps through. ``param_groups`` are dicts whose ``"lr"`` the LR schedule sets."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The groups the LR schedule edits (``"lr"`` and the user's other options)."""
        ...

    def prepare(self) -> None:
        """Called at the start of the accumulation-boundary backward, before gradients are final."""
        ...

    def step(self) -> None:
        """Update the master weights from their (final, unscaled, clipped) gradients."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (what a checkpoint stores under the ``"stepper"`` key)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...

    def statistics(self) -> Any:
        """A frozen snapshot of counters."""
        ...

    def close(self) -> None:
        """Release files, memory and threads; the master weights keep their values."""
        ...


@runtime_checkable
class GatedStepper(Protocol):
    """A stepper that steps piece by piece and lets an async checkpoint save gate it (the offloaded
    Adam): the save reads in `checkpoint_touch_order`'s order and the next step waits per piece
    (``dstrain.checkpoint.gate``); any other stepper's step waits for the whole staging."""

    def checkpoint_touch_order(self) -> list[list[Any]]:
        """What the next step changes, piece by piece in its order (``dsio.checkpoint`` spans)."""
        ...

    def gate_next_step(self, wait: Callable[[int], float]) -> None:
        """Make the next step call ``wait(i)`` before it changes the bytes of touch set ``i``."""
        ...


@runtime_checkable
class WrapsOptimizer(Protocol):
    """A stepper over a torch optimizer (`TorchStepper`; `NoOptimizer`'s is None): what
    `dstrain.initialize` returns as the optimizer (else the stepper itself)."""

    optimizer: Any


class TorchStepper:
    """A torch optimizer (over the ZeRO strategy's master tensors) as a `Stepper`."""

    reshapable_state = True
    """Its ``state_dict`` is torch's: per-element state shaped like each master view, so a checkpoint
    of it loads into any world size or stage (``dstrain.checkpoint.layout.ReshapableState``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._steps = 0
        self._prepares = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def prepare(self) -> None:
        self._prepares += 1  # the state is in memory already: nothing to read ahead

    def step(self) -> None:
        self.optimizer.step()
        self._steps += 1

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def statistics(self) -> StepperStatistics:
        return StepperStatistics(steps=self._steps, prepares=self._prepares)

    def close(self) -> None:
        return None


class NoOptimizer:
    """The stepper of an engine built without an optimizer (``initialize`` with neither an ``"optimizer"``
    section nor ``optimizer=``, as DeepSpeed allows for evaluation): forward and backward run, `step`
    at an accumulation boundary raises `DstrainError` naming what is missing."""

    optimizer = None
    """What `initialize` returns as the optimizer: None, as DeepSpeed returns."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return []

    def prepare(self) -> None:
        return None

    def step(self) -> None:
        raise DstrainError(
            'engine.step(): this engine has no optimizer (set "optimizer" in the config or pass optimizer= '
            "to initialize)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def statistics(self) -> StepperStatistics:
        return StepperStatistics(steps=0, prepares=0)

    def close(self) -> None:
        return None
