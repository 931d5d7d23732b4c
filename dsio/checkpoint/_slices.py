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
``dsio.checkpoint.load`` validates it (dtype, shape, offsets that tile the data section). dsio's
files record a crc32c per tensor; a slice that covers a whole tensor is checked against it
(``verify``); a partial slice cannot be, and is not.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

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
from ._format import MAX_HEADER_BYTES, Header
from ._integrity import crc_extend, crc_of, parse_checksums
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
        non-contiguous destination ``TensorLayoutError``. ``verify`` checks slices covering a
        whole tensor of a dsio file against its crc32c (``ChecksumError``); CUDA destinations
        of the file's dtype are not checked.
        """
        if self._fd is None:
            raise ClosedError(f"slice reader of {self.path} is closed")
        todo = list(slices)
        self._check(todo, convert)
        gate = asyncio.Semaphore(CONVERT_PARALLEL)
        tasks = [asyncio.ensure_future(self._one(s, gate, verify)) for s in todo if s.out.numel()]
        if tasks:
            await asyncio.wait(tasks)  # none left writing into a destination when this raises
            for t in tasks:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        return sum(t.result() for t in tasks)

    async def _one(self, s: TensorSlice, gate: asyncio.Semaphore, verify: bool) -> int:
        e = self._entries[s.name]
        esize = torch.empty(0, dtype=e.dtype).element_size()
        offset = self._header.data_start + e.begin + s.start * esize
        nbytes = s.out.numel() * esize
        whole = s.start == 0 and nbytes == e.nbytes
        want = self._sums[s.name] if verify and whole and self._sums is not None else None
        if s.out.dtype == e.dtype:
            await self._file.pread(s.out, offset)
            if want is not None and not s.out.is_cuda:
                self._verify(s.name, crc_of(s.out.data_ptr(), nbytes), want)
            return nbytes
        # Another dtype: through one bounded staging buffer, converted chunk by chunk.
        flat = s.out.view(-1)
        per = max(1, CONVERT_CHUNK_BYTES // esize)
        crc = 0
        async with gate:
            stage = torch.empty(min(per, flat.numel()), dtype=e.dtype)
            for i in range(0, flat.numel(), per):
                k = min(per, flat.numel() - i)
                await self._file.pread(stage[:k], offset + i * esize)
                if want is not None:
                    crc = crc_extend(crc, crc_of(stage.data_ptr(), k * esize), k * esize)
                flat[i : i + k].copy_(stage[:k])
        if want is not None:
            self._verify(s.name, crc, want)
        return nbytes

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
