"""What the ranks of a checkpoint agree on before any of them acts: which step a load takes (decided
once, on rank 0, and broadcast), and that every rank sees it.

Object collectives over a `Comm` (gloo's ``all_gather_object`` / ``broadcast_object_list``); with one
rank they are the identity and need no process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from dstrain.dist.comm import Comm
from dstrain.errors import CheckpointNotFoundError, CheckpointRankError

__all__ = ["agree_step", "broadcast_object", "gather_objects", "storage_leaders"]


def gather_objects(world: Comm, obj: Any) -> list[Any]:
    """Every rank's ``obj``, by rank (collective)."""
    if world.world_size == 1:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj, group=world.group)
    return out


def broadcast_object(world: Comm, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (collective)."""
    if world.world_size == 1:
        return obj
    box = [obj]
    root = src if world.group is None else dist.get_global_rank(world.group, src)
    dist.broadcast_object_list(box, src=root, group=world.group)
    return box[0]


def agree_step(world: Comm, directory: Path, step: int | None, *, latest: Any, committed: Any) -> int:
    """The step every rank loads: ``step``, or the one rank 0's ``latest(directory)`` names, broadcast.
    Every rank then checks ``committed(directory, step)`` on its own storage; a rank that lacks it fails
    every rank with one `CheckpointRankError` naming the step and the rank (the lowest such rank)."""
    chosen = step
    if chosen is None and world.rank == 0:
        chosen = latest(directory)
    chosen = broadcast_object(world, chosen) if step is None else step
    if chosen is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {directory}")
    seen = gather_objects(world, None if committed(directory, chosen) else str(directory))
    missing = [(r, d) for r, d in enumerate(seen) if d is not None]
    if missing:
        rank, where = missing[0]
        raise CheckpointRankError(
            f"rank {rank} has no committed step {chosen} in {where} (ranks without it: "
            f"{[r for r, _ in missing]}); every rank must load the same step",
            step=chosen,
            rank=rank,
        )
    return int(chosen)


def storage_leaders(world: Comm, directory: Path) -> list[int]:
    """For each rank, the lowest rank that sees the same ``directory`` (collective): ``[0] * world`` when
    the directory is shared by all; with node-local storage, each host's first local rank. Every rank
    drops a marker file there, every rank looks for all of them, then each removes its own."""
    import uuid

    token = broadcast_object(world, uuid.uuid4().hex)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        mine = directory / f".dstrain-probe-{token}-{world.rank}"
        mine.touch()
    except OSError as e:
        raise OSError(e.errno, f"cannot write into the checkpoint directory {directory}: {e.strerror}") from e
    gather_objects(world, None)  # every marker is there
    seen = [r for r in range(world.world_size) if (directory / f".dstrain-probe-{token}-{r}").exists()]
    groups = gather_objects(world, seen)  # and looked at
    mine.unlink(missing_ok=True)
    return [min(groups[r]) for r in range(world.world_size)]
