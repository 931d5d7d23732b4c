"""Each swapper's private directory under ``nvme_path``, locked while its run lives, and the
removal of the directories that killed runs left behind.

    nvme_path/
      dstrain-swap-optimizer-k3j2x/   .lock (flock'ed by the live run), optimizer.swp
      dstrain-swap-param-9dd1q/       .lock, param.swp

A run removes its directory when it closes. A run that was killed (``kill -9``, out of memory, a
lost node) cannot, and its swap files can be as big as the model's optimizer state; the kernel
releases its lock though. So before a swapper makes its directory it takes the lock of each
``dstrain-swap-*`` directory there without waiting: one it gets belongs to no live process and is
removed; one it cannot get is a live run's and is left alone. A directory without a lock file (a
run that has just made its directory, or an older dstrain) is left alone too.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile

__all__ = ["LOCK", "PREFIX", "RunDir", "remove_leftovers"]

log = logging.getLogger(__name__)

PREFIX = "dstrain-swap-"
LOCK = ".lock"
_HIDDEN = ".new-"


def _try_lock(path: str) -> int | None:
    """An fd holding ``path``'s exclusive flock, or None where another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_leftovers(directory: str) -> list[str]:
    """Remove the swap directories in ``directory`` that no live process holds; returns their paths."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        path = os.path.join(directory, name)
        if not name.startswith(PREFIX) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            fd = _try_lock(os.path.join(path, LOCK))
        except OSError:  # no lock file (being made, or an older run): not ours to judge
            continue
        if fd is None:
            continue  # a live run's
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(path)
    if removed:
        log.info(
            "dstrain: removed %d swap directories of runs that ended without closing: %s",
            len(removed),
            removed,
        )
    return removed


class RunDir:
    """A new private directory ``PREFIX<kind>-*`` in ``directory``, locked until `remove`."""

    def __init__(self, directory: str | os.PathLike[str], kind: str) -> None:
        root = os.fspath(directory)
        remove_leftovers(root)
        # made under a name the sweep ignores, locked, then renamed into view: another rank's sweep
        # never sees it unlocked (between creating the lock file and taking the lock)
        hidden = tempfile.mkdtemp(prefix=f"{_HIDDEN}{PREFIX}{kind}-", dir=root)
        self._fd: int | None = os.open(
            os.path.join(hidden, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # a fresh file nobody else has opened: at once
        self.path = os.path.join(root, os.path.basename(hidden)[len(_HIDDEN) :])
        os.rename(hidden, self.path)  # the random suffix is unique in root

    def remove(self) -> None:
        """Delete the directory and everything in it, then let go of the lock (idempotent)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None
