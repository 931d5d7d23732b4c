"""Flattening a list of parameters into one padded buffer that ranks partition evenly (`FlatLayout`),
and one param group of ZeRO stages 0-2 over such a buffer (`FlatGroup`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dstrain.zero.base import MasterPiece

if TYPE_CHECKING:
    from dstrain.zero.reduce import Route

__all__ = ["ALIGN", "FlatGroup", "FlatLayout", "aligned_chunk", "optimizer_views"]

#: Largest piece of a master partition the optimizer steps as one tensor. torch's CPU Adam(W) makes
#: two temporaries the size of each tensor it steps; pieces bound them (an unsplit 110M-element
#: partition cost ~0.9 GB of temporaries per step, more than DDP's per-parameter stepping).
STEP_CHUNK = 1 << 23

ALIGN = 64
"""Elements. Every shard of a flat buffer, and every piece the optimizer steps, starts and ends at a
multiple of this. torch's CPU kernels (fused Adam among them) run a vector loop over whole vectors
and a scalar loop over the tail, and the two round differently (FMA, another order); a tail that
depended on where a shard or piece ends would make ZeRO-1 and stage 0 disagree in the last bits, and
by how much on which vector width the CPU has (AVX-512: 16 floats, AVX2: 8). At a multiple of 64
(every vector of every width torch dispatches to, for fp32/bf16/fp16) no element of a partition goes
through the scalar tail unless the same element does at stage 0: the same arithmetic on every CPU."""


def aligned_chunk(chunk: int) -> int:
    """``chunk`` rounded down to a multiple of `ALIGN` (at least `ALIGN`)."""
    return max(ALIGN, chunk - chunk % ALIGN)


def optimizer_views(master: torch.Tensor, grad: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Leaf views of ``master`` of at most ``chunk`` elements (rounded down to a multiple of `ALIGN`),
    each with ``.grad`` viewing ``grad``.

    The optimizer steps these views in place, so it updates ``master`` itself; its state is per view.
    """
    chunk = aligned_chunk(chunk)
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
    ``[r * shard, (r + 1) * shard)``, ``shard`` a multiple of ``align`` elements (stages 0-2 pass
    `ALIGN`). Padding at the end is zero and never trained.
    """

    def __init__(self, params: list[torch.nn.Parameter], world: int, rank: int, *, align: int = 1) -> None:
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.total = total
        unit = world * align  # every shard a whole number of align-element blocks
        self.padded = max(1, -(-total // unit)) * unit
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

    def pieces(self, params: list[torch.nn.Parameter], lo: int, hi: int, base: int) -> list[MasterPiece]:
        """The parameters' elements inside flat ``[lo, hi)``, placed at ``base + (flat offset - lo)``."""
        out = []
        for p, shape, off, n in zip(params, self.shapes, self.offsets, self.numels, strict=True):
            start, end = max(off, lo), min(off + n, hi)
            if start < end:
                out.append(MasterPiece(base + start - lo, p, tuple(shape), start - off, end - start))
        return out

    def overlap(self, index: int) -> tuple[int, int] | None:
        """The part of parameter ``index`` inside this rank's shard, as flat (start, end), or None."""
        start = max(self.offsets[index], self.lo)
        end = min(self.offsets[index] + self.numels[index], self.hi)
        return (start, end) if start < end else None


class FlatGroup:
    """One param group: flat params, its master range and gradient storage, partitioned over its
    route's comm (the data-parallel group, or e.g. the expert-data-parallel group for experts)."""

    def __init__(
        self,
        options: dict[str, Any],
        params: list[torch.nn.Parameter],
        stage: int,
        route: Route,
        dtype: torch.dtype,
        chunk: int,
        reduce_scatter: bool,
    ) -> None:
        self.options = options
        self.params = params
        self.route = route
        comm = route.comm
        # shards of ALIGN-element blocks: stage 1's partition and stage 0's whole buffer step the same
        # elements through the same vector loop on every CPU (see ALIGN)
        self.layout = FlatLayout(params, comm.world_size, comm.rank, align=ALIGN)
        self.flat = self.layout.flatten(params, dtype)  # (padded,)
        for p, view in zip(params, self.layout.views(self.flat), strict=True):
            p.data = view
        lo, hi = (0, self.layout.padded) if stage == 0 else (self.layout.lo, self.layout.hi)
        self.range = (lo, hi)
        self.alias = dtype == torch.float32
        # fp32: the optimizer updates the flat buffer in place; otherwise an fp32 copy of our range
        self.master = self.flat[lo:hi] if self.alias else self.flat[lo:hi].float()
        self.flat_grad: torch.Tensor | None = None  # (padded,) stages 0-1: autograd accumulates here
        self.part_grad: torch.Tensor | None = None  # (shard,) stage 1 reduce-scatter output
        if stage < 2:
            self.flat_grad = torch.zeros_like(self.flat)
            self.grad_views = self.layout.views(self.flat_grad)
            self.attach_grads()
        if reduce_scatter:
            self.part_grad = torch.zeros(hi - lo, dtype=dtype, device=self.flat.device)
        # the master gradient covers the master range, or the whole flat (route.full_grad, 1-bit Adam)
        glo, ghi = (0, self.layout.padded) if route.full_grad and stage < 2 else (lo, hi)
        self.grad_range = (glo, ghi)
        if self.alias and stage < 2:
            # the reduced gradient is read where it lies: no fp32 copy of it
            assert self.flat_grad is not None
            self.master_grad = self.part_grad if self.part_grad is not None else self.flat_grad[glo:ghi]
        else:
            # fp16/bf16 (cast here), and stage 2, which accumulates every micro-step's reduced gradients
            self.master_grad = torch.zeros(ghi - glo, dtype=torch.float32, device=self.flat.device)
        # what the optimizer steps: pieces of the master range, with views of master_grad as .grad
        self.views = optimizer_views(self.master, self.master_grad[lo - glo : hi - glo], chunk)
        self.replicated = False
        """Set by an optimizer that keeps a whole replica of the flat on every rank and writes the flat
        itself (0/1 Adam's local steps after its freeze, dstrain/onebit): nothing is gathered after a step."""

    def attach_grads(self) -> None:
        """Point every ``param.grad`` at its view of ``flat_grad`` (autograd then adds in place)."""
        for p, g in zip(self.params, self.grad_views, strict=True):
            if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                if p.grad is not None:
                    g.copy_(p.grad)
                p.grad = g
