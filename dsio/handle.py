"""``AsyncIOHandle``: ``await handle.pwrite(tensor, path)`` / ``await handle.pread(tensor, path)``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from typing import Any

import torch

from ._dispatch import READ, WRITE, Dispatcher
from ._op import Operations
from ._registry import track as _track_metrics
from ._registry import untrack as _untrack_metrics
from ._stats import HandleStatistics
from ._tensor import as_bytes, check_range
from ._transfer import FileRef
from ._transfer import fsync as _fsync
from .config import IOConfig
from .errors import BackendUnavailableError
from .file import AsyncFile
from .pool import PinnedPool

__all__ = ["AsyncIOHandle"]

PathLike = str | os.PathLike[str]


class AsyncIOHandle:
    """An asyncio-native tensor I/O engine.

    Each ``pread``/``pwrite`` is one awaitable resolving to the byte count; compose them with
    ``asyncio.gather``. The handle binds to the event loop it first runs on (asyncio or uvloop)
    and delivers completions through one eventfd read by that loop: no thread waits per
    operation. Close it (``async with``, ``await aclose()`` or ``close()``) to free its
    threads, rings, fds and pinned memory.
    """

    def __init__(self, config: IOConfig | None = None, **overrides: Any) -> None:
        cfg = config if config is not None else IOConfig()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        self._ops = Operations(cfg)
        self._gpu: Any = None  # the CUDA half (``GpuIO``), made on the first CUDA tensor
        self._files: weakref.WeakSet[AsyncFile] = weakref.WeakSet()
        _track_metrics(self)  # read by dsio.metrics at scrape time; a weak reference

    @property
    def backend(self) -> str:
        """The kernel backend in use: ``io_uring``, ``aio`` or ``posix``."""
        return self._ops.backend

    @property
    def closed(self) -> bool:
        return self._ops.closed

    # The engine, dispatcher and pool live in the shared operation machinery (dsio._op).
    @property
    def _engine(self) -> Any:
        return self._ops.engine

    @property
    def _disp(self) -> Dispatcher:
        return self._ops.disp

    @property
    def _pool(self) -> PinnedPool:
        return self._ops.pool

    def _gpu_io(self) -> Any:
        """The CUDA half, created on the first CUDA tensor (lent to this handle's files)."""
        if self._gpu is None:
            try:
                from .gpu import GpuIO
            except ImportError as e:  # pragma: no cover
                raise BackendUnavailableError(f"CUDA tensor I/O is unavailable: {e}") from e
            self._ops.ready()
            self._gpu = GpuIO(self._ops)
        return self._gpu

    # -- operations ------------------------------------------------------------------------
    async def pwrite(
        self, tensor: torch.Tensor, path: PathLike, offset: int | None = None, *, fsync: bool = False
    ) -> int:
        """Write the tensor's bytes to ``path``; return the byte count.

        With ``offset=None`` (the default) the file is created or replaced and ends up exactly
        ``tensor.nbytes`` long. With an ``offset`` the bytes are written in place at that
        offset, creating the file if needed and never truncating it. ``fsync=True`` makes the
        data durable before returning.
        """
        ptr, n = as_bytes(tensor)
        self._ops.ready()
        if tensor.is_cuda:
            return int(await self._gpu_io().pwrite(tensor, path, offset, fsync=fsync))
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset is None else 0)
        off = 0 if offset is None else check_range(offset, n, path=path)
        ref = FileRef(os.fspath(path), flags, o_direct=self.config.o_direct)
        try:
            with self._ops.scope(WRITE, n):
                if offset is None and n:
                    # Size the new file up front: O_DIRECT writes inside i_size run concurrently
                    # on ext4/xfs, while extending ones are serialized (measured: +10-20% here).
                    os.ftruncate(ref.fd, n)
                await self._ops.start(WRITE, ref, ptr, n, off, tensor)
                if fsync:
                    await _fsync(self._ops.disp, ref)
        finally:
            ref.release()
        return n

    async def pread(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        """Fill the tensor with ``tensor.nbytes`` bytes of ``path`` from ``offset``; return the count.

        A file too short to fill the tensor raises ``ShortIOError``, never a partial result.
        """
        ptr, n = as_bytes(tensor)
        self._ops.ready()
        if tensor.is_cuda:
            return int(await self._gpu_io().pread(tensor, path, offset))
        off = check_range(offset, n)
        ref = FileRef(os.fspath(path), os.O_RDONLY, o_direct=self.config.o_direct)
        try:
            with self._ops.scope(READ, n):
                await self._ops.start(READ, ref, ptr, n, off, tensor)
        finally:
            ref.release()
        return n

    def open(self, path: PathLike, mode: str = "r") -> AsyncFile:
        """Keep one file open for many operations at offsets: ``async with h.open(p, "w") as f``.

        Modes: ``"r"`` read; ``"w"`` write, created if missing; ``"r+"`` read and write an
        existing file; ``"w+"`` read and write, created if missing. No mode truncates:
        call ``f.truncate(size)`` for that.
        """
        self._ops.ready()
        f = AsyncFile(self._ops, os.fspath(path), mode, gpu=self._gpu_io)
        self._files.add(f)
        return f

    # -- introspection and lifetime ------------------------------------------------------------
    def statistics(self) -> HandleStatistics:
        return self._ops.statistics()

    async def aclose(self) -> None:
        """Wait for every operation in flight (and every request of cancelled ones), then close."""
        if self._ops.closed:
            return
        await self._ops.wait_idle()
        self.close()

    def close(self) -> None:
        """Close now: block until the kernel finishes what is in flight, then free everything.

        Operations still awaited get their results (or errors); new ones raise ``ClosedError``.
        """
        if self._ops.closed:
            return
        self._ops.close()
        for f in list(self._files):
            f.close()
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._ops.release()
        _untrack_metrics(self)

    async def __aenter__(self) -> AsyncIOHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Best effort for handles dropped without close(): threads and pinned memory must not leak.
        # (A handle whose __init__ raised before making its operations has none: AttributeError.)
        with contextlib.suppress(Exception):
            if not self._ops.closed:
                self.close()
