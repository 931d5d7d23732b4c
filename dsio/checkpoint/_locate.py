"""Finding and opening one rank's file of a committed step, safely and without a lock.

Readers take no lock and never change the directory, so a writer may commit, re-save or retire
steps while they read. The step directory is opened once (``O_DIRECTORY | O_NOFOLLOW``) and the
manifest and rank file are opened relative to that fd, so a rename of the step (retention,
re-save) after that point cannot make them point elsewhere; once the rank file is open, even
its deletion cannot take the data away. A step that disappears before its file is open is
``CheckpointNotFoundError`` (``load()`` of the latest step resolves ``latest`` again first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CheckpointFormatError, CheckpointMismatchError, CheckpointNotFoundError
from . import _commit, _fs

__all__ = ["OpenedRankFile", "open_rank_file", "rank_file"]


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True, slots=True)
class OpenedRankFile:
    fd: int
    """Open, checked regular file; the caller closes it."""
    path: str
    """Where it was found (for messages)."""
    size: int


def open_rank_file(root: str, step: int, rank: int, world_size: int) -> OpenedRankFile:
    """Open the file ``rank`` wrote at committed ``step`` in ``root``, checked against the manifest.

    Raises ``CheckpointNotFoundError`` (not committed, or retired meanwhile),
    ``CheckpointMismatchError`` (another world size) or ``CheckpointFormatError``.
    """
    try:
        root_fd = _fs.open_dir(root, what=root, follow=True)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint directory {root}") from None
    try:
        step_fd, label = -1, ""
        for name in _commit.step_dirs(step):
            try:
                step_fd = _fs.open_dir(name, dir_fd=root_fd, what=os.path.join(root, name))
                label = os.path.join(root, name)
                break
            except FileNotFoundError:
                continue
    finally:
        os.close(root_fd)
    if step_fd < 0:
        raise CheckpointNotFoundError(f"step {step} is not committed in {root}")
    try:
        try:
            manifest = _commit.read_manifest(step_fd, label)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in {root}") from None
        if manifest["world_size"] != world_size:
            raise CheckpointMismatchError(
                f"{label} was written by {manifest['world_size']} ranks; this job has {world_size} "
                "(loading into a different world size is not supported yet)"
            )
        entry = next((f for f in manifest["files"] if f["rank"] == rank), None)
        if entry is None:
            raise CheckpointFormatError(f"{label}/{_commit.MANIFEST} lists no file for rank {rank}")
        path = os.path.join(label, entry["path"])
        try:
            fd = _fs.open_regular(entry["path"], dir_fd=step_fd, what=path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} is gone (step {step} retired while loading?)") from None
    finally:
        os.close(step_fd)
    size = os.fstat(fd).st_size
    if size != entry["bytes"]:
        os.close(fd)
        raise CheckpointFormatError(
            f"{path}: {size} bytes, the manifest recorded {entry['bytes']} (truncated?)"
        )
    return OpenedRankFile(fd, path, size)
