"""Writing a file's data section through a few fixed-size buffers (for states holding `LazyTensor`s).

    data section = [ tensor 0 | tensor 1 | ... ]  cut into windows of ``chunk_bytes`` (page-aligned)

Each window is filled in file order (lazy tensors read their bytes into it, in-memory tensors are
copied into it), checksummed, and written with one O_DIRECT request; at most ``buffers`` windows
exist, so the memory a save uses is ``buffers x chunk_bytes`` whatever the state's size. The
checksums of a tensor spanning windows are continued window by window (crc32c is incremental).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import crc32c
import torch

from .._native import C as _C
from ._format import TensorEntry
from ._lazy import LazyTensor

if TYPE_CHECKING:
    from ..file import AsyncFile
    from ..handle import AsyncIOHandle

__all__ = ["STREAM_BUFFERS", "STREAM_CHUNK_BYTES", "write_streamed"]

#: Bytes per window (a multiple of 4096, so every window but the last is one aligned write).
STREAM_CHUNK_BYTES = 8 << 20
#: Windows in flight: one being filled while the others are written.
STREAM_BUFFERS = 3


def _crc_more(ptr: int, nbytes: int, value: int) -> int:
    if nbytes == 0:
        return value
    view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
    return int(crc32c.crc32c(view, value))


def _give_back(free: asyncio.Queue[torch.Tensor], buf: torch.Tensor, _done: object) -> None:
    free.put_nowait(buf)


async def write_streamed(
    io: AsyncIOHandle,
    f: AsyncFile,
    entries: Sequence[TensorEntry],
    sources: Mapping[str, torch.Tensor | LazyTensor],
    data_start: int,
    file_size: int,
    *,
    executor: concurrent.futures.Executor,
    chunk_bytes: int = STREAM_CHUNK_BYTES,
    buffers: int = STREAM_BUFFERS,
) -> dict[str, int]:
    """Write ``[data_start, file_size)`` of ``f`` from ``sources``; return each entry's crc32c.

    Copies and checksums run on ``executor`` (a persistent pool: no thread is started or joined
    on the event loop). Returns once every window is written (not fsynced). On failure, waits for
    the writes in flight and raises the first error.
    """
    if chunk_bytes <= 0 or chunk_bytes % 4096:
        raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
    crcs = {e.name: 0 for e in entries}
    if file_size <= data_start:
        return crcs
    n_buf = max(1, min(buffers, -(-(file_size - data_start) // chunk_bytes)))
    mems = [_C.AlignedBuffer(chunk_bytes, True) for _ in range(n_buf)]
    free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
    for m in mems:
        free.put_nowait(torch.frombuffer(m, dtype=torch.uint8))
    # in-memory tensors: contiguous, once (a no-op for the usual contiguous CPU tensor)
    eager: dict[str, torch.Tensor] = {
        n: t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().reshape(-1)
        for n, t in sources.items()
        if isinstance(t, torch.Tensor)
    }
    writes: list[asyncio.Future[int]] = []
    loop = asyncio.get_running_loop()
    first = 0
    try:
        pos = data_start
        while pos < file_size:
            end = min(pos + chunk_bytes, file_size)
            buf = await free.get()
            while first < len(entries) and data_start + entries[first].end <= pos:
                first += 1
            pieces: list[tuple[TensorEntry, int, int]] = []  # (entry, byte offset in tensor, bytes)
            for e in entries[first:]:
                lo, hi = max(data_start + e.begin, pos), min(data_start + e.end, end)
                if lo >= end:
                    break
                if hi > lo:
                    pieces.append((e, lo - data_start - e.begin, hi - lo))
            # lazy bytes: read concurrently into their places in the window
            reads = []
            at = 0
            for e, off, n in pieces:
                src = sources[e.name]
                if isinstance(src, LazyTensor):
                    reads.append(src.read_into(io, off, buf[at : at + n]))
                at += n
            if reads:
                await asyncio.gather(*reads)

            def fill(buf: torch.Tensor = buf, pieces: list[tuple[TensorEntry, int, int]] = pieces) -> None:
                base, at = buf.data_ptr(), 0
                for e, off, n in pieces:
                    t = eager.get(e.name)
                    if t is not None:
                        if t.device.type == "cpu":
                            _C.memcpy(base + at, t.data_ptr() + off, n)
                        else:  # e.g. CUDA: torch copies it over (windows cut at element boundaries)
                            size = t.element_size()
                            buf[at : at + n].view(t.dtype).copy_(t[off // size : (off + n) // size])
                    crcs[e.name] = _crc_more(base + at, n, crcs[e.name])
                    at += n

            await loop.run_in_executor(executor, fill)
            w = asyncio.ensure_future(f.pwrite(buf[: end - pos], pos))
            w.add_done_callback(functools.partial(_give_back, free, buf))
            writes.append(w)
            pos = end
    finally:
        if writes:
            await asyncio.wait(writes)
        errors = [w.exception() for w in writes if not w.cancelled()]  # retrieves every one
    err = next((e for e in errors if e is not None), None)
    if err is not None:
        raise err
    return crcs
