"""Global gradient norm and clipping over any set of (gradients, group) pairs.

A model's gradients may live in several sets that are spread over different groups of ranks: a ZeRO
partition (each dp rank holds a different slice: squared norms sum over the dp group), expert
parameters (slices over the expert-data-parallel group), pipeline stages (each stage its own layers:
sums over the pipeline group). Each `GradSet` names the group its squared norm is summed over; the
global norm is the square root of the sum over every set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dstrain.dist.comm import Comm

__all__ = ["GradSet", "clip_grads_", "global_grad_norm"]

#: DeepSpeed's and torch's ``clip_grad_norm_`` guard against division by a zero norm
CLIP_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class GradSet:
    """Gradients whose squared norm is summed over ``comm``'s ranks (each holds a disjoint slice).

    ``comm=None`` (or a group of one) means the set is complete on this rank (e.g. replicated, already
    all-reduced gradients at ZeRO stage 0): it is counted once, locally.
    """

    grads: Sequence[torch.Tensor]
    comm: Comm | None = None


def _local_sq(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    # squared norm in float64: a finite fp32 gradient must not overflow the sum
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
    return sq


def global_grad_norm(sets: Iterable[GradSet], *, agree: Comm | None = None) -> float:
    """The L2 norm of every gradient of every set, the same on every rank that calls it.

    Sets on the same `Comm` share one all-reduce. ``agree`` (e.g. the world) makes ranks agree on the
    result where the sets alone would not communicate: a MAX over it, with any non-finite norm turned
    into +inf first (a MAX can drop a NaN; an overflow on one rank must stop every rank). Every rank
    must pass sets on the same groups in the same order (the all-reduces are collectives).
    """
    sets = list(sets)
    by_comm: dict[int, tuple[Comm | None, torch.Tensor]] = {}
    for s in sets:
        key = id(s.comm) if s.comm is not None and s.comm.world_size > 1 else 0
        sq = _local_sq(s.grads)
        if key in by_comm:
            comm, acc = by_comm[key]
            by_comm[key] = (comm, acc + sq.to(acc.device))
        else:
            by_comm[key] = (s.comm if key else None, sq)
    total = 0.0
    for comm, sq in by_comm.values():
        if comm is not None:
            if comm.backend == "nccl" and sq.device.type != "cuda":  # host gradients (offload): NCCL
                sq = sq.to(torch.device("cuda", torch.cuda.current_device()))  # reduces CUDA tensors only
            comm.all_reduce(sq, op=dist.ReduceOp.SUM)
        total += float(sq)
    # a sum over ``agree`` itself already gives every rank the same total
    agreed = bool(sets) and all(s.comm is agree for s in sets)
    if agree is not None and agree.world_size > 1 and not agreed:
        # NCCL reduces CUDA tensors only (even on a rank whose sets hold no gradient)
        device = torch.device("cuda", torch.cuda.current_device()) if agree.backend == "nccl" else None
        t = torch.tensor(total if math.isfinite(total) else math.inf, dtype=torch.float64, device=device)
        agree.all_reduce(t, op=dist.ReduceOp.MAX)
        total = float(t)
    return math.sqrt(total) if math.isfinite(total) else total


def clip_grads_(grads: Iterable[torch.Tensor], max_norm: float, norm: float) -> float:
    """Scale ``grads`` in place so their global ``norm`` becomes ``max_norm`` when it exceeds it.

    Returns the factor applied (1.0 when the norm was within bounds or ``max_norm`` is 0).
    """
    if max_norm <= 0 or not norm > max_norm:
        return 1.0
    coef = max_norm / (norm + CLIP_EPS)
    for g in grads:
        g.mul_(coef)
    return coef
