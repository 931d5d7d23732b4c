"""``AsyncFile``: one file kept open for many operations at offsets (``AsyncIOHandle.open``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ._dispatch import READ, WRITE
from ._sums import ReadSums
from ._tensor import as_bytes, check_range
from ._transfer import FileRef, fsync
from .errors import ClosedError

if TYPE_CHECKING:
    from ._op import Operations
    from .gpu import GpuIO

__all__ = ["AsyncFile"]

_MODES = {
    "r": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT,
}


class AsyncFile:
    """Operations on one open file; they may run concurrently (``asyncio.gather``).

    Closing is safe while operations are in flight: the fds close when the last one finishes.
    """

    def __init__(self, ops: Operations, path: str, mode: str, *, gpu: Callable[[], GpuIO]) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}; got {mode!r}")
        self._ops = ops
        self._gpu = gpu  # the handle's CUDA half (made on the first CUDA tensor)
        self.path = path
        self.mode = mode
        self._ref: FileRef | None = FileRef(path, _MODES[mode], o_direct=ops.config.o_direct)

    def _live(self) -> FileRef:
        if self._ref is None:
            raise ClosedError(f"file {self.path} is closed")
        return self._ref

    @property
    def direct(self) -> bool:
        """Whether the file is open with O_DIRECT."""
        return self._live().direct

    async def pwrite(self, tensor: torch.Tensor, offset: int = 0) -> int:
        """Write the tensor's bytes at ``offset`` in place; return the byte count."""
        ptr, n = as_bytes(tensor)
        ref = self._live()
        if tensor.is_cuda:
            return int(await self._gpu().pwrite_file(ref, tensor, check_range(offset, n, path=self.path)))
        h = self._ops
        h.ready()
        off = check_range(offset, n, path=self.path)
        with h.scope(WRITE, n):
            await h.start(WRITE, ref, ptr, n, off, tensor)
        return n

    async def pread(self, tensor: torch.Tensor, offset: int = 0, *, sums: ReadSums | None = None) -> int:
        """Fill the tensor from ``offset``; a file too short is ``ShortIOError``.

        ``sums`` (CPU tensors): fragments of file offsets whose crc32c the engine computes as the
        bytes arrive (`dsio._sums`); once this returns, ``sums.values()`` holds them (None for the
        ones the engine left to the caller)."""
        ptr, n = as_bytes(tensor)
        ref = self._live()
        if tensor.is_cuda:
            if sums is not None:
                raise ValueError("checksums on the way (sums=) are for CPU tensors")
            return int(await self._gpu().pread_file(ref, tensor, check_range(offset, n)))
        h = self._ops
        h.ready()
        off = check_range(offset, n)
        with h.scope(READ, n):
            if sums is None:
                await h.start(READ, ref, ptr, n, off, tensor)
            else:
                await h.start(READ, ref, ptr, n, off, (tensor, sums), sums.engine_args)
        return n

    async def fsync(self) -> None:
        """Make everything written so far durable (data and metadata)."""
        self._ops.ready()
        await fsync(self._ops.disp, self._live())

    def truncate(self, size: int) -> None:
        os.ftruncate(self._live().fd, size)

    @property
    def size(self) -> int:
        return os.fstat(self._live().fd).st_size

    def close(self) -> None:
        ref, self._ref = self._ref, None
        if ref is not None:
            ref.release()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
