"""Untrusted-directory file access and the durable operations of the commit protocol.

Reading: every file of a checkpoint directory is opened relative to the directory's own fd with
``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``-ed as a regular file, and every read is bounded, so a
symlink planted in the directory, a FIFO (which would block ``open`` or ``read`` forever), a
device node or a sparse 1 GiB "manifest" is refused before a byte of it is read. Errors name the
file and what is wrong with it, never its contents.

Writing: the commit protocol is a short sequence of syscalls whose order is its correctness
(file data synced, rename, directory synced). Each goes through one function here, and each calls
``trace(op, path)`` first when a test installed one: the durability, crash-point and I/O-error
tests record, kill or fail the process at each operation in turn through that one hook.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointFormatError

__all__ = [
    "exchange",
    "fsync_dir",
    "fsync_fd",
    "open_dir",
    "open_regular",
    "read_bounded",
    "remove_tree",
    "rename",
    "set_trace",
    "write_durable",
]

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW

#: Called as ``trace(op, path)`` before each durable operation (tests only); None in production.
_trace: Callable[[str, str], None] | None = None


def set_trace(fn: Callable[[str, str], None] | None) -> Callable[[str, str], None] | None:
    """Install ``fn`` as the operation hook (None removes it); return the previous one."""
    global _trace
    prev, _trace = _trace, fn
    return prev


def _op(op: str, path: str) -> None:
    fn = _trace
    if fn is not None:
        fn(op, path)


# -- reading untrusted files ----------------------------------------------------------------------
def open_regular(name: str, *, dir_fd: int | None = None, follow: bool = False, what: str = "") -> int:
    """An fd of the regular file ``name`` (relative to ``dir_fd``), opened without blocking.

    ``follow=False`` refuses a symlink as the last component. Anything but a regular file is
    ``CheckpointFormatError``; a missing file is ``FileNotFoundError`` (the caller decides what
    that means). The fd is in blocking mode again when returned (O_NONBLOCK only guards ``open``).
    """
    label = what or name
    flags = _READ_FLAGS | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointFormatError(
                f"{label} is a symbolic link; checkpoint files must be plain files"
            ) from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(e.errno, os.strerror(e.errno), label) from None
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
            raise CheckpointFormatError(
                f"{label} cannot be opened as a checkpoint file ({e.strerror})"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{label} is not a regular file ({_kind(st.st_mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_bounded(fd: int, limit: int, what: str) -> bytes:
    """The whole content of the regular file ``fd``, refused (unread) when over ``limit`` bytes."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise CheckpointFormatError(f"{what} is {size} bytes, more than the {limit} such a file may have")
    chunks = []
    left = size
    while left > 0:
        b = os.pread(fd, left, size - left)
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    if os.pread(fd, 1, size):  # grew while being read: not a file anyone should be writing now
        raise CheckpointFormatError(f"{what} changed size while being read")
    return b"".join(chunks)


def open_dir(name: str, *, dir_fd: int | None = None, what: str = "", follow: bool = False) -> int:
    """An fd of the directory ``name`` (relative to ``dir_fd``); a file is refused, and so is a
    symlink unless ``follow`` (the root the caller named may be one; entries inside may not)."""
    label = what or name
    try:
        return os.open(name, _DIR_FLAGS & ~(os.O_NOFOLLOW if follow else 0), dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(e.errno, os.strerror(e.errno), label) from None
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise CheckpointFormatError(f"{label} is not a directory (a file or a symbolic link)") from None
        raise


@contextlib.contextmanager
def fd_closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


# -- durable operations ----------------------------------------------------------------------------
def fsync_fd(fd: int, path: str) -> None:
    _op("fsync_file", path)
    os.fsync(fd)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    _op("fsync_dir", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename(src: str, dst: str) -> None:
    """``rename(2)``: atomic; replaces ``dst`` if it is a file or an empty directory."""
    _op("rename", dst)
    os.rename(src, dst)


def write_durable(path: str, data: bytes) -> None:
    """Create ``path`` (replacing it) with ``data``, fsynced; the caller renames it into place."""
    _op("write", path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fsync_fd(fd, path)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None
try:
    _renameat2 = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).renameat2
    _renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    _renameat2.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - glibc < 2.28 / another libc
    _renameat2 = None

#: Whether ``exchange`` may be tried (tests turn it off to exercise the fallback).
exchange_enabled = _renameat2 is not None


def exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``).

    Returns False, having changed nothing, where the kernel, libc or filesystem cannot do it.
    """
    if not exchange_enabled or _renameat2 is None:
        return False
    _op("exchange", b)
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def remove_tree(path: str) -> None:
    """Delete ``path`` (a directory tree or a file) if it exists; errors are not fatal."""
    _op("remove", path)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(path)
