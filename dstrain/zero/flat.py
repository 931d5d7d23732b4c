"""Flattening a list of parameters into one padded buffer that ranks partition evenly."""

from __future__ import annotations

import torch

__all__ = ["FlatLayout", "optimizer_views"]

#: Largest piece of a master partition the optimizer steps as one tensor. torch's CPU Adam(W) makes
#: two temporaries the size of each tensor it steps; pieces bound them (an unsplit 110M-element
#: partition cost ~0.9 GB of temporaries per step, more than DDP's per-parameter stepping).
STEP_CHUNK = 1 << 23


def optimizer_views(master: torch.Tensor, grad: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Leaf views of ``master`` of at most ``chunk`` elements, each with ``.grad`` viewing ``grad``.

    The optimizer steps these views in place, so it updates ``master`` itself; its state is per view.
    """
    views = []
    with torch.no_grad():
        for start in range(0, max(master.numel(), 1), chunk):
            view = master[start : start + chunk]
            view.requires_grad_(True)  # a leaf: a view of a tensor that does not require grad
            view.grad = grad[start : start + chunk]
            views.append(view)
    return views


class FlatLayout:
    """Where each parameter lives in a flat buffer of ``padded`` elements, split into ``world`` shards.

    Parameter i occupies ``[offsets[i], offsets[i] + numels[i])``; rank r owns
    ``[r * shard, (r + 1) * shard)``. Padding at the end is zero and never trained.
    """

    def __init__(self, params: list[torch.nn.Parameter], world: int, rank: int) -> None:
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.total = total
        self.padded = -(-total // world) * world if total else world
        self.shard = self.padded // world
        self.lo = rank * self.shard
        self.hi = self.lo + self.shard

    def flatten(self, params: list[torch.nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
        """A new zero-padded buffer holding the parameters' values, shape (padded,)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=params[0].device if params else "cpu")
        for p, off, n in zip(params, self.offsets, self.numels, strict=True):
            flat[off : off + n].copy_(p.detach().reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into ``flat``, shaped like the parameters."""
        return [
            flat[off : off + n].view(shape)
            for off, n, shape in zip(self.offsets, self.numels, self.shapes, strict=True)
        ]

    def overlap(self, index: int) -> tuple[int, int] | None:
        """The part of parameter ``index`` inside this rank's shard, as flat (start, end), or None."""
        start = max(self.offsets[index], self.lo)
        end = min(self.offsets[index] + self.numels[index], self.hi)
        return (start, end) if start < end else None
