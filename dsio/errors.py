"""Exceptions raised by dsio, each documented with when it is raised.

Tests and callers match on these types, never on message text.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "AlignmentError",
    "BackendUnavailableError",
    "ChecksumError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ClosedError",
    "ConfigError",
    "DsioError",
    "IOFailedError",
    "OffsetError",
    "PicklesByState",
    "PoolBusyError",
    "ShortIOError",
    "SliceRangeError",
    "TensorLayoutError",
    "TensorNotFoundError",
    "UnsupportedStateError",
    "WrongLoopError",
]


class PicklesByState(Exception):
    """An exception that unpickles without calling its ``__init__``: the same ``args`` (so the same
    message), the same attributes, and for an ``OSError`` the same errno, strerror and filenames.

    Exception's own pickling rebuilds ``cls(*self.args)``, which fails for a subclass whose
    ``__init__`` takes other arguments than the ones it passes up (``ConfigError(field, message)``:
    unpickling raised TypeError, and a multiprocessing pool that received such an error from a
    worker hung) or silently changes the message (``IOFailedError`` lost its detail). `DsioError`
    and ``dstrain.DstrainError`` derive from this, so every error of both packages round-trips
    (tests/test_errors_pickle.py walks them all).
    """

    def __reduce__(self):
        os_fields = None
        if isinstance(self, OSError):  # these live in OSError's C fields, not in __dict__
            os_fields = (self.errno, self.strerror, self.filename, self.filename2)
        return (_rebuild, (type(self), self.args, os_fields), self.__dict__ or None)


def _rebuild(cls: type[BaseException], args: tuple, os_fields: tuple | None = None) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    if os_fields is not None:
        assert isinstance(exc, OSError)
        for name, value in zip(("errno", "strerror", "filename", "filename2"), os_fields, strict=True):
            if value is not None:  # an explicit None filename2 would print as "-> None"
                setattr(exc, name, value)
    return exc


class DsioError(PicklesByState):
    """Base class of every error dsio raises on purpose."""


class ConfigError(DsioError, ValueError):
    """A configuration value is invalid; the message names the field and what it accepts.

    ``field`` is the name of the offending field or config key when one is known
    (``IOConfig.from_deepspeed`` sets it to the ``"aio"`` block's key), else ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class BackendUnavailableError(DsioError, RuntimeError):
    """An explicitly requested backend (io_uring, aio, cufile...) cannot run on this machine."""


class ClosedError(DsioError, RuntimeError):
    """An operation was started on a handle, file or pool after ``close()``."""


class WrongLoopError(DsioError, RuntimeError):
    """A handle bound to one event loop was used from another loop (or from no loop)."""


class AlignmentError(DsioError, ValueError):
    """Memory or an offset does not meet an alignment the caller asked dsio to rely on."""


class OffsetError(DsioError, ValueError):
    """A file offset is not an int, is negative, or ``offset + nbytes`` passes the largest file
    size: the ``off_t`` range (2**63 - 1), ``RLIMIT_FSIZE``, or the filesystem's own limit (ext4:
    16 TiB). Raised before any file is opened or created."""


class TensorLayoutError(DsioError, ValueError):
    """A tensor dsio cannot transfer as raw bytes: not contiguous, sparse, or not a tensor at all."""


class PoolBusyError(DsioError, RuntimeError):
    """``PinnedPool.close()`` was called while buffers were still handed out."""


class UnsupportedStateError(DsioError, TypeError):
    """A checkpoint state holds a value that cannot be stored without pickling."""


class CheckpointNotFoundError(DsioError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class IOFailedError(DsioError, OSError):
    """The kernel failed a read or write. Carries ``errno``, ``filename`` and ``offset``.

    The whole request fails: dsio never reports a partial transfer as success.
    """

    def __init__(self, err: int, filename: str | None, offset: int | None, detail: str = "") -> None:
        msg = os.strerror(err) if err else "I/O failed"
        if detail:
            msg = f"{msg} ({detail})"
        if offset is not None and offset >= 0:
            msg = f"{msg} at offset {offset}"
        super().__init__(err, msg, filename)
        self.offset = offset


class ShortIOError(IOFailedError):
    """A read reached end of file before the tensor was full, or a write stored fewer bytes than asked.

    ``transferred`` is how many bytes did move; ``errno`` is ``EIO``.
    """

    def __init__(
        self, filename: str | None, offset: int | None, transferred: int = 0, expected: int = 0
    ) -> None:
        super().__init__(_errno.EIO, filename, offset, f"short transfer: {transferred} of {expected} bytes")
        self.transferred = transferred
        self.expected = expected


class ChecksumError(DsioError, ValueError):
    """Data read back does not match its recorded checksum; names the tensor and the file."""


class CheckpointFormatError(DsioError, ValueError):
    """A checkpoint file, manifest or ``latest`` pointer is malformed or truncated, or names a path
    outside the checkpoint directory. Raised before any data from it is returned."""


class CheckpointMismatchError(DsioError, ValueError):
    """A committed checkpoint does not fit the job loading it (e.g. written by another world size)."""


class TensorNotFoundError(DsioError, KeyError):
    """A read named tensors that the checkpoint file does not hold. ``names`` lists every missing
    name (sorted), ``path`` is the file; raised before any byte is read."""

    def __init__(self, path: str, names: list[str] | tuple[str, ...]) -> None:
        self.path = path
        self.names = tuple(sorted(names))
        shown = ", ".join(repr(n) for n in self.names[:20])
        more = f" and {len(self.names) - 20} more" if len(self.names) > 20 else ""
        super().__init__(f"{path} has no tensor {shown}{more}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class SliceRangeError(DsioError, IndexError):
    """A slice read asked for elements ``[start, stop)`` of a tensor that has ``numel`` elements
    (a negative start, or a stop past the end); raised before any byte is read."""

    def __init__(self, path: str, name: str, start: int, stop: int, numel: int) -> None:
        super().__init__(
            f"{path}: elements [{start}, {stop}) are outside tensor {name!r} of {numel} elements"
        )
        self.path = path
        self.name = name
        self.start = start
        self.stop = stop
        self.numel = numel
