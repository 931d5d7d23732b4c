"""Writing one checkpoint file: stage tensors into an aligned region laid out exactly as the file,
then move it to disk with a few large O_DIRECT writes.

    region = [ header (data_start bytes, multiple of 4096) | tensor 0 | tensor 1 | ... ]   == the file

``FileWriter.stage()`` copies the tensors in (this is the only part that reads the caller's
tensors) and submits each ~16 MiB of staged bytes as soon as it is ready, so the copy overlaps
the disk; each copier thread checksums the segment it just copied (crc32c, hardware path, GIL
released), block by block (`dsio.checkpoint._integrity.piece_sums`: each tensor's crc32c and,
for a big one, its 1 MiB blocks', which let a reader check a slice). ``finish()`` writes the header (its length
was fixed before the checksums were known: they are fixed-width hex), fsyncs and closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._gather import wait_all
from .._memory import aligned_buffer  # the core loads on first use, not at import
from ..errors import IOFailedError
from ..file import AsyncFile
from ..handle import AsyncIOHandle
from . import _stream
from ._capture import Capture, TouchOrder
from ._format import TensorEntry, encode_header, layout
from ._integrity import (
    ALGORITHM,
    BLOCK_BYTES,
    BLOCK_BYTES_KEY,
    BLOCKS_KEY,
    CHECKSUMS_KEY,
    TensorSums,
    copy_crc,
    hex32,
    piece_sums,
)
from ._lazy import LazyTensor
from ._stream import STREAM_BUFFERS, write_streamed

__all__ = ["CHUNK_BYTES", "FileWriter", "Staging"]

#: Staged bytes submitted per write while staging continues (small: the disk starts ~3 ms after the copy).
CHUNK_BYTES = 16 << 20
#: Largest single memcpy of the staging copy (so that worker threads share big tensors).
SEGMENT_BYTES = 8 << 20
_ALIGN = 4096
_T = TypeVar("_T")


class Staging:
    """A reusable page-aligned, locked host region (grown when a state no longer fits)."""

    def __init__(self) -> None:
        self._mem: Any = None  # an aligned, locked buffer (dsio._memory)
        self._view: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._mem is None else int(self._mem.nbytes)

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of the region, reallocating only when it is too small."""
        if self._mem is None or self._mem.nbytes < nbytes:
            self.release()
            size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            self._mem = aligned_buffer(size)
            self._view = torch.frombuffer(self._mem, dtype=torch.uint8)
        assert self._view is not None
        return self._view[:nbytes]

    def release(self) -> None:
        # Views handed out keep the memory alive (frombuffer holds a reference) until they die.
        self._mem = None
        self._view = None


_POOLS: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's ``name`` pool of ``threads`` workers, kept between saves: a fresh
    ThreadPoolExecutor per save started and joined its threads on the event-loop thread, the
    loop's longest stall of a background save (milliseconds; more under load)."""
    with _POOLS_LOCK:
        pool = _POOLS.get((name, threads))
        if pool is None:
            pool = _POOLS[name, threads] = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix=name
            )
        return pool


async def _off_loop(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` (checksums, reserving a file's blocks) on the one-thread ``dsio-ckpt-io`` pool.
    Cancelled, it still waits for ``fn`` to end (a thread cannot be interrupted), so the caller's
    clean-up never races it."""
    fut = asyncio.get_running_loop().run_in_executor(_pool("dsio-ckpt-io", 1), fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller sees
        raise


def _preallocate(path: str, size: int) -> None:
    """Create or replace ``path`` and reserve ``size`` bytes: a full disk fails here, before any write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    return
                raise IOFailedError(e.errno or errno.EIO, path, 0, f"reserving {size} bytes") from None
    finally:
        os.close(fd)


Pieces = list[tuple[int, int, int]]
"""`piece_sums`: (offset in the tensor, crc32c, bytes) cut at the tensor's checksum blocks."""


def _copy_and_crc(dst: int, src: int, nbytes: int, offset: int = 0) -> Pieces:
    """Copy bytes ``[offset, offset + nbytes)`` of a tensor one checksum block at a time, each block
    checksummed in the same pass as its copy (`copy_crc`: never a second read from memory; copying
    the whole segment first made the crc32c re-read it: 1.6-2.1 vs 2.1-2.6 GB/s for copy + crc32c
    on one loaded core, best of 5, 256 MiB)."""
    out = []
    pos, end = offset, offset + nbytes
    while pos < end:
        k = min(end, (pos // BLOCK_BYTES + 1) * BLOCK_BYTES) - pos
        out.append((pos, copy_crc(dst + pos - offset, src + pos - offset, k), k))
        pos += k
    return out


def _gather_and_crc(view: torch.Tensor, src: torch.Tensor, dst: int, nbytes: int) -> Pieces:
    view.copy_(src)
    return piece_sums(dst, 0, nbytes)


class FileWriter:
    """One file being written from named tensors. ``await stage()``, then ``await finish()``;
    on any failure ``await abort()`` removes the partial file."""

    def __init__(
        self,
        handle: AsyncIOHandle,
        path: str,
        tensors: dict[str, torch.Tensor | LazyTensor],
        metadata: dict[str, str],
        staging: Staging | None,
        *,
        preallocate: bool = True,
        copy_threads: int = 2,
        touch_order: TouchOrder | None = None,
        capture: Capture | None = None,
    ) -> None:
        self.handle = handle
        self.touch_order = touch_order
        """For a streamed write: fill the windows in the order these touch sets need them."""
        self.capture = capture
        """Resolved set by set as the streamed write reads them (the caller resolves the rest)."""
        self.copy_threads = copy_threads
        self.path = path
        self.tensors = tensors
        self.metadata = dict(metadata)
        self.staging = staging
        self.preallocate = preallocate
        self.entries: list[TensorEntry] = layout((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        self._sums = {e.name: TensorSums(e.nbytes) for e in self.entries}
        """Each tensor's checksums, filled by the copies (pieces in any order)."""
        placeholder = {e.name: "0" * 8 for e in self.entries}
        blocks = {
            e.name: "0" * 8 * -(-e.nbytes // BLOCK_BYTES) for e in self.entries if e.nbytes > BLOCK_BYTES
        }
        self.data_start = len(encode_header(self.entries, self._meta_for(placeholder, blocks)))
        self.file_size = self.data_start + (self.entries[-1].end if self.entries else 0)
        self._region: torch.Tensor | None = None
        self._file: AsyncFile | None = None
        self._writes: list[asyncio.Future[int]] = []
        self._flushed = 0
        self.stage_seconds = 0.0
        self.write_seconds = 0.0
        self.streamed = any(isinstance(t, LazyTensor) for t in tensors.values())
        """The state holds lazy sources: written through fixed windows, never staged whole."""
        self.buffer_bytes = 0
        """Host memory the streamed write used for its windows (0 for a staged write)."""
        self._summed = False

    def _meta_for(self, sums: dict[str, str], blocks: dict[str, str]) -> dict[str, str]:
        """The metadata with the checksum tables (fixed width: placeholders give the same length)."""
        meta = {**self.metadata, CHECKSUMS_KEY: json.dumps(sums, separators=(",", ":"))}
        if blocks:
            meta[BLOCKS_KEY] = json.dumps(blocks, separators=(",", ":"))
            meta[BLOCK_BYTES_KEY] = str(BLOCK_BYTES)
        return meta

    def _header(self) -> bytes:
        """The final header, from the checksums the copies computed."""
        assert self._summed, "the header before the data was checksummed"
        sums, blocks = {}, {}
        for e in self.entries:
            whole, per_block = self._sums[e.name].finish()
            sums[e.name] = hex32(whole)
            listed = self._sums[e.name].blocks_hex(per_block)
            if listed is not None:
                blocks[e.name] = listed
        header = encode_header(self.entries, self._meta_for(sums, blocks))
        assert len(header) == self.data_start, "header length changed with its checksums"
        return header

    @property
    def checksum_algorithm(self) -> str:
        return ALGORITHM

    def _submit(self, start: int, end: int) -> None:
        assert self._file is not None and self._region is not None
        if end > start:
            self._writes.append(asyncio.ensure_future(self._file.pwrite(self._region[start:end], start)))

    async def stage(self) -> None:
        """Copy every tensor into the region; writes of staged parts start as soon as they are ready.

        With ``copy_threads`` > 0 the copies run as <= 8 MiB memcpy segments on that many worker
        threads (``memcpy`` releases the GIL), in file order, while the event loop submits
        each staged ~16 MiB; with 0 they run inline on the loop's thread.
        """
        t0 = time.perf_counter()
        if self.streamed:
            if self.preallocate:  # truncating an old file and reserving blocks: a worker thread's job
                await _off_loop(functools.partial(_preallocate, self.path, self.file_size))
            await self._write_data()
            self.stage_seconds = time.perf_counter() - t0
            return
        assert self.staging is not None, "stage() needs a staging region; stream() does not"
        self._region = region = self.staging.get(self.file_size)
        ds = self.data_start
        self._flushed = ds  # the header goes last, once the checksums are known
        segments = self._segments(region)
        sums = self._sums
        if self.copy_threads > 0:
            futs = [_pool("dsio-ckpt-stage", self.copy_threads).submit(fn) for fn, *_ in segments]
            try:
                # The file's blocks are reserved while the first segments are copied (3-12 ms
                # under load, on the save's critical path when done first); no byte is written
                # to it before then, so a full disk still fails before any write.
                await self._reserve()
                for fut, (_, staged, e) in zip(futs, segments, strict=True):
                    sums[e.name].add(await asyncio.wrap_future(fut))
                    self._staged_up_to(staged)
            finally:
                for fut in futs:
                    fut.cancel()
                # On failure or cancellation no copy may still write into the region once we return.
                concurrent.futures.wait(futs)
        else:
            await self._reserve()
            for fn, staged, e in segments:
                sums[e.name].add(fn())
                if self._staged_up_to(staged):
                    await asyncio.sleep(0)  # let the write task reach the engine
        self._summed = True
        self.tensors = {}  # the caller's tensors are free from here on
        self.stage_seconds = time.perf_counter() - t0

    async def _reserve(self) -> None:
        """Create (or truncate) the file, reserving its blocks when asked, and open it for the writes."""
        if self.preallocate:  # truncating an old file and reserving blocks: a worker thread's job
            await _off_loop(functools.partial(_preallocate, self.path, self.file_size))
        self._file = self.handle.open(self.path, "w")

    async def _write_data(self) -> None:
        """Streamed: the whole data section through fixed windows; the checksums on the way."""
        self._file = self.handle.open(self.path, "w")
        chunk = _stream.STREAM_CHUNK_BYTES  # read at call time (tests shrink it)
        windows = min(STREAM_BUFFERS, max(1, -(-(self.file_size - self.data_start) // chunk)))
        self.buffer_bytes = windows * chunk if self.file_size > self.data_start else 0
        counters: dict[str, int] = {}
        try:
            await write_streamed(
                self.handle,
                self._file,
                self.entries,
                self.tensors,
                self.data_start,
                self.file_size,
                executor=_pool("dsio-ckpt-stream", 1),
                chunk_bytes=chunk,
                touch_order=self.touch_order,
                capture=self.capture,
                counters=counters,
                sums=self._sums,
            )
            self._summed = True
        finally:
            self.buffer_bytes = counters.get("window_bytes", self.buffer_bytes)
        self.tensors = {}  # the caller's tensors and sources are free from here on

    async def _finish_streamed(self, fsync: bool) -> int:
        assert self._file is not None
        t0 = time.perf_counter()
        header = self._header()
        self._writes.append(
            asyncio.ensure_future(
                self._file.pwrite(torch.frombuffer(bytearray(header), dtype=torch.uint8), 0)
            )
        )
        await self._drain()
        if fsync:
            await self._file.fsync()
        self._file.close()
        self._file = None
        self.write_seconds = time.perf_counter() - t0
        return self.file_size

    def _staged_up_to(self, staged: int) -> bool:
        """Submit the staged bytes once ~CHUNK_BYTES accumulated; True if a write was submitted."""
        if staged - self._flushed < CHUNK_BYTES:
            return False
        cut = staged & ~(_ALIGN - 1)
        self._submit(self._flushed, cut)
        self._flushed = cut
        return True

    def _segments(self, region: torch.Tensor) -> list[tuple[Callable[[], Pieces], int, TensorEntry]]:
        """(copy, file offset staged once it ran, entry) in file order; each copy returns the
        checksums of the bytes it staged (`piece_sums`), computed on the copier thread right after
        the copy (while they are in its cache), so ``finish()`` needs no second pass over the region."""
        ds = self.data_start
        base = region.data_ptr()
        out: list[tuple[Callable[[], Pieces], int, TensorEntry]] = []
        for e in self.entries:
            if not e.nbytes:
                continue
            src = self.tensors[e.name]
            assert isinstance(src, torch.Tensor)
            if src.device.type == "cpu" and src.is_contiguous():
                # Plain memcpy: torch's copy_ splits big copies over its OpenMP threads, which
                # stalls whenever another process holds one of the cores.
                sp = src.data_ptr()
                for off in range(0, e.nbytes, SEGMENT_BYTES):
                    n = min(SEGMENT_BYTES, e.nbytes - off)
                    dst = base + ds + e.begin + off
                    copy = functools.partial(_copy_and_crc, dst, sp + off, n, off)
                    out.append((copy, ds + e.begin + off + n, e))
            else:  # strided or on a GPU: let torch gather it
                view = region[ds + e.begin : ds + e.end].view(e.dtype).view(e.shape)
                dst = base + ds + e.begin
                out.append((functools.partial(_gather_and_crc, view, src, dst, e.nbytes), ds + e.end, e))
        return out

    async def stream(self, *, fsync: bool = True) -> int:
        """Write straight from the caller's tensors (no region): for a one-shot synchronous save.

        dsio stages each tensor's unaligned body through its small pinned pool, pipelined with the
        disk, so no state-sized allocation is made; the checksums are computed from the tensors
        on a worker thread meanwhile. The tensors must not change until this returns.
        """
        t0 = time.perf_counter()
        if self.preallocate:
            _preallocate(self.path, self.file_size)
        if self.streamed:
            await self._write_data()
            size = await self._finish_streamed(fsync)
            self.write_seconds = time.perf_counter() - t0
            return size
        self._file = f = self.handle.open(self.path, "w")
        ds = self.data_start
        srcs: dict[str, torch.Tensor] = {}
        for e in self.entries:
            t = self.tensors[e.name]
            assert isinstance(t, torch.Tensor)
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()
            srcs[e.name] = t
            if e.nbytes:
                self._writes.append(asyncio.ensure_future(f.pwrite(t, ds + e.begin)))
        await asyncio.sleep(0)  # let the writes reach the engine before the checksums start

        def checksums() -> None:
            for e in self.entries:
                self._sums[e.name].add(piece_sums(srcs[e.name].data_ptr(), 0, e.nbytes))
            self._summed = True

        try:
            await _off_loop(checksums)
            header = self._header()
            self._writes.append(
                asyncio.ensure_future(f.pwrite(torch.frombuffer(bytearray(header), dtype=torch.uint8), 0))
            )
        finally:
            await self._drain()
        if fsync:
            await f.fsync()
        f.close()
        self._file = None
        self.tensors = {}
        self.write_seconds = time.perf_counter() - t0
        return self.file_size

    async def finish(self, *, fsync: bool = True) -> int:
        """Write the rest and the header, fsync, close; return the file size."""
        if self.streamed:
            return await self._finish_streamed(fsync)
        assert self._file is not None and self._region is not None
        t0 = time.perf_counter()
        self._submit(self._flushed, self.file_size)
        self._flushed = self.file_size
        region = self._region
        header = self._header()  # checksums computed while staging
        region[: self.data_start].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self._submit(0, self.data_start)
        await self._drain()
        if fsync:
            await self._file.fsync()
        self._file.close()
        self._file = None
        self._region = None
        self.write_seconds = time.perf_counter() - t0
        return self.file_size

    async def _drain(self) -> None:
        writes, self._writes = self._writes, []
        # Every write to its end, then the first error in order (a write cancelled meanwhile:
        # CancelledError); cancelling us cancels them and waits for them (dsio's one join).
        await wait_all(writes)

    async def abort(self) -> None:
        """Wait out writes still in flight, close and remove the partial file."""
        writes, self._writes = self._writes, []
        with contextlib.suppress(Exception):  # their errors are retrieved: nothing logs them unhandled
            await wait_all(writes, drain=True)
        if self._file is not None:
            self._file.close()
            self._file = None
        self._region = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
