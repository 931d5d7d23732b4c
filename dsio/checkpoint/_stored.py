"""Tensors of a checkpoint file left on disk at load time, read piece by piece by their consumer.

``Checkpointer.load(lazy_from=N)`` returns a `StoredTensor` in place of every tensor of at least ``N``
bytes: a `FileRegions` over the tensor's bytes in the (already opened, checked) rank file. The
consumer reads it window by window (an offloaded optimizer straight into its swap buffers), so a
state bigger than memory loads without ever being all in RAM.

Checksums. A tensor whose file records its blocks' crc32c (dsio writes them for every tensor over
one block, 1 MiB; a smaller one's whole crc32c is its one block's) is checked before any byte of
it is handed out: a read is rounded out to whole blocks, each checked (``ChecksumError``), then
copied into place -- so a rank that reads only a slice of another rank's tensor still detects a
flipped bit in it (`dsio.checkpoint._blocks.CheckedBlocks`, which `SliceReader` reads through too).

A file without block checksums (written before dsio recorded them) is checked as before: reads
that continue where the last one ended extend a running crc32c and the last byte's read compares
it (``ChecksumError``); `StoredTensor.verify` reads whatever was not read in order and checks it,
so a consumer that calls it after its reads never uses unverified bytes silently -- but there, a
partial read's bytes are used before they can be checked.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import ChecksumError
from ._blocks import CheckedBlocks, ReadBytes
from ._integrity import BLOCK_BYTES, crc_continue
from ._lazy import FileRegions

if TYPE_CHECKING:
    from ..handle import AsyncIOHandle

__all__ = ["StoredFile", "StoredTensor"]

#: Window of `StoredTensor.verify` reads.
VERIFY_CHUNK = 8 << 20
_PAGE = 4096


class StoredFile:
    """An open rank file shared by its `StoredTensor`s; closed by `close` or when they are all gone."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        """The file's name when it was opened (for messages)."""
        self.proc_path = f"/proc/self/fd/{fd}"
        """Reads go through the open fd: the same inode whatever ``path`` names by now."""
        self._finalizer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


class StoredTensor(FileRegions):
    """One tensor of a checkpoint file, read on demand with ``io`` (the loading Checkpointer's handle,
    bound to its event loop); crc32c verified as it is read (see the module's docstring)."""

    def __init__(
        self,
        file: StoredFile,
        file_offset: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        *,
        name: str,
        crc32c: int | None,
        io: AsyncIOHandle,
        blocks: Sequence[int] | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.file = file
        self.name = name
        self.io = io
        self.expected = crc32c
        self._next = 0  # bytes read in order so far
        self._crc = 0
        super().__init__([(file.proc_path, file_offset, _nbytes(dtype, shape))], dtype, shape)
        self.blocks = (
            None if blocks is None else CheckedBlocks(name, file.path, self.nbytes, blocks, block_bytes)
        )
        """Its blocks' crc32c, reads through them (None: the file records none for this tensor)."""

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        if self.file.closed:
            raise ValueError(f"tensor {self.name!r} of {self.file.path}: its file was closed")
        if self.blocks is not None:
            await self.blocks.read(self._raw_reader(io), offset, out)
            return
        await super().read_into(io, offset, out)
        n = out.numel()
        if self.expected is None or offset != self._next or n == 0:
            return
        self._crc = _crc_more(out, self._crc)
        self._next += n
        if self._next == self.nbytes and self._crc != self.expected:
            raise ChecksumError(
                f"tensor {self.name!r} in {self.file.path}: crc32c {self._crc:08x} does not match the "
                f"recorded {self.expected:08x} (corrupted file)"
            )

    def _raw_reader(self, io: AsyncIOHandle) -> ReadBytes:
        """Unchecked reads of this tensor's bytes with ``io`` (what `CheckedBlocks` checks)."""

        async def read(offset: int, out: torch.Tensor) -> None:
            await FileRegions.read_into(self, io, offset, out)

        return read

    @property
    def verified(self) -> bool:
        """Every byte matched the recorded checksums (every block checked, or every byte read in
        order), or none was recorded."""
        if self.blocks is not None:
            return self.blocks.complete
        return self.expected is None or self._next == self.nbytes

    async def verify(self, io: AsyncIOHandle | None = None) -> None:
        """Read the bytes not yet read in order (a window at a time) and check the checksum."""
        if self.verified:
            return
        if self.blocks is not None:  # each block not checked yet, one at a time
            read = self._raw_reader(io or self.io)
            for k in range(len(self.blocks.sums)):
                if k not in self.blocks.checked:
                    await self.blocks.block(read, k)
            return
        buf = torch.empty(min(VERIFY_CHUNK, self.nbytes), dtype=torch.uint8)
        while self._next < self.nbytes:
            n = min(buf.numel(), self.nbytes - self._next)
            await self.read_into(io or self.io, self._next, buf[:n])

    async def materialize(self, io: AsyncIOHandle) -> torch.Tensor:
        """The whole tensor in fresh memory placed at the file offset's position within a page, so
        that dsio reads all but its first and last page straight into it (no bounce copy)."""
        offset = self.regions[0][1]
        base = torch.empty(self.nbytes + _PAGE, dtype=torch.uint8)
        s = (offset - base.data_ptr()) % _PAGE
        raw = base[s : s + self.nbytes]
        if self.nbytes:
            await self.read_into(io, 0, raw)
        await self.verify(io)  # a no-op after the whole in-order read above
        if raw.data_ptr() % _esize(self.dtype):
            raw = raw.clone()  # a file whose tensors are not aligned to their element size
        return raw.view(self.dtype).view(self.shape)

    def __repr__(self) -> str:
        return f"StoredTensor({self.name!r}, dtype={self.dtype}, shape={self.shape})"


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = _esize(dtype)
    for d in shape:
        n *= int(d)
    return n


def _crc_more(out: torch.Tensor, value: int) -> int:
    """crc32c of ``out``'s bytes (a contiguous CPU uint8 tensor) continuing ``value``."""
    return crc_continue(out.data_ptr(), out.numel(), value)
