"""Sub-groups of `OffloadAdam`: how master views are cut (`plan_sub_groups`) and one piece (`SubGroup`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from dstrain.errors import ConfigError
from dstrain.offload.swap.swapper import align_up
from dstrain.zero.units import stored_view, whole_shape

__all__ = ["CUT", "SubGroup", "master_numel", "plan_sub_groups"]

log = logging.getLogger(__name__)

CUT = 1024
"""Sub-group boundaries are multiples of this many elements from their view's start."""


def master_numel(param: torch.Tensor) -> int:
    """Elements of a master view, also when its group emptied it (the values are in a store:
    `dstrain.zero.units.stored_view`)."""
    return math.prod(whole_shape(param))


class SubGroup:
    """A range of one master view stepped (and swapped) as a unit.

    ``param`` is the master view the optimizer's ``param_groups`` hold (the key of its state). A
    stage-3 view whose values or gradients live in a store is empty (`dstrain.zero.units.stored_view`):
    where it was and its gradient range are taken from its `StoredView` here, once."""

    __slots__ = (
        "index",
        "group",
        "param",
        "start",
        "numel",
        "m",
        "v",
        "offset",
        "master_start",
        "shape",
        "_grad",
    )

    def __init__(self, index: int, group: int, param: torch.Tensor, start: int, numel: int) -> None:
        self.index = index
        self.group = group
        self.param = param  # the master view (a leaf whose .grad views the fp32 gradient)
        self.start = start
        self.numel = numel
        self.m: torch.Tensor | None = None  # device="cpu": resident state
        self.v: torch.Tensor | None = None
        self.offset = 0  # device="nvme": where its slot (m, then v) starts in the swap file
        self.shape = whole_shape(param)  # the view's shape (the state's)
        stored = stored_view(param)
        at = param.storage_offset() if stored is None else stored.offset
        self.master_start = at + start  # element of its group's master
        # the view's gradient range when its group emptied it; else its .grad, read at each step
        self._grad = None if stored is None else stored.grad

    def grad_slice(self) -> torch.Tensor:
        grad = self.param.grad if self._grad is None else self._grad
        if grad is None:
            raise RuntimeError("an offloaded master tensor has no gradient (the ZeRO strategy sets it)")
        return grad.view(-1)[self.start : self.start + self.numel]

    def slices(self) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.start + self.numel
        return self.param.detach().view(-1)[self.start : end], self.grad_slice()


def plan_sub_groups(
    numels: Iterable[int], sub_group_size: int, budget: int, buffer_count: int, per_element_bytes: int
) -> tuple[int, int]:
    """(sub-group elements, buffer count) for views of ``numels`` elements under ``budget`` bytes.

    The sub-group is ``sub_group_size`` rounded to a multiple of 1024, capped at the largest view;
    buffers are as many as the budget holds, at most one per sub-group. When the budget cannot hold
    ``min(buffer_count, sub-groups)`` buffers the sub-group shrinks until it does (logged).
    """
    numels = [n for n in numels if n > 0]
    largest = max(numels, default=CUT)
    size = max(CUT, min(align_up(sub_group_size, CUT), align_up(largest, CUT)))

    def buf(s: int) -> int:
        return align_up(s * per_element_bytes)

    def count(s: int) -> int:
        return sum(-(-n // s) for n in numels)

    want = max(1, min(buffer_count, count(size)))
    original = size
    while want * buf(size) > budget:
        fit = (budget // want // per_element_bytes) // CUT * CUT  # the largest size that fits
        if fit < CUT:
            raise ConfigError(
                "zero_optimization.offload_pinned_bytes",
                f"{budget} bytes cannot hold {want} swap buffer(s) of the smallest sub-group ({buf(CUT)} bytes)",
            )
        size = min(size - CUT, fit)
        want = max(1, min(buffer_count, count(size)))
    if size != original:
        log.info(
            "offload: sub-group %d -> %d elements so that %d buffers fit offload_pinned_bytes=%d",
            original,
            size,
            want,
            budget,
        )
    buffers = max(1, min(budget // buf(size), count(size)))
    return size, buffers
