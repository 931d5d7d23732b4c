"""``PinnedPool``: one aligned, locked region cut into equal buffers, handed out with backpressure."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from ._backends import warn_once
from ._memory import aligned_buffer
from .config import ALIGNMENT
from .errors import ClosedError, ConfigError, PoolBusyError

__all__ = ["Lease", "PinnedPool", "PoolStatistics"]

log = logging.getLogger("dsio")


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    buffers: int
    """Buffers the pool was cut into."""
    buffer_bytes: int
    in_use: int
    """Buffers handed out right now."""
    waiters: int
    """Tasks waiting for a buffer right now (backpressure)."""
    acquired_total: int
    waited_total: int
    """Acquisitions that had to wait."""
    wait_seconds_total: float
    locked: bool
    """Whether the region is mlock'ed."""
    cuda_registered: bool
    hugepages: bool = False
    """Whether the region is advised onto transparent huge pages (see ``PinnedPool``)."""


class Lease:
    """One buffer of a pool. ``tensor`` is a uint8 view; ``release()`` gives it back, exactly once."""

    __slots__ = ("_pool", "index", "ptr", "nbytes", "tensor")

    def __init__(self, pool: PinnedPool, index: int) -> None:
        self._pool: PinnedPool | None = pool
        self.index = index
        self.nbytes = pool.buffer_bytes
        self.ptr = pool._base + index * pool.buffer_bytes
        self.tensor = pool._views[index]

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            raise RuntimeError("this pool buffer was already released")
        pool._give_back(self.index)


def _cuda_register(ptr: int, nbytes: int) -> bool:
    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(rc) != 0:
        warn_once("cuda-register", f"dsio: cudaHostRegister failed ({rc}); pool is not CUDA-pinned")
        return False
    return True


class PinnedPool:
    """``nbytes`` of page-aligned host memory, mlock'ed (and registered with CUDA when torch sees
    a GPU), cut into ``nbytes // buffer_size`` buffers. With ``hugepage`` (a handle's staging
    pool: see ``dsio._tuning.SWITCHES.hugepages``) the region starts on a 2 MiB boundary and is advised onto transparent huge
    pages before it is touched (``statistics().hugepages`` says whether the kernel accepted).

    ``async with pool.buffer() as buf`` lends a uint8 tensor and waits while every buffer is out.
    The memory is freed when the pool is closed and the last view of it is gone, so a stray view
    never dangles.
    """

    def __init__(self, nbytes: int, buffer_size: int, *, lock: bool = True, hugepage: bool = False) -> None:
        if buffer_size <= 0 or buffer_size % ALIGNMENT:
            raise ConfigError(f"buffer_size must be a positive multiple of {ALIGNMENT}, got {buffer_size}")
        if nbytes < buffer_size:
            raise ConfigError(f"nbytes ({nbytes}) must hold at least one buffer of {buffer_size} bytes")
        count = nbytes // buffer_size
        self.buffer_bytes = buffer_size
        # Huge pages: each 2 MiB of the region physically contiguous (the kernel's transparent
        # huge pages, when enabled).
        self._mem = aligned_buffer(count * buffer_size, lock=lock, hugepage=hugepage)
        if lock and not self._mem.locked:
            import os

            warn_once(
                "mlock",
                f"dsio: could not mlock pinned pool ({os.strerror(self._mem.lock_errno)}); "
                "raise RLIMIT_MEMLOCK (ulimit -l) for locked buffers",
            )
        self._base: int = self._mem.ptr
        whole = torch.frombuffer(self._mem, dtype=torch.uint8)
        if lock and not self._mem.locked:
            # mlock would have faulted every page in: do it by hand, so an unlockable pool is resident
            # from the start too (no page faults on the I/O path, and its memory shows up at
            # construction, not growing with use)
            whole.zero_()
        self._views = list(whole.split(buffer_size))
        self._cuda = _cuda_register(self._base, count * buffer_size)
        self._free: collections.deque[int] = collections.deque(range(count))
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()
        self._acquired = 0
        self._waited = 0
        self._wait_s = 0.0
        self._closed = False

    @property
    def buffers(self) -> int:
        return len(self._views)

    def try_acquire(self) -> Lease | None:
        """A buffer now, or None when all are out."""
        if self._closed:
            raise ClosedError("the pool is closed")
        if not self._free or self._waiters:
            return None
        self._acquired += 1
        return Lease(self, self._free.popleft())

    async def acquire(self) -> Lease:
        """A buffer, waiting (first come, first served) while all are out."""
        lease = self.try_acquire()
        if lease is not None:
            return lease
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        t0 = time.perf_counter()
        try:
            index = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._give_back(fut.result())  # handed over just as we were cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise
        if self._closed:  # handed a buffer, then the pool closed before this task resumed
            raise ClosedError("the pool was closed")
        self._waited += 1
        self._wait_s += time.perf_counter() - t0
        self._acquired += 1
        return Lease(self, index)

    @contextlib.asynccontextmanager
    async def buffer(self) -> AsyncIterator[torch.Tensor]:
        lease = await self.acquire()
        try:
            yield lease.tensor
        finally:
            lease.release()

    def _give_back(self, index: int) -> None:
        if self._closed:
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(index)
                return
        self._free.append(index)

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            buffers=len(self._views),
            buffer_bytes=self.buffer_bytes,
            in_use=len(self._views) - len(self._free) if not self._closed else 0,
            waiters=len(self._waiters),  # len() is atomic: safe from the exporter's thread
            acquired_total=self._acquired,
            waited_total=self._waited,
            wait_seconds_total=self._wait_s,
            locked=bool(self._mem.locked) if self._mem is not None else False,
            cuda_registered=self._cuda,
            hugepages=bool(self._mem.hugepage) if self._mem is not None else False,
        )

    def close(self, *, force: bool = False) -> None:
        """Free the pool. Refuses (``PoolBusyError``) while buffers are handed out, unless ``force``:
        then waiters get ``ClosedError`` and the memory lives on until the last view is gone."""
        if self._closed:
            return
        out = len(self._views) - len(self._free)
        if out and not force:
            raise PoolBusyError(f"{out} pool buffer(s) still in use; release them before close()")
        self._closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(ClosedError("the pool was closed"))
        if self._cuda:
            torch.cuda.cudart().cudaHostUnregister(self._base)
            self._cuda = False
        self._views = []
        self._mem = None  # freed once no tensor view refers to it any more

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> PinnedPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
