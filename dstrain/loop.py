"""The micro-step, written once: what one micro-batch's backward does, in this order.

    if boundary: stepper.prepare()           # the window's last micro-batch: e.g. an offloading
                                             # stepper starts reading its state now
    zero.before_backward(boundary)           # e.g. arm the reduction hooks of the boundary pass
    (loss x loss scale / accumulation steps).backward()    # or a pipeline stage's output gradients
    zero.after_backward(boundary)            # e.g. finish the reductions of this pass

`Engine.backward` and the pipeline's runner (`dstrain.pipe.runner.PipelineRunner`) both call
`backward`; the step that follows at the boundary (reduce, unscale, clip, step) is `Engine.step`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dstrain.optim.stepper import Stepper
from dstrain.precision import Precision
from dstrain.zero.base import ZeroStrategy

__all__ = ["backward"]


def backward(
    loss: torch.Tensor | Sequence[torch.Tensor],
    *,
    boundary: bool,
    stepper: Stepper,
    zero: ZeroStrategy,
    precision: Precision,
    accumulation_steps: int,
    grads: Sequence[torch.Tensor] | None = None,
) -> None:
    """One micro-batch's backward. ``loss``: a scalar, scaled by the loss scale and divided by
    ``accumulation_steps`` (and ZeRO's prescale); or, with ``grads``, a pipeline stage's outputs and
    the gradients the next stage sent for them (already scaled: they come from its scaled loss).
    ``boundary``: this is the accumulation window's last micro-batch."""
    if boundary:
        stepper.prepare()
    zero.before_backward(boundary)
    if grads is None:
        assert isinstance(loss, torch.Tensor)
        precision.scale_loss(loss, accumulation_steps, zero.loss_prescale).backward()
    else:
        torch.autograd.backward(list(loss), list(grads))
    zero.after_backward(boundary)
