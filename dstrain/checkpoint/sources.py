"""Lazy checkpoint sources for state that lives in swap files (``dsio.checkpoint.LazyTensor``).

An offloading part's ``checkpoint_state()`` returns `SwapRegions` where its ``state_dict()`` would
return tensors: the checkpoint writer reads each one window at a time from the swap file, after the
swap writes it names have finished, so the state is never materialized. `materialize` turns them
into tensors for a writer that cannot stream (``torch.save``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dsio.checkpoint import FileRegions, LazyTensor

if TYPE_CHECKING:
    from dsio.handle import AsyncIOHandle

__all__ = ["SwapRegions", "has_lazy", "materialize"]


class SwapRegions(FileRegions):
    """`FileRegions` of a swap file whose last writes (``after``: the swapper's futures) must be done
    before its bytes are read (the writer waits for them on dsio's loop, never the training thread)."""

    def __init__(
        self,
        regions: Iterable[tuple[str | os.PathLike[str], int, int]],
        dtype: torch.dtype,
        shape: Sequence[int],
        *,
        after: Sequence[concurrent.futures.Future[Any]] = (),
    ) -> None:
        super().__init__(regions, dtype, shape)
        self.after = list(after)

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        if self.after:
            pending, self.after = self.after, []
            await asyncio.gather(
                *(asyncio.wrap_future(f) for f in pending)
            )  # a failed swap write fails the save
        await super().read_into(io, offset, out)


def has_lazy(value: Any) -> bool:
    """Whether a nested state holds a `LazyTensor`."""
    if isinstance(value, LazyTensor):
        return True
    if isinstance(value, dict):
        return any(has_lazy(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(has_lazy(v) for v in value)
    return False


def materialize(value: Any) -> Any:
    """A copy of a nested state with every `LazyTensor` read into a tensor (on dsio's loop)."""
    if not has_lazy(value):
        return value
    from dsio._bridge import run_sync
    from dsio.checkpoint import DEFAULT_IO
    from dsio.handle import AsyncIOHandle

    async def read_all() -> Any:
        async with AsyncIOHandle(DEFAULT_IO) as io:

            async def walk(v: Any) -> Any:
                if isinstance(v, LazyTensor):
                    return await v.materialize(io)
                if isinstance(v, dict):
                    return type(v)([(k, await walk(x)) for k, x in v.items()])
                if isinstance(v, list | tuple):
                    return type(v)([await walk(x) for x in v])
                return v

            return await walk(value)

    return run_sync(read_all())
