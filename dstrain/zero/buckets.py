"""Gradient buckets: reduce gradients during backward, as soon as a bucket's gradients are complete."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dstrain.comm import Comm
from dstrain.config_sections import ZeroConfig
from dstrain.zero.flat import FlatLayout

if TYPE_CHECKING:
    from dstrain.zero.dp import _Group

__all__ = ["BoundaryBuckets", "Stage2Buckets"]


class BoundaryBuckets:
    """Stages 0-1 with ``overlap_comm``: contiguous ranges of the flat gradient, in reverse parameter
    order (the order backward produces them), each all-reduced asynchronously once every parameter in
    it has accumulated its gradient of the last micro-step."""

    def __init__(self, layout: FlatLayout, flat_grad: torch.Tensor, capacity: int, comm: Comm) -> None:
        self.flat_grad = flat_grad
        self.comm = comm
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
        self.handles: list[Any] = [None] * len(self.ranges)

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
        self.handles[b] = self.comm.all_reduce(self.flat_grad[start:end], async_op=True)

    def finish(self) -> None:
        """Launch what backward did not complete (unused parameters) and wait for all: the gradients
        are then summed over ranks (the engine pre-scaled the loss by 1/world)."""
        for b, handle in enumerate(self.handles):
            if handle is None:
                self._launch(b)
        for handle in self.handles:
            handle.wait()
        self.ready = [0] * len(self.ranges)
        self.handles = [None] * len(self.ranges)
        self.armed = False


class Stage2Buckets:
    """Stage 2: copy each gradient into a bucket as autograd produces it, reduce full buckets, keep only
    this rank's range (in fp32 ``master_grad``), and free the parameter's gradient at once."""

    def __init__(self, groups: list[_Group], config: ZeroConfig, comm: Comm, dtype: torch.dtype) -> None:
        self.groups = groups
        self.comm = comm
        self.capacity = config.reduce_bucket_size
        self.overlap = config.overlap_comm
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self.used = 0
        self.entries: list[tuple[int, int, int]] = []  # (group, param index, bucket offset)
        self.pending: list[tuple[Any, torch.Tensor, list[tuple[int, int, int]]]] = []

    def hook(self, gi: int, pi: int):
        def on_grad(p: torch.Tensor) -> None:
            assert p.grad is not None
            self.add(gi, pi, p.grad)
            p.grad = None

        return on_grad

    def add(self, gi: int, pi: int, grad: torch.Tensor) -> None:
        n = grad.numel()
        if self.used and self.used + n > (self.buffer.numel() if self.buffer is not None else 0):
            self.flush()
        if self.buffer is None:
            self.buffer = torch.empty(max(self.capacity, n), dtype=self.dtype, device=grad.device)
        self.buffer[self.used : self.used + n].copy_(grad.reshape(-1))
        self.entries.append((gi, pi, self.used))
        self.used += n

    def flush(self) -> None:
        if not self.used or self.buffer is None:
            return
        data = self.buffer[: self.used]
        handle = self.comm.all_reduce(data, async_op=self.overlap)
        self.pending.append((handle, data, self.entries))
        self.buffer, self.used, self.entries = None, 0, []
        if not self.overlap or len(self.pending) > 1:
            self._finish(keep=1 if self.overlap else 0)

    def _finish(self, keep: int = 0) -> None:
        world = self.comm.world_size
        while len(self.pending) > keep:
            handle, data, entries = self.pending.pop(0)
            handle.wait()
            for gi, pi, boff in entries:
                group = self.groups[gi]
                span = group.layout.overlap(pi)
                if span is None:
                    continue
                start, end = span
                off = group.layout.offsets[pi]
                lo = group.range[0]
                piece = data[boff + start - off : boff + end - off]
                group.master_grad[start - lo : end - lo].add_(piece, alpha=1.0 / world)

    def drain(self) -> None:
        """End of a backward: reduce the last bucket and wait for every reduction."""
        self.flush()
        self._finish(keep=0)
