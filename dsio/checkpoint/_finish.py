"""Rank 0's end of a save: commit the step once every rank's file is durable, or remove it.

Runs on a worker thread (every step is a metadata operation with an fsync): write the manifest,
rename ``step-N.tmp`` to ``step-N``, point ``latest`` at it, retire old steps (``keep_last``).
"""

from __future__ import annotations

import logging
import os
import time

from . import _commit
from ._errors import CheckpointLockedError
from ._locate import rank_file

__all__ = ["Outcome", "commit_or_discard", "describe", "latest_or_none", "remove_quietly"]

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
) -> tuple[Outcome, list[str]]:
    """Commit ``tmpdir`` as ``step`` when no rank failed, else remove it; returns the outcome and
    the retired steps' directories to delete (off the save's critical path)."""
    if failures:
        remove_quietly(tmpdir)
        err = next((e for e, _ in failures if isinstance(e, int)), None)
        return ("failed", err, "; ".join(m for _, m in failures), None), []
    try:
        files = []
        for r in range(world_size):
            name = rank_file(r)
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
        return ("failed", getattr(e, "errno", None), f"rank 0 could not commit: {e!r}", None), []
    try:
        _commit.write_latest(directory, step)
    except Exception as e:  # the step is in place and listed: say so, and what latest names now
        return ("latest", getattr(e, "errno", None), repr(e), latest_or_none(directory)), []
    try:
        doomed = _commit.retire(directory, keep_last, protect={step})
    except OSError as e:  # the new step is committed; old ones stay for the next attempt
        log.warning("dsio.checkpoint: retention failed: %r", e)
        doomed = []
    return None, doomed


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
    return ("error", None, None, getattr(error, "errno", None), repr(error))
