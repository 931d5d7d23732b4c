"""Byte ranges of one tensor read out of whole checksummed blocks, each checked before a byte is used.

dsio's files record the crc32c of each `BLOCK_BYTES` block of every tensor over one block (a
smaller tensor's whole crc32c is its one block's: `dsio.checkpoint._integrity.parse_blocks`). A
read of bytes ``[offset, offset + n)`` of such a tensor is rounded out to whole blocks: the blocks
it covers entirely are read straight into the caller's memory and checked there; a partial block
at either end is read whole into a one-block buffer, checked, and the wanted part copied out (the
last such block is kept, so a read that continues where the last one ended does not read it
twice). A mismatch is ``ChecksumError`` naming the tensor, the file and the block's bytes.

One `CheckedBlocks` per tensor being read; both `StoredTensor` (a load's tensors left in the
file) and `SliceReader` (byte ranges of any safetensors file) read through it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import torch

from ..errors import ChecksumError
from ._integrity import crc_of

__all__ = ["CheckedBlocks", "ReadBytes"]

ReadBytes = Callable[[int, torch.Tensor], Awaitable[None]]
"""``read(offset, dest)``: fill ``dest`` (contiguous CPU uint8) with bytes ``[offset, offset +
dest.numel())`` of the tensor, unchecked (the file's bytes as they are)."""


class CheckedBlocks:
    """The block checksums ``sums`` of the ``nbytes``-byte tensor ``name`` of ``path``, and reads
    through them (`read`); ``checked`` holds the blocks that matched so far."""

    def __init__(self, name: str, path: str, nbytes: int, sums: Sequence[int], block_bytes: int) -> None:
        count = -(-nbytes // block_bytes) if nbytes else 0
        if len(sums) != count:
            raise ValueError(
                f"{count} blocks of {block_bytes} bytes in {nbytes} bytes, {len(sums)} sums given"
            )
        self.name = name
        self.path = path
        self.nbytes = nbytes
        self.sums = list(sums)
        self.block_bytes = block_bytes
        self.checked: set[int] = set()
        self._edge: tuple[int, torch.Tensor] | None = None  # the last partial block read, checked

    async def read(self, read: ReadBytes, offset: int, out: torch.Tensor) -> None:
        """Bytes ``[offset, offset + out.numel())`` into ``out`` (contiguous CPU uint8), every block
        they touch checked. An inner block is read into ``out`` and checked there, so after a
        ``ChecksumError`` ``out`` may hold unchecked bytes: the caller must not use it."""
        n, size = out.numel(), self.block_bytes
        end = offset + n
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"bytes [{offset}, {end}) are outside a {self.nbytes}-byte tensor")
        if n == 0:
            return
        first, last = offset // size, (end - 1) // size
        inner_lo = first if offset % size == 0 else first + 1  # blocks wholly inside the range
        inner_hi = last + 1 if end % size == 0 or end == self.nbytes else last
        if inner_hi > inner_lo:
            a, b = inner_lo * size, min(inner_hi * size, self.nbytes)
            dest = out[a - offset : b - offset]
            await read(a, dest)
            for k in range(inner_lo, inner_hi):
                lo = k * size - a
                self.check(k, dest[lo : min(lo + size, dest.numel())])
        for k in sorted({first, last} - set(range(inner_lo, inner_hi))):
            block = await self.block(read, k)
            lo, hi = max(offset, k * size), min(end, k * size + block.numel())
            out[lo - offset : hi - offset].copy_(block[lo - k * size : hi - k * size])

    async def block(self, read: ReadBytes, k: int) -> torch.Tensor:
        """Block ``k`` whole, checked (the last one read is kept)."""
        if self._edge is not None and self._edge[0] == k:
            return self._edge[1]
        start = k * self.block_bytes
        block = torch.empty(min(self.block_bytes, self.nbytes - start), dtype=torch.uint8)
        await read(start, block)
        self.check(k, block)
        self._edge = (k, block)
        return block

    def check(self, k: int, raw: torch.Tensor) -> None:
        """``ChecksumError`` unless ``raw`` (block ``k``'s bytes, contiguous CPU) matches its sum."""
        got = crc_of(raw.data_ptr(), raw.numel())
        if got != self.sums[k]:
            start = k * self.block_bytes
            raise ChecksumError(
                f"tensor {self.name!r} in {self.path}: bytes [{start}, {start + raw.numel()}) have "
                f"crc32c {got:08x}, not the recorded {self.sums[k]:08x} (corrupted file)"
            )
        self.checked.add(k)

    @property
    def complete(self) -> bool:
        """Every block has been checked."""
        return len(self.checked) == len(self.sums)
