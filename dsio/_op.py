"""The operation machinery one handle's calls share: engine, dispatcher, pinned pool, counters.

``AsyncIOHandle`` (public, paths), ``AsyncFile`` (one open file) and ``GpuIO`` (CUDA tensors) all
run their operations through one :class:`Operations`; none of them imports another to reach it.
The handle owns the CUDA half (it makes its ``GpuIO`` on the first CUDA tensor and lends it to its
files); ``Operations`` knows no GPU. Import arrows: handle -> _op, file, gpu (lazily); file -> _op;
gpu -> _op (types only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from ._backends import open_engine
from ._dispatch import READ, Dispatcher
from ._stats import HandleStatistics, IOEngineStatistics
from ._transfer import (
    DIRECT,
    FRESH,
    FileRef,
    TransferCounters,
    check_readable,
    submit_one,
    transfer,
    whole_route,
)
from ._tuning import SWITCHES
from .config import IOConfig
from .errors import ClosedError, IOFailedError
from .pool import PinnedPool

__all__ = ["Operations"]


class _OpScope:
    """``with ops.scope(op, n):`` around one user operation."""

    __slots__ = ("_ops", "_op", "_n")

    def __init__(self, ops: Operations, op: int, n: int) -> None:
        self._ops, self._op, self._n = ops, op, n

    def __enter__(self) -> None:
        self._ops.in_flight += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None and issubclass(exc_type, IOFailedError):
            self._ops.errors += 1
        self._ops.end(self._op, self._n, exc_type is None)


class Operations:
    """What a handle owns to run operations: built from an :class:`IOConfig`, closed once."""

    def __init__(self, cfg: IOConfig) -> None:
        self.config = cfg
        self.engine = open_engine(cfg)
        self.disp = Dispatcher(self.engine)
        try:
            # The staging pool on huge pages: staged reads then run at the direct path's speed.
            self.pool = PinnedPool(cfg.pool_bytes, cfg.staging_buffer_bytes, hugepage=SWITCHES.hugepages)
        except BaseException:
            self.engine.close()
            raise
        self.counters = TransferCounters()
        self.reads = self.writes = self.read_bytes = self.written_bytes = 0
        self.errors = self.in_flight = 0
        self._idle_waiters: list[asyncio.Future[None]] = []

    @property
    def backend(self) -> str:
        return str(self.engine.backend)

    @property
    def closed(self) -> bool:
        return bool(self.disp.closed)

    # -- one operation ----------------------------------------------------------------------
    def ready(self) -> None:
        """Raise ``ClosedError`` after close; bind to the running loop on first use."""
        if self.disp.closed:
            raise ClosedError("the handle is closed")
        self.disp.loop()  # raises WrongLoopError from another loop

    def scope(self, op: int, n: int) -> _OpScope:
        """Accounting of one user operation (in flight, counts, errors) as a cheap context manager."""
        return _OpScope(self, op, n)

    def start(
        self,
        op: int,
        ref: FileRef,
        ptr: int,
        n: int,
        off: int,
        keep: object,
        sums: tuple[int, int, int] = (0, 0, 0),
    ) -> Awaitable[object]:
        """One transfer, its route decided once (`whole_route`). The common case, memory, offset and
        length 4096-aligned, is one O_DIRECT request submitted now with no coroutine of its own
        (its future is returned); the others return the general path's coroutine, told whether the
        aligned destination is fresh memory so it does not probe again. ``sums`` (reads): checksums
        the engine computes on the way (`dsio._sums.ReadSums.engine_args`)."""
        route = whole_route(ref, op, ptr, n, off)
        if route != DIRECT:  # unaligned, or fresh memory (staged, faulted in on the copier threads)
            return self._general(op, ref, ptr, n, off, keep, True if route == FRESH else None, sums)
        if op == READ:
            check_readable(ref, n, off)
        fut = submit_one(self.disp, ref, op, ptr, n, off, keep, sums=sums)
        self.counters.direct += n
        return fut

    async def _general(
        self,
        op: int,
        ref: FileRef,
        ptr: int,
        n: int,
        off: int,
        keep: object,
        fresh: bool | None,
        sums: tuple[int, int, int],
    ) -> None:
        if op == READ:
            check_readable(ref, n, off)
        await transfer(
            self.disp, self.pool, ref, op, ptr, n, off, keep, self.counters, fresh=fresh, sums=sums
        )

    def begin(self) -> None:
        self.in_flight += 1

    def end(self, op: int, n: int, ok: bool) -> None:
        """Account one finished user operation; wake ``wait_idle()`` once nothing is in flight."""
        self.in_flight -= 1
        if op == READ:
            self.reads += 1
            self.read_bytes += n if ok else 0
        else:
            self.writes += 1
            self.written_bytes += n if ok else 0
        if not self.in_flight:
            for w in self._idle_waiters:
                if not w.done():
                    w.set_result(None)
            self._idle_waiters.clear()

    # -- introspection and lifetime ------------------------------------------------------------
    def statistics(self) -> HandleStatistics:
        c = self.counters
        return HandleStatistics(
            backend=self.backend,
            reads=self.reads,
            writes=self.writes,
            read_bytes=self.read_bytes,
            written_bytes=self.written_bytes,
            errors=self.errors,
            in_flight=self.in_flight,
            direct_bytes=c.direct,
            staged_bytes=c.staged,
            buffered_bytes=c.buffered,
            engine=IOEngineStatistics.from_native(self.backend, self.engine.statistics()),
            pool=self.pool.statistics(),
        )

    async def wait_idle(self) -> None:
        """Wait for every operation in flight and every request of cancelled ones."""
        if self.in_flight:
            idle = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(idle)
            await idle
        pending = self.disp.futures()
        if pending:
            await asyncio.wait(pending)

    def close(self) -> None:
        """Block until the kernel finishes what is in flight, then free the engine and the pool.
        The caller closes its open files after ``disp.shutdown()`` (this method does both)."""
        if self.disp.closed:
            return
        self.disp.shutdown()

    def release(self) -> None:
        """Second half of closing, after open files (and the handle's GPU half) are closed:
        engine, pool."""
        self.engine.close()
        # Suspended coroutines may still hold staging buffers; their memory outlives the pool's views.
        self.pool.close(force=True)
