"""Workers of the optim tests (clipping): run inside spawned gloo ranks (once _seams_helpers.py)."""

from __future__ import annotations

from typing import Any

import torch


def clip_run() -> dict[str, Any]:
    """Two sets on 2 ranks: a slice partitioned over the world and a replicated tensor."""
    import math

    from dstrain.dist.comm import Comm
    from dstrain.optim.clip import GradSet, clip_grads_, global_grad_norm

    world = Comm()
    r = world.rank
    part = [torch.full((3,), float(r + 1))]  # rank 0: 1,1,1  rank 1: 2,2,2
    repl = [torch.tensor([4.0])]  # the same on both ranks: counted once
    norm = global_grad_norm([GradSet(part, world), GradSet(repl, None)])
    expected = math.sqrt(3 * 1 + 3 * 4 + 16)
    coef = clip_grads_(part + repl, 1.0, norm)
    after = global_grad_norm([GradSet(part, world), GradSet(repl, None)])
    # an overflow on one rank reaches every rank through ``agree`` (a MAX would drop a NaN)
    bad = [torch.tensor([float("nan") if r == 1 else 1.0])]
    local_only = global_grad_norm([GradSet(bad, None)], agree=world)
    return {"norm": norm, "expected": expected, "coef": coef, "after": after, "overflow": local_only}
