"""Reading one safetensors file (dsio's or anyone's) into fresh tensors, verifying checksums.

Large tensors each get their own allocation, placed so that the tensor's address has the same
offset within a 4096-byte page as its bytes in the file: then all but the first and last partial
page go O_DIRECT straight into the tensor, with no staging copy, even though tensors are packed
back to back in the file. Small tensors are read in runs and copied out. Reads are all submitted
at once; each tensor's crc32c runs on a worker thread as soon as its read completes, so
verification overlaps the disk; a big tensor is read in pieces, each checksummed as it lands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os

import torch

from .._gather import wait_all
from ..errors import ChecksumError
from ..file import AsyncFile
from ..handle import AsyncIOHandle
from ._format import MAX_HEADER_BYTES, Header, TensorEntry, parse_header, parse_header_length
from ._integrity import crc_extend, crc_of, parse_blocks, parse_checksums
from ._stored import StoredFile, StoredTensor

__all__ = ["placed", "read_file", "read_header"]

_ALIGN = 4096
#: Tensors at least this big are read straight into their own memory; smaller ones in runs.
BIG_BYTES = 1 << 20
#: Largest run of small tensors read as one request.
RUN_BYTES = 16 << 20
_FIRST_READ = 64 << 10
#: A verified tensor larger than this is read (and checksummed) in pieces of this size.
VERIFY_PIECE = 16 << 20


async def read_header(f: AsyncFile, path: str, size: int, limit: int = MAX_HEADER_BYTES) -> Header:
    """The validated header of the open file ``f`` of ``size`` bytes; a header over ``limit``
    bytes is refused before it is read."""
    first = torch.empty(min(size, _FIRST_READ), dtype=torch.uint8)
    if first.numel():
        await f.pread(first, 0)
    n = parse_header_length(first.numpy().tobytes()[:8], size, path, limit)
    if 8 + n <= first.numel():
        raw = first[8 : 8 + n].numpy().tobytes()
    else:
        rest = torch.empty(n, dtype=torch.uint8)
        await f.pread(rest, 8)
        raw = rest.numpy().tobytes()
    return parse_header(raw, size, path)


def placed(nbytes: int, file_offset: int) -> torch.Tensor:
    """``nbytes`` of fresh memory whose address is congruent to ``file_offset`` modulo 4096."""
    base = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    s = (file_offset - base.data_ptr()) % _ALIGN
    return base[s : s + nbytes]


def _enclosed(begin: int, end: int, file_size: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Fresh memory for file bytes ``[begin, end)``, read as the whole pages around them.

    Returns ``(io, io_offset, data)``: ``io`` is page-aligned memory for the page-aligned file
    range ``[io_offset, ...)`` (clipped at the end of the file) and ``data`` the view of
    ``[begin, end)`` inside it. Reading ``io`` is one O_DIRECT request with no partial pages
    going through the page cache; neighbouring tensors simply both read their shared page.
    """
    lo = begin & ~(_ALIGN - 1)
    hi = min(-(-end // _ALIGN) * _ALIGN, file_size)
    base = torch.empty(hi - lo + _ALIGN, dtype=torch.uint8)
    s = (-base.data_ptr()) % _ALIGN
    io = base[s : s + hi - lo]
    return io, lo, io[begin - lo : end - lo]


def _typed(raw: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    esize = torch.empty(0, dtype=e.dtype).element_size()
    if raw.data_ptr() % esize:  # a file whose tensors are not aligned to their element size
        raw = raw.clone()
    return raw.view(e.dtype).view(e.shape)


def _runs(entries: tuple[TensorEntry, ...]) -> list[list[TensorEntry]]:
    """Group the file's tensors: each big one alone, consecutive small ones in runs."""
    runs: list[list[TensorEntry]] = []
    cur: list[TensorEntry] = []
    for e in entries:
        if e.nbytes >= BIG_BYTES:
            if cur:
                runs.append(cur)
                cur = []
            runs.append([e])
            continue
        if cur and e.end - cur[0].begin > RUN_BYTES:
            runs.append(cur)
            cur = []
        cur.append(e)
    if cur:
        runs.append(cur)
    return runs


async def read_file(
    handle: AsyncIOHandle,
    path: str,
    *,
    verify: bool = True,
    fd: int | None = None,
    lazy_from: int | None = None,
    stored: StoredFile | None = None,
) -> tuple[Header, dict[str, torch.Tensor | StoredTensor]]:
    """All tensors of ``path`` (in file order) and its header. ``verify`` checks crc32c where recorded.

    ``fd``, when given, is the already opened and checked file (``_fs.open_regular``) that
    ``path`` names: it is reopened through ``/proc/self/fd`` (the same inode, whatever ``path``
    names by now, and with O_DIRECT where the handle uses it); ``path`` is only used in errors.

    ``lazy_from`` (with ``stored``, the open file): tensors of at least that many bytes are not
    read but returned as `StoredTensor`s over ``stored`` (checked as their consumer reads them).
    """
    path = os.fspath(path)
    loop = asyncio.get_running_loop()
    async with handle.open(path if fd is None else f"/proc/self/fd/{fd}", "r") as f:
        size = f.size
        header = await read_header(f, path, size)
        ds = header.data_start
        sums = parse_checksums(header.metadata, [e.name for e in header.entries], path) if verify else None
        block_bytes, blocks = parse_blocks(
            header.metadata, {e.name: e.nbytes for e in header.entries}, sums, path
        )
        out: dict[str, torch.Tensor | StoredTensor] = {}
        checks: list[asyncio.Future[None]] = []
        ex = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dsio-ckpt-crc") if sums else None

        def verify_run(raw: torch.Tensor, run: list[TensorEntry]) -> None:
            assert sums is not None
            base = raw.data_ptr() - run[0].begin
            for e in run:
                got = crc_of(base + e.begin, e.nbytes)
                if got != sums[e.name]:
                    raise ChecksumError(
                        f"tensor {e.name!r} in {path}: crc32c {got:08x} does not match the recorded "
                        f"{sums[e.name]:08x} (corrupted file)"
                    )

        async def read_verified(io: torch.Tensor, io_off: int, e: TensorEntry) -> None:
            """A big tensor read in pieces, each checksummed as soon as it lands (the checksums
            keep pace with the disk instead of starting once the whole tensor is in), joined."""
            assert sums is not None and ex is not None
            at = ds + e.begin - io_off  # the tensor's first byte in ``io``

            async def piece(a: int, b: int) -> tuple[int, int]:
                await f.pread(io[a:b], io_off + a)
                lo, hi = max(a, at), min(b, at + e.nbytes)
                return await loop.run_in_executor(ex, crc_of, io.data_ptr() + lo, hi - lo), hi - lo

            n = io.numel()
            parts = [
                asyncio.ensure_future(piece(a, min(a + VERIFY_PIECE, n))) for a in range(0, n, VERIFY_PIECE)
            ]
            await wait_all(parts, drain=True)
            got = 0
            for part in parts:
                got = crc_extend(got, *part.result())
            if got != sums[e.name]:
                raise ChecksumError(
                    f"tensor {e.name!r} in {path}: crc32c {got:08x} does not match the recorded "
                    f"{sums[e.name]:08x} (corrupted file)"
                )

        async def read_run(run: list[TensorEntry]) -> None:
            begin, end = run[0].begin, run[-1].end
            io, io_off, raw = _enclosed(ds + begin, ds + end, size)
            if ex is not None and len(run) == 1 and run[0].nbytes > VERIFY_PIECE:
                await read_verified(io, io_off, run[0])
            elif end > begin:
                await f.pread(io, io_off)
            if ex is not None and not (len(run) == 1 and run[0].nbytes > VERIFY_PIECE):
                checks.append(loop.run_in_executor(ex, verify_run, raw, run))
            if len(run) == 1 and run[0].nbytes >= BIG_BYTES:
                out[run[0].name] = _typed(raw, run[0])
            else:
                for e in run:
                    piece = raw[e.begin - begin : e.end - begin]
                    out[e.name] = (
                        _typed(piece.clone(), e) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)
                    )

        left = tuple(header.entries)
        if lazy_from is not None:
            if stored is None:
                raise ValueError("lazy_from needs the open file (stored)")
            left = tuple(e for e in header.entries if e.nbytes < lazy_from)
            for e in header.entries:
                if e.nbytes >= lazy_from:
                    out[e.name] = StoredTensor(
                        stored,
                        ds + e.begin,
                        e.dtype,
                        e.shape,
                        name=e.name,
                        crc32c=None if sums is None else sums[e.name],
                        io=handle,
                        blocks=blocks.get(e.name),
                        block_bytes=block_bytes,
                    )
        try:
            await wait_all([read_run(r) for r in _runs(left)], drain=True)
            await wait_all(checks, drain=True)
        finally:
            with contextlib.suppress(Exception):  # after a failure: the checks still running end too
                await wait_all(checks, drain=True)
            if ex is not None:
                ex.shutdown(wait=True)
    return header, {e.name: out[e.name] for e in header.entries}
