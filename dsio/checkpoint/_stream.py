"""Writing a file's data section through a few fixed-size buffers (for states holding `LazyTensor`s).

    data section = [ tensor 0 | tensor 1 | ... ]  cut into windows of ``chunk_bytes`` (page-aligned)

Each window is filled in file order (lazy tensors read their bytes into it, in-memory tensors are
copied into it), checksummed, and written with one O_DIRECT request; at most ``buffers`` windows
exist, so the memory a save uses is ``buffers x chunk_bytes`` whatever the state's size. Each
window's pieces are checksummed block by block (`piece_sums`); a tensor's crc32c and its blocks'
are joined from them once every window is in (`TensorSums`), in whatever order they were filled.

One exception, for async saves whose owner goes on training: a window holding only bytes of
in-memory tensors that training can change (a master held in RAM beside swapped Adam state) may get
a buffer of its own beyond the ``buffers``, up to ``capture_bytes`` of such extra windows, so those
bytes are copied at memory speed instead of waiting for the disk to write the windows before them:
the owner waits on them (`Capture`) before it changes them. That memory is at most the in-memory
state's own size, what a save of a state without lazy sources stages anyway; lazy sources (swap
files, a master in its file) always stream through the ``buffers`` windows.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .._gather import started, wait_all
from .._memory import aligned_buffer, memcpy
from ._capture import Capture, TouchOrder, plan_windows
from ._format import TensorEntry
from ._integrity import TensorSums, piece_sums
from ._lazy import LazyTensor

if TYPE_CHECKING:
    from ..file import AsyncFile
    from ..handle import AsyncIOHandle

__all__ = ["STREAM_BUFFERS", "STREAM_CHUNK_BYTES", "write_streamed"]

#: ``capture_bytes`` default: every window of in-memory bytes training can change gets a buffer.
CAPTURE_ALL = -1

#: Bytes per window (a multiple of 4096, so every window but the last is one aligned write).
STREAM_CHUNK_BYTES = 8 << 20
#: Windows in flight: one being filled while the others are written.
STREAM_BUFFERS = 3


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
    touch_order: TouchOrder | None = None,
    capture: Capture | None = None,
    capture_bytes: int = CAPTURE_ALL,
    counters: dict[str, int] | None = None,
    sums: Mapping[str, TensorSums] | None = None,
) -> dict[str, TensorSums]:
    """Write ``[data_start, file_size)`` of ``f`` from ``sources``; return each entry's checksums
    (``sums``, filled, where given).

    Windows are filled in file order, or, with a ``touch_order``, in the order its touch sets need
    them (`dsio.checkpoint._capture`; each piece is checksummed alone, the pieces joined at the
    end); ``capture`` (one future per touch set) is resolved as the windows holding each set's
    bytes are filled. Lazy reads of a few windows run concurrently;
    copies and checksums run in window order on ``executor`` (one thread, kept between saves: no
    thread is started or joined on the event loop). Returns once every window is written (not
    fsynced). On failure, waits for the work in flight and raises the first error.

    ``capture_bytes``: extra window memory (beyond ``buffers``) for windows holding only bytes of
    in-memory, non-stable tensors, so an async save captures them without waiting for the disk
    (`CAPTURE_ALL`: as much as they need; 0: none). ``counters``, if given, receives
    ``window_bytes`` (the most window memory allocated at once) and ``extra_windows``.
    """
    if chunk_bytes <= 0 or chunk_bytes % 4096:
        raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
    crcs = dict(sums) if sums is not None else {e.name: TensorSums(e.nbytes) for e in entries}
    data_bytes = max(0, file_size - data_start)
    plan = plan_windows(entries, sources, chunk_bytes, data_bytes, touch_order)
    if capture is not None:
        for i, left in enumerate(plan.remaining):
            if left == 0:  # nothing of the state overlaps this set
                capture.resolve(i)
    if data_bytes == 0:
        return crcs
    n_buf = max(1, min(buffers, len(plan.order)))
    mems = [aligned_buffer(chunk_bytes) for _ in range(n_buf)]
    free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
    for m in mems:
        free.put_nowait(torch.frombuffer(m, dtype=torch.uint8))
    lazy_windows: set[int] = set()
    for e in entries:
        if e.nbytes and isinstance(sources[e.name], LazyTensor):
            lazy_windows.update(range(e.begin // chunk_bytes, (e.end - 1) // chunk_bytes + 1))
    extra_left = len(plan.order) * chunk_bytes if capture_bytes == CAPTURE_ALL else capture_bytes
    if capture is None:
        extra_left = 0  # nobody waits on the capture: the windows can wait for the disk

    def next_buffer(w: int) -> torch.Tensor | None:
        """A new buffer for window ``w`` if it holds in-memory volatile bytes only and the extra
        budget allows; else None (wait for a free one)."""
        nonlocal extra_left
        if not free.empty() or extra_left < chunk_bytes:
            return None
        if not plan.volatile[w] or w in lazy_windows:
            return None
        extra_left -= chunk_bytes
        m = aligned_buffer(chunk_bytes, lock=False)  # unlocked: O_DIRECT needs alignment only
        mems.append(m)
        return torch.frombuffer(m, dtype=torch.uint8)

    # in-memory tensors: contiguous, once (a no-op for the usual contiguous CPU tensor)
    eager: dict[str, torch.Tensor] = {
        n: t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().reshape(-1)
        for n, t in sources.items()
        if isinstance(t, torch.Tensor)
    }
    starts = [e.begin for e in entries]
    # Windows of stable bytes only (pinned versions nobody changes) start reading once every volatile
    # window is filled: the bytes training waits for go first, and a stable read never races them
    # for the disk. Volatile windows precede stable ones in the plan, so they already hold buffers.
    volatile_filled = asyncio.Event()
    if plan.volatile_left == 0:
        volatile_filled.set()
    loop = asyncio.get_running_loop()

    def pieces_of(w: int) -> list[tuple[TensorEntry, int, int]]:
        """(entry, byte offset in the tensor, bytes) of window ``w``, in file order."""
        pos, end = w * chunk_bytes, min((w + 1) * chunk_bytes, data_bytes)
        out = []
        for e in entries[max(0, bisect.bisect_right(starts, pos) - 1) :]:
            lo, hi = max(e.begin, pos), min(e.end, end)
            if e.begin >= end:
                break
            if hi > lo:
                out.append((e, lo - e.begin, hi - lo))
        return out

    def fill(buf: torch.Tensor, pieces: list[tuple[TensorEntry, int, int]]) -> None:
        base, at = buf.data_ptr(), 0
        for e, off, n in pieces:
            t = eager.get(e.name)
            if t is not None:
                if t.device.type == "cpu":
                    memcpy(base + at, t.data_ptr() + off, n)
                else:  # e.g. CUDA: torch copies it over (windows cut at element boundaries)
                    size = t.element_size()
                    buf[at : at + n].view(t.dtype).copy_(t[off // size : (off + n) // size])
            crcs[e.name].add(piece_sums(base + at, off, n))
            at += n

    async def window(
        w: int, buf: torch.Tensor, turn: asyncio.Future[None], mine: asyncio.Future[None]
    ) -> None:
        try:
            pieces = pieces_of(w)
            if not plan.volatile[w]:
                await volatile_filled.wait()
            reads, at = [], 0
            for e, off, n in pieces:  # lazy bytes: read concurrently into their places
                src = sources[e.name]
                if isinstance(src, LazyTensor):
                    reads.append(src.read_into(io, off, buf[at : at + n]))
                at += n
            if reads:
                await wait_all([asyncio.ensure_future(r) for r in reads])
            await turn  # copies and checksums run in plan order, one window at a time
            filled = loop.run_in_executor(executor, fill, buf, pieces)
            mine.set_result(None)
            await filled
            plan.filled(w, capture)
            if plan.volatile_left == 0:
                volatile_filled.set()
            pos = data_start + w * chunk_bytes
            await f.pwrite(buf[: min(chunk_bytes, file_size - pos)], pos)
        except BaseException:
            if plan.volatile[w]:
                volatile_filled.set()  # the stable windows must not wait for a window that failed
            raise
        finally:
            if not mine.done():
                mine.set_exception(_Skipped())
                mine.exception()
            free.put_nowait(buf)

    turn: asyncio.Future[None] = loop.create_future()
    turn.set_result(None)
    # A failed window stops the windows from starting; those started all end before this returns
    # or raises (they read into and write from the window buffers), then the first error in order.
    async with started() as work:
        for w in plan.order:
            got = next_buffer(w)
            buf = got if got is not None else await free.get()
            if work.failed:
                free.put_nowait(buf)
                break  # a window failed: stop here, report it below
            mine: asyncio.Future[None] = loop.create_future()
            work.start(window(w, buf, turn, mine))
            turn = mine
        if counters is not None:
            counters["window_bytes"] = len(mems) * chunk_bytes
            counters["extra_windows"] = len(mems) - n_buf
    for e in entries:  # a bug, never user input: every byte of every tensor is checksummed exactly once
        crcs[e.name].finish()
    return crcs


class _Skipped(Exception):
    """An earlier window failed before this one's copy was queued (never leaves this module)."""
