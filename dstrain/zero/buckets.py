"""Gradient buckets: reduce gradients during backward, as soon as a bucket's gradients are complete.

Both kinds push their reductions through a `ReductionQueue` and reduce with their param group's
`Route` (see `dstrain.zero.reduce`).
"""

from __future__ import annotations

import torch

from dstrain.config_sections import ZeroConfig
from dstrain.zero.flat import FlatGroup, FlatLayout
from dstrain.zero.reduce import ReductionQueue, Route

__all__ = ["BoundaryBuckets", "Stage2Buckets"]


class BoundaryBuckets:
    """Stages 0-1 with ``overlap_comm``: contiguous ranges of the flat gradient, in reverse parameter
    order (the order backward produces them), each all-reduced asynchronously once every parameter in
    it has accumulated its gradient of the last micro-step."""

    def __init__(self, layout: FlatLayout, flat_grad: torch.Tensor, capacity: int, route: Route) -> None:
        self.flat_grad = flat_grad
        self.route = route
        self.armed = False
        self.bucket_of: list[int] = [0] * len(layout.numels)
        self.ranges: list[tuple[int, int]] = []
        self.sizes: list[int] = []
        end, size, members = layout.padded, 0, 0
        for i in reversed(range(len(layout.numels))):
            if members and size + layout.numels[i] > capacity:
                start = layout.offsets[i] + layout.numels[i]
                self.ranges.append((start, end))
                self.sizes.append(members)
                end, size, members = start, 0, 0
            self.bucket_of[i] = len(self.ranges)
            size += layout.numels[i]
            members += 1
        self.ranges.append((0, end))
        self.sizes.append(members)
        self.ready = [0] * len(self.ranges)
        self.launched = [False] * len(self.ranges)
        self.queue = ReductionQueue()  # no limit: every bucket stays in flight until `finish`

    def hook(self, index: int):
        def on_grad(p: torch.Tensor) -> None:
            if not self.armed:
                return
            b = self.bucket_of[index]
            self.ready[b] += 1
            if self.ready[b] == self.sizes[b]:
                self._launch(b)

        return on_grad

    def _launch(self, b: int) -> None:
        start, end = self.ranges[b]
        self.launched[b] = True
        self.queue.push(self.route.reducer.reduce(self.flat_grad[start:end], self.route.comm))

    def finish(self) -> None:
        """Launch what backward did not complete (unused parameters) and wait for all: the gradients
        are then summed over ranks (the engine pre-scaled the loss by 1/world)."""
        for b, launched in enumerate(self.launched):
            if not launched:
                self._launch(b)
        self.queue.drain()
        self.ready = [0] * len(self.ranges)
        self.launched = [False] * len(self.ranges)
        self.armed = False


class Stage2Buckets:
    """Stage 2: copy each gradient into a bucket as autograd produces it, reduce full buckets, keep only
    this rank's range (in fp32 ``master_grad``, scaled by 1/``dp_size``), and free the parameter's
    gradient at once. A bucket holds gradients of one `Route`: a gradient of another route flushes it."""

    def __init__(self, groups: list[FlatGroup], config: ZeroConfig, dp_size: int, dtype: torch.dtype) -> None:
        self.groups = groups
        self.dp_size = dp_size
        self.capacity = config.reduce_bucket_size
        self.overlap = config.overlap_comm
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self.route: Route | None = None
        self.used = 0
        self.entries: list[tuple[int, int, int]] = []  # (group, param index, bucket offset)
        # overlap: up to two buckets in flight, then finish down to one; else each finishes at once
        self.queue = ReductionQueue(limit=1, keep=1) if self.overlap else ReductionQueue(limit=0)

    def hook(self, gi: int, pi: int):
        def on_grad(p: torch.Tensor) -> None:
            assert p.grad is not None
            self.add(gi, pi, p.grad)
            p.grad = None

        return on_grad

    def add(self, gi: int, pi: int, grad: torch.Tensor) -> None:
        n = grad.numel()
        route = self.groups[gi].route
        full = self.used + n > (self.buffer.numel() if self.buffer is not None else 0)
        if self.used and (full or route != self.route):
            self.flush()
        if self.buffer is None:
            self.buffer = torch.empty(max(self.capacity, n), dtype=self.dtype, device=grad.device)
            self.route = route
        self.buffer[self.used : self.used + n].copy_(grad.reshape(-1))
        self.entries.append((gi, pi, self.used))
        self.used += n

    def flush(self) -> None:
        if not self.used or self.buffer is None or self.route is None:
            return
        data = self.buffer[: self.used]
        handle = self.route.reducer.reduce(data, self.route.comm, async_op=self.overlap)
        entries = self.entries
        self.buffer, self.route, self.used, self.entries = None, None, 0, []
        self.queue.push(handle, lambda: self._accumulate(data, entries))

    def _accumulate(self, data: torch.Tensor, entries: list[tuple[int, int, int]]) -> None:
        """Add this rank's part of a reduced bucket into the master gradients."""
        for gi, pi, boff in entries:
            group = self.groups[gi]
            span = group.layout.overlap(pi)
            if span is None:
                continue
            start, end = span
            off = group.layout.offsets[pi]
            lo = group.range[0]
            piece = data[boff + start - off : boff + end - off]
            group.master_grad[start - lo : end - lo].add_(piece, alpha=1.0 / self.dp_size)

    def drain(self) -> None:
        """End of a backward: reduce the last bucket and wait for every reduction."""
        self.flush()
        self.queue.drain()
