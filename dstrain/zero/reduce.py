"""Gradient reduction: one queue of in-flight reductions and a replaceable `Reducer` per param group.

Every ZeRO path reduces through here: stages 0-1 (the whole flat gradient, or its buckets as backward
fills them), stage 2 (gradient buckets) and stage 3 (one flat gradient per unit). What reduces is a
`Reducer`, chosen per param group by a `Route` (reducer + the group of ranks it reduces over), so MoE
routes expert parameters over the expert-data-parallel group and 1-bit Adam can replace the reduction.

Averaging semantics: a reducer SUMS over its comm's ranks. Dividing by the data-parallel size is not the
reducer's job: stages 0-1 pre-scale the loss by 1/dp (`ZeroStrategy.loss_prescale`), stages 2-3 scale by
1/dp when they accumulate the reduced piece into the fp32 master gradient. Always the whole data-parallel
size, also for a route over a smaller group: an expert replicated on ``edp`` ranks has seen
the tokens of all ``dp`` ranks (through the all-to-all), so its mean gradient is its sum over edp / dp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dstrain.dist.comm import Comm

__all__ = ["DefaultReducer", "Handle", "ReductionQueue", "Reducer", "Route", "default_routes"]


@runtime_checkable
class Handle(Protocol):
    """An operation in flight; its result is valid once ``wait()`` returned."""

    def wait(self) -> Any: ...


@runtime_checkable
class Reducer(Protocol):
    """Sums a flat gradient over the ranks of ``comm``."""

    def reduce(
        self, flat: torch.Tensor, comm: Comm, *, out: torch.Tensor | None = None, async_op: bool = True
    ) -> Handle:
        """Start summing ``flat`` (1-D) over ``comm``'s ranks; the result is valid after ``wait()``.

        ``out is None``: all-reduce, ``flat`` itself holds the sum afterwards. ``out`` given
        (``flat.numel() == comm.world_size * out.numel()``): reduce-scatter, ``out`` receives chunk
        ``comm.rank`` of the sum and ``flat`` may be overwritten. ``flat`` must not change until then.
        """
        ...


class DefaultReducer:
    """Plain collectives: an all-reduce, or a reduce-scatter when ``out`` is given (see `Comm`)."""

    def reduce(
        self, flat: torch.Tensor, comm: Comm, *, out: torch.Tensor | None = None, async_op: bool = True
    ) -> Handle:
        if out is None:
            return comm.all_reduce(flat, async_op=async_op)
        return comm.reduce_scatter(out, flat, async_op=async_op, scratch_input=True)

    def __repr__(self) -> str:
        return "DefaultReducer()"


@dataclass(frozen=True, slots=True)
class Route:
    """How one param group's gradients are reduced: by ``reducer``, over ``comm``.

    ``comm`` is also the group ZeRO partitions that param group's master weights and optimizer
    state over (stages 1-3): ranks that reduce a gradient together share its optimizer step.
    """

    reducer: Reducer
    comm: Comm
    expert_comm: Comm | None = None
    """MoE expert groups: the expert-parallel group. Its ranks hold *different* parameters of this group
    (their experts), so squared gradient norms also add up over it (see ``grad_sets``)."""
    full_grad: bool = False
    """The optimizer reads every rank's whole gradient (1-bit Adam, 0/1 Adam: they average momentum, not
    gradients, after a freeze). ZeRO stage 1 then keeps the whole gradient, all-reduced (never
    reduce-scattered), as the fp32 master gradient, unscaled, measured and clipped whole as at stage 0,
    and partitions only the master weights and the optimizer state."""


def default_routes(groups: list[dict[str, Any]], dp: Comm) -> list[Route]:
    """One `Route` per param group: `DefaultReducer` over the data-parallel group."""
    reducer = DefaultReducer()
    return [Route(reducer, dp) for _ in groups]


class ReductionQueue:
    """Reductions in flight, finished in submission order.

    `push` adds a handle and a ``then`` callback (e.g. accumulate the reduced piece into the master
    gradient); once more than ``limit`` are in flight the oldest are finished until ``keep`` remain.
    `drain` finishes all. ``limit`` 0 makes every reduction finish at once (no overlap).
    """

    def __init__(self, limit: int | None = None, keep: int | None = None) -> None:
        self.limit = limit
        self.keep = limit if keep is None else keep
        self._pending: list[tuple[Handle, Callable[[], object] | None]] = []
        self.pushed = 0

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, handle: Handle, then: Callable[[], object] | None = None) -> None:
        self._pending.append((handle, then))
        self.pushed += 1
        if self.limit is not None and len(self._pending) > self.limit:
            self.drain(self.keep or 0)

    def drain(self, keep: int = 0) -> None:
        """Wait for the oldest reductions (and run their callbacks) until ``keep`` remain."""
        while len(self._pending) > keep:
            handle, then = self._pending.pop(0)
            handle.wait()
            if then is not None:
                then()
