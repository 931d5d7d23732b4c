"""The single-writer lock of a checkpoint directory: ``fcntl.flock`` on ``writer.lock``.

``flock`` belongs to the open file description, so a second writer in the same process is refused
like one in another process, and the kernel drops the lock when the holder dies (kill -9
included): a stale lock cannot outlive its writer. After locking, the holder records its pid
and host in the file, so the refused writer's error can name it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time

from ..errors import CheckpointFormatError
from ._commit import LOCK
from ._errors import CheckpointLockedError

__all__ = ["DirectoryLock"]

_MAX_LOCK_BYTES = 4096


class DirectoryLock:
    """Exclusive writer lock of ``directory``, held from ``acquire()`` until ``release()``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK)
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        """Take the lock or raise ``CheckpointLockedError`` naming its holder (never waits)."""
        if self._fd >= 0:
            return
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointFormatError(f"{self.path} is a symbolic link") from None
            raise
        try:
            if not os.path.samestat(os.fstat(fd), os.lstat(self.path)) or not stat.S_ISREG(
                os.fstat(fd).st_mode
            ):
                raise CheckpointFormatError(f"{self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid, host = _holder(fd)
                raise CheckpointLockedError(self.directory, pid, host) from None
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode() + b"\n", 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.ftruncate(fd, 0)  # no stale holder named once it is gone
            finally:
                os.close(fd)  # closing the description drops the flock


def _holder(fd: int) -> tuple[int | None, str | None]:
    """The pid and host recorded by the holder (bounded read; anything malformed is unknown)."""
    try:
        raw = os.pread(fd, _MAX_LOCK_BYTES, 0)
        info = json.loads(raw.decode("utf-8"))
        pid, host = info.get("pid"), info.get("host")
        return (pid if type(pid) is int else None, host if isinstance(host, str) else None)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None, None
