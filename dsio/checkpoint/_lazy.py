"""Lazy tensor sources: a tensor of a checkpoint whose bytes are produced piece by piece at save time.

A state may hold a `LazyTensor` wherever it holds a tensor. It is stored as an ordinary tensor of
the safetensors file (same dtype, shape, checksum; it loads back as a plain tensor), but its bytes
are never all in memory: the writer asks it for one window of bytes at a time
(`LazyTensor.read_into`) and writes each window before asking for more, through a few fixed-size
buffers. That is how a training run saves optimizer state that lives in swap files (`FileRegions`)
without materializing it.

A source must return the same bytes for as long as the save is staging (``Checkpointer`` reports
when staging is done; the owner of the bytes must not change them before).
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import UnsupportedStateError
from ._format import dtype_name

if TYPE_CHECKING:
    from ..handle import AsyncIOHandle

__all__ = ["FileRegions", "LazyTensor"]


class LazyTensor:
    """A tensor of ``dtype`` and ``shape`` whose bytes are read on demand (subclass `read_into`)."""

    stable: bool = False
    """True when the bytes cannot change while a save reads them (e.g. swap-file versions pinned
    copy-on-write): an async save then need not wait for them before training goes on (see
    ``dsio.checkpoint._capture``)."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int]) -> None:
        if dtype_name(dtype) is None:
            raise UnsupportedStateError(f"dtype {dtype} has no safetensors equivalent")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape must be non-negative, got {shape}")
        self.dtype = dtype
        self.shape = shape
        self.nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (a contiguous uint8 CPU tensor) with bytes ``[offset, offset + out.numel())``
        of this tensor's data (row-major, native byte order). ``io`` is the writer's handle."""
        raise NotImplementedError

    async def materialize(self, io: AsyncIOHandle) -> torch.Tensor:
        """The whole tensor in memory (for writers that cannot stream, e.g. ``torch.save``)."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            await self.read_into(io, 0, buf)
        return buf.view(self.dtype).view(self.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, shape={self.shape})"


class FileRegions(LazyTensor):
    """A tensor whose bytes are the concatenation of byte ranges of files: ``regions`` is a sequence
    of ``(path, file_offset, nbytes)`` whose sizes add up to the tensor's bytes (e.g. one swapped
    tensor cut into slots of a swap file). Read with the writer's dsio handle (O_DIRECT where the
    file system allows), one file kept open per save."""

    def __init__(
        self,
        regions: Iterable[tuple[str | os.PathLike[str], int, int]],
        dtype: torch.dtype,
        shape: Sequence[int],
    ) -> None:
        super().__init__(dtype, shape)
        self.regions = [(os.fspath(p), int(o), int(n)) for p, o, n in regions]
        if any(o < 0 or n < 0 for _, o, n in self.regions):
            raise ValueError("file regions need non-negative offsets and sizes")
        total = sum(n for _, _, n in self.regions)
        if total != self.nbytes:
            raise ValueError(
                f"file regions hold {total} bytes; a {self.dtype} tensor of {self.shape} has {self.nbytes}"
            )
        self._starts: list[int] = []
        pos = 0
        for _, _, n in self.regions:
            self._starts.append(pos)
            pos += n

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        want = out.numel()
        if offset < 0 or offset + want > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + want}) are outside a {self.nbytes}-byte tensor")
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        done = 0
        while done < want:
            path, file_offset, n = self.regions[i]
            inside = offset + done - self._starts[i]
            k = min(n - inside, want - done)
            if k > 0:
                f = io.open(path, "r")
                try:
                    await f.pread(out[done : done + k], file_offset + inside)
                finally:
                    f.close()
                done += k
            i += 1
