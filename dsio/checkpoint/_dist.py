"""Coordination of ranks for a checkpoint, on a process group of its own.

Saves complete in the background while training keeps issuing its own collectives, so the
checkpoint uses a separate gloo group (``new_group`` is collective: every rank constructs its
``Checkpointer`` at the same point) and runs its blocking collectives on one worker thread, the
way ``torch.distributed.checkpoint.async_save`` does. The event loop never blocks on them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

__all__ = ["Coordinator"]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class Coordinator:
    """Rank, world size and async collectives; world size 1 with no process group."""

    def __init__(self, group: Any = None) -> None:
        dist = _dist()
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group: Any = None
        self._ex: concurrent.futures.ThreadPoolExecutor | None = None
        if not self.enabled:
            self.rank, self.world_size = 0, 1
            return
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsio-ckpt-coord")

    def barrier_now(self) -> None:
        """A blocking barrier (construction time only)."""
        if self.enabled:
            _dist().barrier(group=self.group)

    async def _run(self, fn: Any, *args: Any) -> Any:
        assert self._ex is not None
        return await asyncio.get_running_loop().run_in_executor(self._ex, fn, *args)

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.enabled:
            return [obj]
        dist = _dist()

        def gather() -> list[Any]:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
            return out

        return list(await self._run(gather))

    async def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        dist = _dist()

        def bcast() -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            return box[0]

        return await self._run(bcast)

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None
