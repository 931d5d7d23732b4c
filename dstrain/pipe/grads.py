"""A pipeline stage's gradients seen whole: tied weights summed over the stages, norms over the pipeline.

Two jobs, both at the accumulation boundary, after the schedule and before the engine's step:

- `StageGrads.reduce_tied` sums each tied weight's gradient over the stages holding it. ZeRO 0-1 keep the
  unreduced gradient in ``param.grad`` until the boundary, so it is all-reduced there over the tied group of
  this data-parallel index (then ZeRO reduces it over dp like any gradient). ZeRO 2 has already reduced every
  micro-batch's gradient into this rank's slice of the fp32 master gradient during backward (and freed
  ``param.grad``); each rank then writes its slice of the tied weight into a zero buffer of the weight's size
  and all-reduces it over every rank holding the key (all stages x all dp ranks): the dp slices of one stage
  are disjoint and cover the weight, so the sum is the weight's gradient summed over stages, and each rank
  copies its slice back.
- `StageGrads.grad_sets` are the `dstrain.optim.clip.GradSet`s of the global norm (clipping, fp16's overflow
  check) of the whole pipelined model: the stage's master gradients summed over the pipeline group (ZeRO 0:
  replicated over dp) or over the pipeline x data-parallel ranks (ZeRO 1-2: disjoint dp slices), with the
  tied weights left out on every stage but the lowest that holds them (counted once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dstrain.dist.comm import Comm
from dstrain.dist.topology import Topology
from dstrain.errors import NotImplementedConfigError
from dstrain.optim.clip import GradSet
from dstrain.pipe.module import PipelineModule
from dstrain.zero.dp import DataParallelZero

__all__ = ["StageGrads", "TiedGroup"]


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """The process groups of one tied key, from this rank's view."""

    same_dp: Any
    """The ranks of this rank's data-parallel index holding the key (one per stage that holds it)."""
    all_dp: Any
    """Every rank holding the key (those stages x every data-parallel index); ``same_dp`` when dp is 1."""


class StageGrads:
    """Tied-gradient sums and norm sets of one stage, over the engine's `DataParallelZero` (stages 0-2)."""

    def __init__(
        self, *, module: PipelineModule, zero: Any, topology: Topology, tied: dict[str, TiedGroup]
    ) -> None:
        self.module = module
        self.zero = zero
        self.tied = tied
        self.stage = module.stage_id
        if not isinstance(zero, DataParallelZero):  # stages 0-2: flat groups; stage 3 is refused
            raise NotImplementedConfigError(
                "zero_optimization.stage", f"{zero.stage} is not implemented with pipeline parallelism"
            )
        groups = zero.groups
        self._groups = groups
        layout = topology.layout
        # ZeRO 0: every dp rank holds the whole reduced gradient, so squares add over the stages only;
        # ZeRO 1-2 over dp > 1: each holds a disjoint slice, so over the stages x the dp ranks
        partitioned = zero.stage > 0 and layout.dp > 1
        self._norm_comm: Comm = topology.world if partitioned else topology.pp
        self._partitioned = partitioned
        self._supported = all(g.route.comm is zero.comm and g.route.expert_comm is None for g in groups)
        if partitioned and layout.world != layout.pp * layout.dp:  # pragma: no cover - the layout's invariant
            raise NotImplementedConfigError("gradient_clipping", "needs world == pipeline x data-parallel")
        # (group index, param index) of each tied weight of this stage, by key
        where = {id(p): (gi, pi) for gi, g in enumerate(groups) for pi, p in enumerate(g.params)}
        self._tied_at: dict[str, list[tuple[int, int]]] = {}
        for key in tied:
            self._tied_at[key] = [where[id(p)] for p in module.tied_weights(key) if id(p) in where]
        # the tied weights this stage leaves out of the norm: another, lower stage counts them
        owners = {k: min(s) for k, s in module.tied_stages().items()}
        self._skip = [at for key, ats in self._tied_at.items() if owners[key] != self.stage for at in ats]

    def check_clipping(self) -> None:
        """Refuse clipping where the norm would be wrong: expert (MoE) param groups in a pipeline."""
        if not self._supported:
            raise NotImplementedConfigError(
                "gradient_clipping",
                "with pipeline parallelism and expert (MoE) parameters is not implemented",
            )

    # -- tied gradients ------------------------------------------------------------------------------

    def reduce_tied(self) -> None:
        """Sum every tied weight's gradient over the stages holding it (collective over the tied groups)."""
        if self.zero.stage < 2:
            for key, group in self.tied.items():
                for p in self.module.tied_weights(key):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad, group=group.same_dp)
            return
        for key, group in self.tied.items():
            for gi, pi in self._tied_at[key]:
                g = self._groups[gi]
                off, n = g.layout.offsets[pi], g.layout.numels[pi]
                full = torch.zeros(n, dtype=g.master_grad.dtype, device=g.master_grad.device)  # (numel,)
                span = self._span(gi, pi)
                lo = g.range[0]
                if span is not None:
                    a, b = span
                    full[a - off : b - off].copy_(g.master_grad[a - lo : b - lo])
                dist.all_reduce(full, group=group.all_dp)
                if span is not None:
                    a, b = span
                    g.master_grad[a - lo : b - lo].copy_(full[a - off : b - off])

    def _span(self, gi: int, pi: int) -> tuple[int, int] | None:
        """Flat ``[start, end)`` of parameter ``pi`` inside group ``gi``'s master range, or None."""
        g = self._groups[gi]
        lo, hi = g.range
        off, n = g.layout.offsets[pi], g.layout.numels[pi]
        a, b = max(off, lo), min(off + n, hi)
        return (a, b) if a < b else None

    # -- the global norm -----------------------------------------------------------------------------

    def grad_sets(self) -> list[GradSet]:
        """The sets of `dstrain.optim.clip.global_grad_norm` for the whole pipelined model (every rank of
        the pipeline must call it: the sum over stages is a collective)."""
        pieces: list[torch.Tensor] = []
        for gi, g in enumerate(self._groups):
            lo, hi = g.range
            skip = sorted(s for at in self._skip if at[0] == gi and (s := self._span(*at)) is not None)
            pos = lo
            for a, b in skip:
                if a > pos:
                    pieces.append(g.master_grad[pos - lo : a - lo])
                pos = max(pos, b)
            if hi > pos:
                pieces.append(g.master_grad[pos - lo : hi - lo])
        return [GradSet(pieces, self._norm_comm)]
