"""Errors of the checkpoint directory protocol (writers, locks, commits).

They sit beside ``dsio.errors`` (every one is a ``DsioError``) and are exported by
``dsio.checkpoint``.
"""

from __future__ import annotations

import errno as _errno
import os

from ..errors import DsioError

__all__ = [
    "CheckpointCommitError",
    "CheckpointLockedError",
    "LatestNotUpdatedError",
    "StateChangedError",
    "errno_of",
]


def errno_of(error: BaseException) -> int | None:
    """The errno a failure carries (an ``OSError``'s, e.g. ``IOFailedError``), None for any other
    exception: what a save's verdict and a commit's outcome record."""
    return error.errno if isinstance(error, OSError) else None


class CheckpointLockedError(DsioError, RuntimeError):
    """Another writer (this process or another, on this host or another) holds the checkpoint
    directory's lock. ``pid`` and ``host`` name the holder as it recorded itself (None when it
    had not written them yet)."""

    def __init__(self, directory: str, pid: int | None, host: str | None) -> None:
        who = f"pid {pid} on {host}" if pid is not None else "a writer that has not identified itself yet"
        super().__init__(
            f"{directory} is being written by {who}; only one writer per checkpoint directory "
            "(load-only use needs no lock: construct a Checkpointer and call load()/steps())"
        )
        self.directory = directory
        self.pid = pid
        self.host = host


class CheckpointCommitError(DsioError, OSError):
    """A save did not commit its step: writing or committing it failed on some rank.

    ``errno`` is the failing operation's (``EIO`` when it was not an OS error), ``step`` the step
    and ``committed`` False: nothing of this save is visible, earlier steps are untouched.
    """

    committed = False

    def __init__(self, err: int | None, step: int, detail: str) -> None:
        code = err or _errno.EIO
        super().__init__(code, f"checkpoint of step {step} was not committed: {detail} ({os.strerror(code)})")
        self.step = step


class LatestNotUpdatedError(CheckpointCommitError):
    """The step IS committed (listed by ``steps()``, loadable with ``load(step=...)``) but
    updating the ``latest`` pointer failed (or making the step's rename durable did).
    ``previous`` is what ``latest`` names after the failure, as read back (None: nothing valid).

    ``committed`` is True; retention was skipped for this save.
    """

    committed = True

    def __init__(self, err: int | None, step: int, detail: str, previous: int | None = None) -> None:
        OSError.__init__(
            self,
            err or _errno.EIO,
            f"step {step} is committed and listed, but updating 'latest' failed; it names "
            f"{'step ' + str(previous) if previous is not None else 'nothing'}: {detail}",
        )
        self.step = step
        self.previous = previous


class StateChangedError(DsioError, RuntimeError):
    """A background-staged save (``Checkpointer.save``'s default) found that the caller changed a
    tensor of the state (through a torch operation: its version counter moved) after ``save()``
    was called and before ``wait_staged()`` returned, so the file might hold a mix of old and new
    bytes. Raised by the save's task; nothing of that save is committed, earlier steps are
    untouched. ``names`` lists the changed tensors (state paths, as in the file)."""

    def __init__(self, step: int, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(
            f"checkpoint of step {step} was not committed: {shown} changed before its bytes were "
            "staged (wait for `await ckpt.wait_staged()` before changing the state, or pass "
            "background_staging=False to have save() copy it before returning)"
        )
        self.step = step
        self.names = names
