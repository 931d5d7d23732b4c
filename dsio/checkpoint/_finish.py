"""Rank 0's end of a save: commit the step once every rank's file is durable, or remove it.

Runs on a worker thread (every step is a metadata operation with an fsync): write the manifest,
rename ``step-N.tmp`` to ``step-N``, point ``latest`` at it, retire old steps (``keep_last``).

`commit_written` is the same end for rank files someone else wrote (dstrain's ``torch.save``
fallback store): one commit protocol for every checkpoint directory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO

from . import _commit, _fs
from ._errors import CheckpointCommitError, CheckpointLockedError, LatestNotUpdatedError, errno_of
from ._locate import rank_file

__all__ = [
    "Outcome",
    "commit_or_discard",
    "commit_written",
    "describe",
    "latest_or_none",
    "remove_quietly",
    "step_tmp_dir",
    "write_rank_file",
]

log = logging.getLogger("dsio.checkpoint")

Outcome = tuple[str, int | None, str, int | None] | None
"""None = committed; else (kind "failed" | "latest", errno, message, the step ``latest`` names)."""


def commit_or_discard(
    directory: str,
    world_size: int,
    keep_last: int | None,
    step: int,
    tmpdir: str,
    failures: list[tuple[int | None, str]],
    names: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
) -> tuple[Outcome, list[str]]:
    """Commit ``tmpdir`` as ``step`` when no rank failed, else remove it; returns the outcome and
    the retired steps' directories to delete (off the save's critical path). ``names``: rank r's
    file in ``tmpdir`` (default dsio's ``rank-NNNNN.safetensors``); with ``ranks``, ``names[i]`` is
    the file of rank ``ranks[i]`` of ``world_size`` (a directory holding some ranks' files: one host's
    of node-local storage)."""
    if failures:
        remove_quietly(tmpdir)
        err = next((e for e, _ in failures if isinstance(e, int)), None)
        return ("failed", err, "; ".join(m for _, m in failures), None), []
    try:
        files = []
        for i, r in enumerate(range(world_size) if ranks is None else ranks):
            name = rank_file(r) if names is None else names[i]
            files.append({"rank": r, "path": name, "bytes": os.path.getsize(os.path.join(tmpdir, name))})
        manifest = {
            "format": "dsio.checkpoint",
            "version": 1,
            "step": step,
            "world_size": world_size,
            "files": files,
            "created_unix": time.time(),
        }
        _commit.write_manifest(tmpdir, manifest)
        _commit.commit(directory, step)
    except _commit.StepVisibleError as e:  # in place and listed after all: say exactly that
        return ("latest", e.errno, repr(e), latest_or_none(directory)), []
    except Exception as e:  # e.g. ENOSPC writing the manifest: nothing of the step is visible
        remove_quietly(tmpdir)
        return ("failed", errno_of(e), f"rank 0 could not commit: {e!r}", None), []
    try:
        _commit.write_latest(directory, step)
    except Exception as e:  # the step is in place and listed: say so, and what latest names now
        return ("latest", errno_of(e), repr(e), latest_or_none(directory)), []
    try:
        doomed = _commit.retire(directory, keep_last, protect={step})
    except OSError as e:  # the new step is committed; old ones stay for the next attempt
        log.warning("dsio.checkpoint: retention failed: %r", e)
        doomed = []
    return None, doomed


def step_tmp_dir(directory: str | os.PathLike[str], step: int) -> str:
    """Where the rank files of ``step`` are written before `commit_written` (created if missing)."""
    path = os.path.join(os.fspath(directory), _commit.tmp_name(step))
    os.makedirs(path, exist_ok=True)
    return path


def write_rank_file(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` and let ``write`` fill it, then flush and fsync it (the protocol's file sync)."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        write(f)
        f.flush()
        _fs.fsync_fd(f.fileno(), path)


def commit_written(
    directory: str | os.PathLike[str],
    step: int,
    names: Sequence[str],
    *,
    failures: Sequence[str] = (),
    keep_last: int | None = None,
    ranks: Sequence[int] | None = None,
    world_size: int | None = None,
) -> None:
    """Rank 0's end of a save whose rank files were written (with `write_rank_file`) into
    `step_tmp_dir`: ``names[r]`` is rank r's file. With no ``failures``: write the manifest,
    commit the step, point ``latest`` at it and retire steps beyond ``keep_last``, each made
    durable as ``Checkpointer`` does. With failures (one message per failed rank), or when the
    commit fails, the partial step is removed and `CheckpointCommitError` raised;
    `LatestNotUpdatedError` when the step is committed but ``latest`` could not be updated.

    ``ranks`` / ``world_size``: the directory holds only these ranks' files (``names[i]`` is rank
    ``ranks[i]``'s) of a job of ``world_size`` ranks, e.g. one host's directory of node-local storage;
    its manifest lists those files."""
    root = os.fspath(directory)
    tmpdir = os.path.join(root, _commit.tmp_name(step))
    outcome, doomed = commit_or_discard(
        root,
        len(names) if world_size is None else world_size,
        keep_last,
        step,
        tmpdir,
        [(None, m) for m in failures],
        names,
        ranks,
    )
    _commit.remove_trees(doomed)
    if outcome is None:
        return
    kind, err, msg, previous = outcome
    if kind == "latest":
        raise LatestNotUpdatedError(err, step, msg, previous)
    raise CheckpointCommitError(err, step, msg)


def remove_quietly(path: str) -> None:
    try:
        _commit.remove_trees([path])
    except OSError as e:  # the partial step stays as *.tmp: the next writer removes it
        log.warning("dsio.checkpoint: could not remove %s: %r", path, e)


def latest_or_none(root: str) -> int | None:
    try:
        return _commit.read_latest(root)
    except Exception:
        return None


def describe(error: BaseException | None) -> tuple[str, int | None, str | None, int | None, str] | None:
    """A picklable summary of why rank 0 could not become the writer (None: it did)."""
    if error is None:
        return None
    if isinstance(error, CheckpointLockedError):
        return ("locked", error.pid, error.host, None, str(error))
    return ("error", None, None, errno_of(error), repr(error))
