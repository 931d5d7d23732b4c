"""Reading this rank's file of a committed step (``Checkpointer.load``'s disk side)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointNotFoundError
from ..handle import AsyncIOHandle
from ._format import Header
from ._locate import OpenedRankFile, open_rank_file
from ._read import read_file, read_file_into
from ._stored import StoredFile, StoredTensor

__all__ = ["read_rank_file"]

#: How often a load of the latest step re-resolves ``latest`` when retention removed the step it
#: had chosen between choosing and opening it.
LOAD_RETRIES = 5


async def read_rank_file(
    io: AsyncIOHandle,
    directory: str,
    step: int | None,
    latest: Any,
    rank: int,
    world_size: int,
    *,
    verify: bool,
    lazy_from: int | None,
    into: dict[str, Any] | None = None,
) -> tuple[OpenedRankFile, Header, dict[str, Any]]:
    """Open (``latest()`` names the step when ``step`` is None) and read this rank's file. With
    ``lazy_from`` its big tensors stay in it as `StoredTensor`s, which keep it open; with ``into``
    (a state's flattened tensors) they are read into those tensors (`read_file_into`)."""
    for attempt in range(LOAD_RETRIES):
        chosen = latest() if step is None else step
        if chosen is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {directory}")
        try:
            opened = open_rank_file(directory, chosen, rank, world_size)
            break
        except CheckpointNotFoundError:
            if step is not None or attempt == LOAD_RETRIES - 1:
                raise
    stored = StoredFile(opened.fd, opened.path) if lazy_from is not None else None
    try:
        if into is not None:
            header, filled = await read_file_into(io, opened.path, into, verify=verify, fd=opened.fd)
            tensors: dict[str, Any] = dict(filled)
        else:
            header, tensors = await read_file(
                io, opened.path, verify=verify, fd=opened.fd, lazy_from=lazy_from, stored=stored
            )
    except BaseException:
        if stored is not None:
            stored.close()
        else:
            os.close(opened.fd)
        raise
    if stored is None:
        os.close(opened.fd)
    elif not any(isinstance(t, StoredTensor) for t in tensors.values()):
        stored.close()
    return opened, header, tensors  # the StoredTensors keep the file open until they are all gone
