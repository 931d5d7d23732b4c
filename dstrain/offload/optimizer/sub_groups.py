"""Sub-groups of `OffloadAdam`: how master views are cut (`plan_sub_groups`) and one piece (`SubGroup`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from dstrain.errors import ConfigError
from dstrain.offload.swap.swapper import align_up

__all__ = ["CUT", "SubGroup", "plan_sub_groups"]

log = logging.getLogger(__name__)

CUT = 1024
"""Sub-group boundaries are multiples of this many elements from their view's start."""


class SubGroup:
    """A range of one master view stepped (and swapped) as a unit."""

    __slots__ = ("index", "group", "param", "start", "numel", "m", "v", "offset", "master_start")

    def __init__(self, index: int, group: int, param: torch.Tensor, start: int, numel: int) -> None:
        self.index = index
        self.group = group
        self.param = param  # the master view (a leaf whose .grad views the fp32 gradient)
        self.start = start
        self.numel = numel
        self.m: torch.Tensor | None = None  # device="cpu": resident state
        self.v: torch.Tensor | None = None
        self.offset = 0  # device="nvme": where its slot (m, then v) starts in the swap file
        self.master_start = param.storage_offset() + start  # element of its group's master

    def grad_slice(self) -> torch.Tensor:
        grad = self.param.grad
        if grad is None:
            raise RuntimeError("an offloaded master tensor has no gradient (the ZeRO strategy sets it)")
        return grad.view(-1)[self.start : self.start + self.numel]

    def slices(self) -> tuple[torch.Tensor, torch.Tensor]:
        grad = self.param.grad
        if grad is None:
            raise RuntimeError("an offloaded master tensor has no gradient (the ZeRO strategy sets it)")
        end = self.start + self.numel
        return self.param.detach().view(-1)[self.start : end], grad.view(-1)[self.start : end]


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
