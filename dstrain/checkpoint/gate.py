"""Letting the optimizer step run while an async save still streams the state it changes.

An async save of an offloaded run streams the optimizer state while the next forward and backward
run. Instead of waiting for the whole save before the next optimizer step, the engine gives the save
a *touch order* (what the step will change, sub-group by sub-group, then the model's parameters) and
lends the save to the stepper, which waits before each sub-group only until the save has read that
sub-group's bytes (`PendingSave.wait_captured`). The save reads them in that order, so the step
usually finds each one already read.

What the gate still covers: state in memory (fp32 masters, CPU-offloaded m and v, the parameters)
and file regions a save reads in place (a Stage-3 master in the parameter file). Swapped Adam m and
v are not in it: the save pins their slot versions and the step writes around them
(``dstrain.offload.swap.slots``), so the step never waits for the save to read the swap file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dstrain.optim.stepper import GatedStepper

if TYPE_CHECKING:
    from dsio.checkpoint import TouchOrder
    from dstrain.checkpoint.store import PendingSave

__all__ = ["lend_gate", "touch_order"]


def touch_order(stepper: Any, module: torch.nn.Module) -> TouchOrder | None:
    """What the next optimizer step changes, in order: the stepper's touch sets (one per sub-group,
    from its ``checkpoint_touch_order()``), then the model's parameters (ZeRO rewrites them after
    the step). None for a stepper that cannot step piece by piece (the step then waits for the
    whole staging)."""
    if not isinstance(stepper, GatedStepper):
        return None
    from dsio.checkpoint import MemorySpan

    sets = [list(s) for s in stepper.checkpoint_touch_order()]
    sets.append(
        [
            MemorySpan.of(p.detach())
            for p in module.parameters()
            if p.numel() and p.untyped_storage().nbytes() > 0  # stage 3 frees released ones
        ]
    )
    return sets


def lend_gate(stepper: Any, pending: PendingSave) -> bool:
    """Let the stepper's next step wait for the save touch set by touch set; False where it cannot
    (then the caller waits for the whole staging)."""
    if not isinstance(stepper, GatedStepper) or not pending.gated:
        return False
    stepper.gate_next_step(pending.wait_captured)
    return True
