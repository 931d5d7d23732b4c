"""A tensor as raw bytes: (address, nbytes), with clear errors for what cannot be one."""

from __future__ import annotations

import errno
import os
import resource
import threading

import torch

from .errors import OffsetError, TensorLayoutError

__all__ = ["OFF_MAX", "as_bytes", "check_offset", "check_range"]

#: The largest byte position a file offset (``off_t``) can name.
OFF_MAX = 2**63 - 1
#: Ends past this are checked against the filesystem's own limit (ext4: 16 TiB) before any file
#: is created; below it every Linux filesystem dsio runs on accepts the size.
_PROBE_ABOVE = 1 << 40
_fs_ok: dict[int, int] = {}  # st_dev -> largest end the filesystem accepted
_fs_lock = threading.Lock()


def as_bytes(tensor: object, *, what: str = "tensor") -> tuple[int, int]:
    """Return ``(data_ptr, nbytes)`` of a contiguous dense tensor (CPU or CUDA)."""
    if not isinstance(tensor, torch.Tensor):
        raise TensorLayoutError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise TensorLayoutError(f"{what} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.device.type == "meta":
        raise TensorLayoutError(f"{what} is on the meta device and has no data")
    if not tensor.is_contiguous():
        raise TensorLayoutError(
            f"{what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}); "
            "pass tensor.contiguous() so the bytes on disk have a defined order"
        )
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def check_offset(offset: object) -> int:
    """A file offset: a non-negative int (else :class:`~dsio.OffsetError`)."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise OffsetError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise OffsetError(f"offset must be >= 0, got {offset}")
    return offset


def check_range(offset: object, nbytes: int, *, path: str | os.PathLike[str] | None = None) -> int:
    """``offset`` as an int, checked so that ``[offset, offset + nbytes)`` can exist in a file.

    Raises :class:`~dsio.OffsetError` -- before anything is opened or created -- for a non-int or
    negative offset or an end past ``off_t`` (2**63 - 1); for writes (``path`` given) also for an
    end past ``RLIMIT_FSIZE`` or, past 1 TiB, past what ``path``'s filesystem accepts: probed once
    per size on an unnamed ``O_TMPFILE`` inode in its directory, so no visible file is ever made.
    """
    off = check_offset(offset)
    end = off + nbytes
    if end > OFF_MAX:
        raise OffsetError(f"offset {off} + {nbytes} bytes passes the largest file offset (2**63 - 1)")
    if path is None:
        return off  # a read: past the end of the file is ShortIOError, found by the read itself
    soft = _fsize_limit()
    if soft is not None and end > soft:
        raise OffsetError(f"offset {off} + {nbytes} bytes passes RLIMIT_FSIZE ({soft} bytes)")
    if end > _PROBE_ABOVE:
        _check_fs_limit(os.path.dirname(os.path.abspath(os.fspath(path))) or ".", off, end)
    return off


_fsize: list[int | None] = []


def _fsize_limit() -> int | None:
    """The soft RLIMIT_FSIZE, read once per process (a syscall per write measured +1 us); a limit
    lowered later is still enforced by the kernel (EFBIG, an IOFailedError)."""
    if not _fsize:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        _fsize.append(None if soft == resource.RLIM_INFINITY else soft)
    return _fsize[0]


def _check_fs_limit(directory: str, off: int, end: int) -> None:
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return  # the open will report the missing directory
    with _fs_lock:
        if _fs_ok.get(dev, 0) >= end:
            return
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # no O_TMPFILE here: the kernel's EFBIG (IOFailedError) remains the answer
    try:
        os.ftruncate(fd, end)  # sparse: costs no blocks; the inode vanishes on close
    except OSError as e:
        if e.errno == errno.EFBIG:
            raise OffsetError(
                f"offset {off} reaches byte {end}, past the largest file the filesystem of {directory} allows"
            ) from None
        return
    finally:
        os.close(fd)
    with _fs_lock:
        _fs_ok[dev] = max(_fs_ok.get(dev, 0), end)
