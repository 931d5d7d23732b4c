"""`Swapper`: named slots of a swap file <-> buffers of a bounded pinned pool, through ONE dsio handle.

Everything that touches the handle or the pool runs on dsio's shared loop thread
(`dsio.shared_loop`); the training thread only submits work and waits on
``concurrent.futures.Future`` results. A buffer lent by `fetch` belongs to the caller until it
hands it back with `store` (written, then returned to the pool) or `discard` (returned unwritten).

Every slot starts at a 4096-byte offset and is a whole number of 4096-byte pages, and pool buffers
are page-aligned, so each transfer is one O_DIRECT request straight from pinned memory (dsio's
staging pool is never used; it is still counted in `pinned_bytes`).

Ordering: a read of a slot waits for the write of that slot still in flight, so a read-ahead
never sees stale bytes. Pool buffers are handed out first-come first-served, so reads submitted in
the order they will be consumed cannot deadlock while every buffer lent is eventually handed back.

Copy-on-write (`pin`): a checkpoint save pins the version of every slot current at save time and
reads it while training goes on; a write of a pinned slot goes to another region of the file (a
spare, or the file grows), so the training step never waits for the save
(`dstrain.offload.swap.slots`: what it costs in disk space, when regions are reused). Ranges
(`reserve_region`) are never pinned or moved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable, Coroutine, Hashable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dsio import LoopThread, shared_loop, wait_all_futures
from dsio.config import IOConfig
from dstrain.offload.swap.rundir import RunDir
from dstrain.offload.swap.slots import SlotTable, SlotTableStatistics, SwapPin

__all__ = ["ALIGN", "Lease", "SwapPin", "Swapper", "SwapperStatistics", "align_up"]

if TYPE_CHECKING:
    from dsio.file import AsyncFile
    from dsio.handle import AsyncIOHandle

T = TypeVar("T")

ALIGN = 4096
"""Slot offsets, slot sizes and buffer sizes are multiples of this (O_DIRECT granule)."""

STAGING_BYTES = 64 << 10
"""The handle's own staging pool: unused on the aligned path, but pinned, so counted."""


def budget_buffers(pinned_budget: int, count: int, cap: int) -> tuple[int, int]:
    """(count, bytes) of the swap buffers a store derives from ``pinned_budget`` (dsio's staging pool taken
    out first): ``count`` buffers of up to ``cap`` bytes, page-aligned; two when the budget cannot give
    ``count`` buffers of 4 pages. The caller refuses a size under 2 pages with its own `ConfigError`."""
    room = pinned_budget - STAGING_BYTES
    if room < count * 4 * ALIGN:
        count = 2
    return count, min(cap, (room // count) // ALIGN * ALIGN)


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _is_range(key: Hashable) -> bool:
    return isinstance(key, tuple) and len(key) == 3 and key[0] == "range"


@dataclass(frozen=True, slots=True)
class SwapperStatistics:
    """Counters of one swapper (one kind of swapped state on one rank)."""

    kind: str
    """``"optimizer"`` or ``"param"``."""
    path: str
    """The swap file."""
    slots: int
    file_bytes: int
    buffers: int
    buffer_bytes: int
    pinned_bytes: int
    """Pinned memory this swapper allocated: its pool plus the handle's staging pool."""
    buffers_in_use: int
    peak_buffers_in_use: int
    reads: int
    read_bytes: int
    writes: int
    written_bytes: int
    read_seconds: float
    """Sum over reads of the time from submission to completion (including waiting for a buffer)."""
    write_seconds: float
    buffer_wait_seconds: float
    """Time reads spent waiting for a free pool buffer (backpressure from writes in flight)."""
    o_direct: bool
    versions: SlotTableStatistics | None = None
    """Copy-on-write versions of slots pinned by saves (`Swapper.pin`)."""


class Lease:
    """A pool buffer lent to the training thread. ``tensor`` is its uint8 view (``buffer_bytes``)."""

    __slots__ = ("_inner", "key", "tensor")

    def __init__(self, inner: object, key: Hashable, tensor: torch.Tensor) -> None:
        self._inner = inner
        self.key = key
        self.tensor = tensor

    def view(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` of the buffer (a view, no copy)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.tensor[offset : offset + nbytes].view(dtype)


class Swapper:
    """One swap file of ``kind`` under a private directory in ``directory``; ``buffer_count``
    pinned buffers of ``buffer_bytes`` each.

    Slots are reserved with `reserve` before the first transfer. All methods are called from the
    training thread; they return futures and never block, except `drain` and `close`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        kind: str,
        *,
        buffer_bytes: int,
        buffer_count: int,
        io_config: IOConfig | None = None,
        loop: LoopThread | None = None,
    ) -> None:
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes must be a positive multiple of {ALIGN}, got {buffer_bytes}")
        if buffer_count < 1:
            raise ValueError(f"buffer_count must be >= 1, got {buffer_count}")
        from dsio.pool import PinnedPool

        self.kind = kind
        self._lt = loop or shared_loop()
        # locked while this run lives; a killed run's directory goes when the next one starts
        self._run_dir = RunDir(directory, kind)
        self._dir = self._run_dir.path
        self.path = os.path.join(self._dir, f"{kind}.swp")
        cfg = io_config or IOConfig()
        self._io_config = replace(cfg, pool_bytes=STAGING_BYTES, staging_buffer_bytes=STAGING_BYTES)
        self.buffer_bytes = buffer_bytes
        # huge pages: a buffer's 2 MiB steps are physically contiguous, so its O_DIRECT pieces merge
        # into large device requests (a request holds at most max_segments pieces of memory; on
        # scattered 4 KiB pages 1 MiB pieces could not merge: bench/results/swap-pool-hugepage-ab-*)
        self._pool = PinnedPool(buffer_bytes * buffer_count, buffer_bytes, hugepage=True)
        self._buffers = self._pool.buffers
        self._table = SlotTable(self.path)
        self.copy_on_write = True
        """Saves pin slot versions (`pin`) rather than make the step wait for them (the owner
        reads this when it describes its state for a checkpoint)."""
        self._handle: AsyncIOHandle | None = None  # created on the loop thread at first use
        self._file: AsyncFile | None = None
        self._writing: dict[Hashable, tuple[asyncio.Future[None], int, int]] = {}  # key -> (done, where)
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._in_use = self._peak = 0
        self._reads = self._writes = self._read_bytes = self._written_bytes = 0
        self._read_s = self._write_s = self._wait_s = 0.0
        self._o_direct = False
        self._closed = False
        self._finalizer = self._lt.add_finalizer(self._aclose)

    # -- layout -------------------------------------------------------------------------------

    def reserve(self, key: Hashable, nbytes: int) -> int:
        """Give ``key`` a slot of ``nbytes`` (rounded up to whole pages); returns its file offset."""
        if key in self._table:
            raise KeyError(f"slot {key!r} is already reserved")
        size = align_up(max(nbytes, 1))
        if size > self.buffer_bytes:
            raise ValueError(f"slot {key!r} of {nbytes} bytes does not fit a {self.buffer_bytes}-byte buffer")
        return self._table.reserve(key, size)

    def slot_bytes(self, key: Hashable) -> int:
        return self._table.size(key)

    def region(self, key: Hashable) -> tuple[str, int, int]:
        """``(path, offset, bytes)`` where ``key``'s current version lives (it moves when a write
        goes around a pinned version)."""
        offset, size = self._table.current(key)
        return self.path, offset, size

    def reserve_region(self, nbytes: int) -> int:
        """Extend the file by a page-aligned region of ``nbytes`` (any size) for `fetch_range` /
        `store_range`; returns its offset. Regions and slots are not mixed in one swapper."""
        return self._table.reserve_region(align_up(max(nbytes, 1)))

    @property
    def _end(self) -> int:
        return self._table.end

    def pin(self, keys: Iterable[Hashable] | None = None) -> SwapPin:
        """Hold the version of ``keys`` (every slot by default) current now, with every transfer
        submitted so far counted: writes of those keys submitted from now on go to other regions
        until the pin is released. Read a pinned version at ``pin.region(key)`` after the writes
        of it still in flight (the caller's futures); release the pin when done, on every path
        (`close` releases what is left)."""
        if self._closed:
            from dsio.errors import ClosedError

            raise ClosedError(f"swapper {self.path} is closed")
        return self._table.pin(keys)

    # -- transfers (called from the training thread) -------------------------------------------

    def acquire(self, key: Hashable) -> concurrent.futures.Future[Lease]:
        """A buffer for ``key`` without reading (to fill and `store`)."""
        return self._submit(self._acquire(key, read=False))

    def fetch(self, key: Hashable) -> concurrent.futures.Future[Lease]:
        """A buffer holding ``key``'s slot as last stored (after any write of it still in flight)."""
        where = self._table.for_read(key)
        return self._submit(self._acquire(key, read=True, where=where, slot=True), where)

    def store(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Write the buffer to its slot (another region if a save pinned the slot's version), then
        return it to the pool. The lease is gone afterwards."""
        if _is_range(lease.key):
            return self._submit(self._store(lease, self._where(lease.key), slot=False))
        where = self._table.for_write(lease.key)
        return self._submit(self._store(lease, where, slot=True), where)

    def fetch_range(self, offset: int, nbytes: int) -> concurrent.futures.Future[Lease]:
        """A buffer holding the file's bytes ``[offset, offset + nbytes)`` (``offset`` page-aligned,
        ``nbytes`` rounded up to pages, at most ``buffer_bytes``), after every overlapping write
        still in flight."""
        key = ("range", offset, self._range_size(offset, nbytes))
        return self._submit(self._acquire(key, read=True, where=self._where(key), slot=False))

    def fetch_view(
        self,
        offset: int,
        nbytes: int,
        at: int,
        numel: int,
        *,
        key: Hashable | None = None,
        prepare: Callable[[torch.Tensor], None] | None = None,
    ) -> concurrent.futures.Future[tuple[Lease, torch.Tensor]]:
        """`fetch_range`, then the buffer's ``numel`` fp32 elements from byte ``at`` as a view:
        ``(lease, view)``. ``key`` (if given) becomes the lease's key (what its later `store_range`
        or hand-back names); ``prepare(view)`` runs before the result is published."""
        inner = self.fetch_range(offset, nbytes)
        out: concurrent.futures.Future[tuple[Lease, torch.Tensor]] = concurrent.futures.Future()

        def done(f: concurrent.futures.Future[Lease]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            lease = f.result()
            if key is not None:
                lease.key = key
            view = lease.view(torch.float32, at, numel)
            if prepare is not None:
                prepare(view)
            out.set_result((lease, view))

        inner.add_done_callback(done)
        return out

    def store_range(self, lease: Lease, offset: int, nbytes: int) -> concurrent.futures.Future[None]:
        """Write the buffer's first ``nbytes`` (rounded up to pages) at ``offset``, then return it to
        the pool. Overlapping writes are kept in submission order."""
        lease.key = ("range", offset, self._range_size(offset, nbytes))
        return self._submit(self._store(lease, self._where(lease.key), slot=False))

    def acquire_any(self) -> concurrent.futures.Future[Lease]:
        """A buffer with no slot (to fill, then `store_range` or `discard`)."""
        return self._submit(self._acquire(("range", 0, 0), read=False))

    def _range_size(self, offset: int, nbytes: int) -> int:
        size = align_up(max(nbytes, 1))
        if offset % ALIGN or offset + size > self._end or size > self.buffer_bytes:
            raise ValueError(
                f"range [{offset}, +{nbytes}) is unaligned, outside the file ({self._end} bytes) "
                f"or larger than a {self.buffer_bytes}-byte buffer"
            )
        return size

    def _where(self, key: Hashable) -> tuple[int, int]:
        if _is_range(key):
            return key[1], key[2]  # type: ignore[index]
        return self._table.current(key)

    async def _after_overlapping(self, key: Hashable, offset: int, size: int) -> None:
        """Wait for writes in flight that overlap ``[offset, offset + size)`` (other than ``key``'s
        own entry, which the caller handles)."""
        for other, (fut, lo, n) in list(self._writing.items()):
            if other == key:
                continue
            if lo < offset + size and offset < lo + n:
                await asyncio.shield(fut)

    def discard(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Return the buffer to the pool without writing (its contents were not changed)."""
        return self._submit(self._discard(lease))

    def drain(self, timeout: float | None = None) -> None:
        """Block until every transfer submitted so far has finished; raise the first failure."""
        try:
            wait_all_futures(list(self._pending), timeout)
        except TimeoutError as e:
            if not all(f.done() for f in self._pending):  # ours, not a transfer's own error
                raise TimeoutError(f"swap transfers of {self.path}: {e}") from None
            raise

    def _submit(
        self, coro: Coroutine[Any, Any, T], slot: tuple[int, int] | None = None
    ) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; ``slot``: the slot region it was counted at (uncounted here
        when it never runs; the coroutine uncounts it otherwise)."""
        try:
            if self._closed:
                from dsio.errors import ClosedError

                raise ClosedError(f"swapper {self.path} is closed")
            fut = self._lt.submit(coro)
        except BaseException:
            coro.close()
            if slot is not None:
                self._table.done(slot[0])
            raise
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    # -- on the loop thread -------------------------------------------------------------------

    async def _open(self) -> AsyncFile:
        if self._file is None:
            from dsio.handle import AsyncIOHandle

            handle = AsyncIOHandle(self._io_config)
            f = handle.open(self.path, "w+")
            f.truncate(self._end)
            self._handle, self._file = handle, f
            self._o_direct = f.direct
        return self._file

    async def _acquire(
        self, key: Hashable, read: bool, where: tuple[int, int] = (0, 0), slot: bool = False
    ) -> Lease:
        try:
            return await self._acquire_counted(key, read, where)
        finally:
            if slot:
                self._table.done(where[0])

    async def _acquire_counted(self, key: Hashable, read: bool, where: tuple[int, int]) -> Lease:
        offset, size = where
        t0 = time.perf_counter()
        inner = await self._pool.acquire()
        t1 = time.perf_counter()
        self._wait_s += t1 - t0
        self._in_use += 1
        self._peak = max(self._peak, self._in_use)
        lease = Lease(inner, key, inner.tensor)
        if not read:
            return lease
        try:
            pending = self._writing.get(key)
            if pending is not None:
                await asyncio.shield(pending[0])
            await self._after_overlapping(key, offset, size)
            f = await self._open()
            await f.pread(inner.tensor[:size], offset)
        except BaseException:
            self._give_back(lease)
            raise
        self._reads += 1
        self._read_bytes += size
        self._read_s += time.perf_counter() - t0
        return lease

    async def _store(self, lease: Lease, where: tuple[int, int], slot: bool) -> None:
        key = lease.key
        offset, size = where
        t0 = time.perf_counter()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        previous = self._writing.get(key)
        self._writing[key] = (done, offset, size)
        try:
            if previous is not None:
                await asyncio.shield(previous[0])  # same key: keep the writes in order
            await self._after_overlapping(key, offset, size)
            f = await self._open()
            await f.pwrite(lease.tensor[:size], offset)
            self._writes += 1
            self._written_bytes += size
            self._write_s += time.perf_counter() - t0
            done.set_result(None)
        except BaseException as e:
            done.set_exception(e)
            done.exception()  # consumed here; readers re-raise it
            raise
        finally:
            entry = self._writing.get(key)
            if entry is not None and entry[0] is done:
                del self._writing[key]
            self._give_back(lease)
            if slot:
                self._table.done(offset)

    async def _discard(self, lease: Lease) -> None:
        self._give_back(lease)

    def _give_back(self, lease: Lease) -> None:
        inner, lease._inner = lease._inner, None
        if inner is None:
            raise RuntimeError(f"swap buffer of {lease.key!r} was already handed back")
        self._in_use -= 1
        inner.release()  # type: ignore[attr-defined]

    async def _aclose(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._handle is not None:
            await self._handle.aclose()
            self._handle = None
        self._pool.close(force=True)
        self._run_dir.remove()

    # -- introspection and lifetime -----------------------------------------------------------

    @property
    def buffers(self) -> int:
        """How many swap buffers the pool holds."""
        return self._buffers

    @property
    def pinned_bytes(self) -> int:
        return self._buffers * self.buffer_bytes + STAGING_BYTES

    def statistics(self) -> SwapperStatistics:
        return SwapperStatistics(
            kind=self.kind,
            path=self.path,
            slots=len(self._table),
            file_bytes=self._end,
            buffers=self._buffers,
            buffer_bytes=self.buffer_bytes,
            pinned_bytes=self.pinned_bytes,
            buffers_in_use=self._in_use,
            peak_buffers_in_use=self._peak,
            reads=self._reads,
            read_bytes=self._read_bytes,
            writes=self._writes,
            written_bytes=self._written_bytes,
            read_seconds=self._read_s,
            write_seconds=self._write_s,
            buffer_wait_seconds=self._wait_s,
            o_direct=self._o_direct,
            versions=self._table.statistics(),
        )

    def close(self) -> None:
        """Wait for transfers in flight, close the handle, free the pool, delete the swap files
        (pins still held are released: their saves can no longer read the file)."""
        if self._closed:
            return
        try:
            self.drain(timeout=600)
        finally:
            self._closed = True
            self._table.release_all()
            self._lt.remove_finalizer(self._finalizer)
            if not self._lt.closed:
                self._lt.run(self._aclose())

    def __enter__(self) -> Swapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
