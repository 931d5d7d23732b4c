"""Byte-range reads: parts of tensors of one safetensors file, straight into the caller's memory.

    async with await SliceReader.open("model.safetensors") as r:
        r.tensors["wte.weight"]                      # TensorInfo(dtype, shape)
        await r.read([TensorSlice("wte.weight", out, start=1 << 20)])   # out.numel() elements

A rank that owns elements ``[start, stop)`` of a flattened parameter reads exactly those bytes of
the file and nothing else: the request goes through the handle (O_DIRECT for the 4096-aligned
body when the destination sits at the same offset within a page as the bytes in the file, the
edges and any other destination staged through pinned buffers), all slices in flight at once.
A destination of another dtype is filled through a bounded staging buffer and converted
(``convert=True``); a CUDA destination of the file's dtype is read through dsio's GPU path.

The file may be anyone's: stock safetensors (Hugging Face ``model.safetensors`` and its shards)
or dsio's own. Its header is untrusted: its declared length is checked against the file size and
``max_header_bytes`` before anything of that size is allocated, and it is validated as
``dsio.checkpoint.load`` validates it (dtype, shape, offsets that tile the data section).

Checksums (``verify``). dsio's files record the crc32c of each 1 MiB block of every tensor (a
tensor of at most one block: its whole crc32c): a slice is rounded out to the whole blocks it
touches, each is checked before its bytes are used (`dsio.checkpoint._blocks.CheckedBlocks`: the
blocks inside the slice read straight into ``out``, a partial block at either end read whole into a
one-block buffer), so a flipped bit anywhere in a slice is ``ChecksumError`` -- at the price of
reading up to one block more at each end. A file that records only whole-tensor sums (dsio's
before block sums) has slices covering a whole tensor checked; stock safetensors files record none.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .._gather import wait_all
from ..config import IOConfig
from ..errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    ClosedError,
    SliceRangeError,
    TensorLayoutError,
    TensorNotFoundError,
)
from ..file import AsyncFile
from ..handle import AsyncIOHandle
from . import _fs
from ._blocks import CheckedBlocks, ReadBytes
from ._format import MAX_HEADER_BYTES, Header
from ._integrity import crc_extend, crc_of, parse_blocks, parse_checksums
from ._read import read_header

__all__ = ["SliceReader", "TensorInfo", "TensorSlice", "read_slices"]

#: Staging bytes per converting slice; at most ``CONVERT_PARALLEL`` of them in flight.
CONVERT_CHUNK_BYTES = 16 << 20
CONVERT_PARALLEL = 4


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a file as its header describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Elements ``[start, start + out.numel())`` of the row-major flattened tensor ``name``, read into
    ``out`` (contiguous, any shape, on the CPU or a CUDA device)."""

    name: str
    out: torch.Tensor
    start: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.out.numel()


class SliceReader:
    """One safetensors file opened for slice reads (open with `SliceReader.open`). ``tensors``
    maps each name to its `TensorInfo`, in file order. Close it (or use ``async with``)."""

    def __init__(
        self, path: str, fd: int, file: AsyncFile, header: Header, handle: AsyncIOHandle, owned: bool
    ) -> None:
        self.path = path
        self._fd: int | None = fd
        self._file = file
        self._header = header
        self._handle = handle
        self._owned = owned
        self._entries = {e.name: e for e in header.entries}
        self.tensors: Mapping[str, TensorInfo] = MappingProxyType(
            {e.name: TensorInfo(e.dtype, e.shape) for e in header.entries}
        )
        self.metadata: Mapping[str, str] = MappingProxyType(dict(header.metadata))
        self._sums = parse_checksums(header.metadata, list(self._entries), path)
        self._block_bytes, self._blocks = parse_blocks(
            header.metadata, {e.name: e.nbytes for e in header.entries}, self._sums, path
        )

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        handle: AsyncIOHandle | None = None,
        config: IOConfig | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> SliceReader:
        """Open ``path`` and validate its header. A missing file is ``CheckpointNotFoundError``;
        a FIFO, device, directory, a header over ``max_header_bytes`` or one that does not
        describe the file exactly is ``CheckpointFormatError``. ``handle`` is borrowed (else one
        is made from ``config`` or ``DEFAULT_IO`` and closed with the reader)."""
        from ._api import DEFAULT_IO

        path = os.fspath(path)
        try:  # follows a symlink the caller named, never blocks on a FIFO or reads a device
            fd = _fs.open_regular(path, follow=True)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no safetensors file at {path}") from None
        owned = handle is None
        h = handle if handle is not None else AsyncIOHandle(config or DEFAULT_IO)
        f: AsyncFile | None = None
        try:
            f = h.open(f"/proc/self/fd/{fd}", "r")
            header = await read_header(f, path, f.size, max_header_bytes)
            return cls(path, fd, f, header, h, owned)
        except BaseException:
            if f is not None:
                f.close()
            os.close(fd)
            if owned:
                await h.aclose()
            raise

    def entry(self, name: str) -> TensorInfo:
        """The `TensorInfo` of ``name``; ``TensorNotFoundError`` when the file lacks it."""
        info = self.tensors.get(name)
        if info is None:
            raise TensorNotFoundError(self.path, [name])
        return info

    def _check(self, slices: list[TensorSlice], convert: bool) -> None:
        missing = sorted({s.name for s in slices if s.name not in self._entries})
        if missing:
            raise TensorNotFoundError(self.path, missing)
        for s in slices:
            e = self._entries[s.name]
            if not isinstance(s.out, torch.Tensor) or not s.out.is_contiguous() or s.out.is_sparse:
                raise TensorLayoutError(f"the destination of {s.name!r} must be a contiguous dense tensor")
            numel = math.prod(e.shape)
            if s.start < 0 or s.stop > numel:
                raise SliceRangeError(self.path, s.name, s.start, s.stop, numel)
            if s.out.dtype != e.dtype and not convert:
                raise CheckpointMismatchError(
                    f"{self.path}: tensor {s.name!r} is {e.dtype}, the destination {s.out.dtype} "
                    "(pass convert=True to convert while reading)"
                )

    async def read(self, slices: Iterable[TensorSlice], *, convert: bool = False, verify: bool = True) -> int:
        """Fill every slice's ``out``; return the bytes read from the file.

        Every request is checked before any byte is read: a name the file lacks is
        ``TensorNotFoundError`` (naming all of them), a range past a tensor's end
        ``SliceRangeError``, another dtype without ``convert`` ``CheckpointMismatchError``, a
        non-contiguous destination ``TensorLayoutError``. ``verify`` checks every block a slice
        touches against the file's block checksums (``ChecksumError``; see the module's text); a
        CUDA destination is then filled through a bounded host buffer, checked there first.
        """
        if self._fd is None:
            raise ClosedError(f"slice reader of {self.path} is closed")
        todo = list(slices)
        self._check(todo, convert)
        gate = asyncio.Semaphore(CONVERT_PARALLEL)
        # every slice reads to its end, past a failure or this call's cancellation: none is left
        # writing into a destination when this raises (the first failure, in request order)
        return sum(await wait_all([self._one(s, gate, verify) for s in todo if s.out.numel()], drain=True))

    async def _one(self, s: TensorSlice, gate: asyncio.Semaphore, verify: bool) -> int:
        e = self._entries[s.name]
        esize = torch.empty(0, dtype=e.dtype).element_size()
        at = s.start * esize  # the slice's first byte within the tensor
        offset = self._header.data_start + e.begin + at
        nbytes = s.out.numel() * esize
        blocks = self._blocks.get(s.name) if verify else None
        if blocks is not None:  # every block the slice touches is read whole and checked
            checked = CheckedBlocks(s.name, self.path, e.nbytes, blocks, self._block_bytes)

            async def raw(off: int, dest: torch.Tensor) -> None:
                await self._file.pread(dest, self._header.data_start + e.begin + off)

            if s.out.dtype == e.dtype and not s.out.is_cuda:
                await checked.read(raw, at, s.out.view(-1).view(torch.uint8))
                return nbytes
            return await self._staged(s, gate, esize, lambda off, dest: checked.read(raw, at + off, dest))
        whole = s.start == 0 and nbytes == e.nbytes
        want = self._sums[s.name] if verify and whole and self._sums is not None else None
        if s.out.dtype == e.dtype and (want is None or not s.out.is_cuda):
            await self._file.pread(s.out, offset)
            if want is not None:
                self._verify(s.name, crc_of(s.out.data_ptr(), nbytes), want)
            return nbytes
        crc = 0

        async def summed(off: int, dest: torch.Tensor) -> None:
            nonlocal crc
            await self._file.pread(dest, offset + off)
            if want is not None:  # the chunks come in order: one running crc32c
                crc = crc_extend(crc, crc_of(dest.data_ptr(), dest.numel()), dest.numel())

        await self._staged(s, gate, esize, summed)
        if want is not None:
            self._verify(s.name, crc, want)
        return nbytes

    async def _staged(self, s: TensorSlice, gate: asyncio.Semaphore, esize: int, read: ReadBytes) -> int:
        """Fill ``s.out`` (another dtype, or a CUDA tensor whose bytes are checked on the CPU first)
        through one bounded staging buffer, in order: ``read(byte offset within the slice, dest)``
        fills each chunk, then it is copied (converted) into place."""
        e = self._entries[s.name]
        flat = s.out.view(-1)
        per = max(1, CONVERT_CHUNK_BYTES // esize)
        async with gate:
            stage = torch.empty(min(per, flat.numel()), dtype=e.dtype)
            for i in range(0, flat.numel(), per):
                k = min(per, flat.numel() - i)
                await read(i * esize, stage[:k].view(torch.uint8))
                flat[i : i + k].copy_(stage[:k])
        return flat.numel() * esize

    def _verify(self, name: str, got: int, want: int) -> None:
        if got != want:
            raise ChecksumError(
                f"tensor {name!r} in {self.path}: crc32c {got:08x} does not match the recorded "
                f"{want:08x} (corrupted file)"
            )

    async def aclose(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._file.close()
        os.close(fd)
        if self._owned:
            await self._handle.aclose()

    async def __aenter__(self) -> SliceReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def read_slices(
    path: str | os.PathLike[str],
    slices: Iterable[TensorSlice],
    *,
    convert: bool = False,
    verify: bool = True,
    handle: AsyncIOHandle | None = None,
    config: IOConfig | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> int:
    """Open ``path``, fill ``slices`` (see `SliceReader.read`), close it; return the bytes read."""
    async with await SliceReader.open(
        path, handle=handle, config=config, max_header_bytes=max_header_bytes
    ) as r:
        return await r.read(slices, convert=convert, verify=verify)
