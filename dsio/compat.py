"""DeepSpeed DeepNVMe surface: ``aio_handle`` with DeepSpeed's names and semantics, for sync code.

A script written for DeepSpeed's DeepNVMe tutorial runs with one changed import::

    from dsio.compat import AsyncIOBuilder        # was: from deepspeed.ops.op_builder import ...
    h = AsyncIOBuilder().load().aio_handle(1024**2, 128, False, False, 1)
    buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    h.sync_pwrite(buf, "/data/f.bin"); h.async_pread(buf, "/data/f.bin"); h.wait()

Differences, on purpose: any size and any buffer address work, as does any positive
``block_size`` (the engine splits requests into aligned power-of-two blocks of at least 4096) (DeepSpeed silently drops the
tail of sizes not a multiple of 512 x threads and writes 0 bytes from unaligned buffers),
failures raise instead of returning -1 or killing the process, and a write at offset 0
replaces the file (DeepSpeed keeps the old tail of a longer file). Writes at a non-zero
``file_offset`` write in place.

Operations are coroutines of an :class:`~dsio.AsyncIOHandle` run on dsio's one shared loop
thread (:func:`dsio._bridge.shared_loop`, uvloop when installed), so ``async_*`` calls make
progress in the background while the caller computes, and ``wait()`` blocks until they are done.
One shared thread rather than one per handle: DeepSpeed code creates handles freely (a swapper
per tensor group), each handle's completions arrive through its own eventfd on that one loop, and
a thread per handle would only add context switches. ``wait()`` stays per handle.

Lifetime: DeepSpeed scripts never close their handles. A handle that is dropped (``del h``) or
left open at exit still finishes every ``async_*`` operation it started -- the data lands on disk
-- and then frees its engine; the process exits promptly (the bridge drains its loop at exit and
never blocks once the interpreter is finalizing). Garbage collection that happens to run on the
loop thread schedules the close instead of blocking the loop it would wait on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Coroutine, Iterable
from typing import Any

import torch

from ._bridge import LoopThread, is_exiting, shared_loop
from ._gather import first_error, wait_all_futures
from ._memory import locked_tensor
from ._native import native
from .config import ALIGNMENT, IOConfig
from .errors import ChecksumError, ClosedError, ConfigError
from .handle import AsyncIOHandle

__all__ = ["AsyncIOBuilder", "GDSBuilder", "aio_handle", "gds_handle"]

log = logging.getLogger("dsio")


class aio_handle:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``aio_handle`` (block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism), with DeepSpeed's defaults."""

    _closed = True  # until fully built: __del__ of a half-built handle does nothing

    def __init__(
        self,
        block_size: int = 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        backend: str = "auto",
        gpu_backend: str = "auto",
    ) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}", field="block_size")
        cfg = IOConfig(
            block_size=_engine_block(block_size),
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
            backend=backend,
            gpu_backend=gpu_backend,
        )
        self._block_size = block_size  # what DeepSpeed's get_block_size() reports: the value given
        self._h = AsyncIOHandle(cfg)
        self._lt: LoopThread = shared_loop()
        self._pending: list[concurrent.futures.Future[int]] = []
        self._locked: dict[int, Any] = {}
        # Left open at exit: the bridge's exit hook first lets every submitted operation finish,
        # then runs this (it holds the AsyncIOHandle, not this wrapper, so `del h` still collects).
        self._finalizer = self._lt.add_finalizer(self._h.aclose)
        self._closed = False

    # -- DeepSpeed getters ---------------------------------------------------------------------
    def get_block_size(self) -> int:
        """The block size given (any positive int, as DeepSpeed accepts); the engine splits requests
        into blocks of the next power of two >= 4096 (O_DIRECT needs 4096-aligned pieces)."""
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._h.config.queue_depth

    def get_single_submit(self) -> bool:
        return self._h.config.single_submit

    def get_overlap_events(self) -> bool:
        return self._h.config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._h.config.intra_op_parallelism

    def get_alignment(self) -> int:
        return self._h.config.intra_op_parallelism * ALIGNMENT

    # -- operations ------------------------------------------------------------------------------
    def _start(self, coro: Coroutine[Any, Any, int]) -> concurrent.futures.Future[int]:
        if self._closed:
            coro.close()
            raise ClosedError("the aio_handle is closed")
        return self._lt.submit(coro)

    def _submit(
        self, write: bool, buffer: torch.Tensor, filename: str | int | None, file_offset: int, fd: int | None
    ) -> concurrent.futures.Future[int]:
        """Start one write (or read) of ``buffer`` at ``file_offset`` of ``filename`` or of the caller's
        open file ``fd`` (exactly one of them): the one body of the four sync/async operations."""
        target = _target(filename, fd)
        coro: Coroutine[Any, Any, int]
        if isinstance(target, int):
            coro = self._fd_op(write, buffer, target, file_offset)
        elif write:
            coro = self._h.pwrite(buffer, target, None if file_offset == 0 else file_offset)
        else:
            coro = self._h.pread(buffer, target, file_offset)
        return self._start(coro)

    async def _fd_op(self, write: bool, buffer: torch.Tensor, fd: int, file_offset: int) -> int:
        # DeepSpeed's async_pwrite(buffer, fd): the caller's open file, written in place at
        # file_offset (never truncated); reopened through /proc so that our fd (O_DIRECT where the
        # handle uses it) stays ours and the caller's stays open.
        async with self._h.open(f"/proc/self/fd/{fd}", "w" if write else "r") as f:
            return await (f.pwrite(buffer, file_offset) if write else f.pread(buffer, file_offset))

    def sync_pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Write and wait. Returns 1 (DeepSpeed's count of completed ops). ``filename`` or ``fd``
        (an open file of the caller's, written in place at ``file_offset``)."""
        self._submit(True, buffer, filename, file_offset, fd).result()
        return 1

    def sync_pread(
        self,
        buffer: torch.Tensor,
        filename: str | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Read and wait. Returns 1. A file too short for the buffer raises ``ShortIOError``."""
        self._submit(False, buffer, filename, file_offset, fd).result()
        return 1

    def async_pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Start a write; ``wait()`` collects it. Returns 0. Don't modify ``buffer`` until then.
        ``filename`` or ``fd`` (DeepSpeed's ``async_pwrite(buffer, fd=...)``: the caller's open file)."""
        self._pending.append(self._submit(True, buffer, filename, file_offset, fd))
        return 0

    def async_pread(
        self,
        buffer: torch.Tensor,
        filename: str | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Start a read; ``wait()`` collects it. Returns 0. ``filename`` or ``fd``."""
        self._pending.append(self._submit(False, buffer, filename, file_offset, fd))
        return 0

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: str,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        **kw: bool,
    ) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async, file_offset)``."""
        return self._parallel(True, buffer, filename, validate, async_op, file_offset, kw)

    def pread(
        self,
        buffer: torch.Tensor,
        filename: str,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        **kw: bool,
    ) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset)``."""
        return self._parallel(False, buffer, filename, validate, async_op, file_offset, kw)

    def _parallel(
        self,
        write: bool,
        buffer: torch.Tensor,
        filename: str,
        validate: bool,
        async_op: bool,
        file_offset: int,
        kw: dict[str, bool],
    ) -> int:
        is_async = kw.pop("async", async_op)  # DeepSpeed's keyword is the reserved word `async`
        if kw:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(kw)}")
        future = self._submit(write, buffer, filename, file_offset, None)
        if is_async:  # as async_pwrite / async_pread: wait() collects it
            self._pending.append(future)
            return 0
        future.result()  # as sync_pwrite / sync_pread
        if validate:
            _validate(buffer, filename, file_offset)
        return 1

    def read(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        """DeepSpeed's synchronous ``read``: returns 0 on success (and raises on failure)."""
        self.pread(buffer, filename, validate, False, file_offset)
        return 0

    def write(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        """DeepSpeed's synchronous ``write``: returns 0 on success (and raises on failure)."""
        self.pwrite(buffer, filename, validate, False, file_offset)
        return 0

    def wait(self) -> int:
        """Block until every ``async_*`` operation finished; return how many completed.

        If any failed, all are still waited for, then the first failure is raised.
        """
        pending, self._pending = self._pending, []
        wait_all_futures(pending)
        return len(pending)

    # -- locked memory -------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned, mlock'ed CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype."""
        dtype = example_tensor.dtype
        nbytes = int(num_elem) * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        t, mem = locked_tensor(nbytes, dtype=dtype, count=int(num_elem))
        self._locked[t.data_ptr()] = mem
        _LOCKED.add(t.data_ptr(), nbytes, mem)
        return t

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Forget a tensor from ``new_cpu_locked_tensor`` (of any handle, as DeepSpeed's shared pinned
        tensor manager does); its memory goes when the tensor (and its views) do."""
        mine = self._locked.pop(tensor.data_ptr(), None) is not None
        return _LOCKED.remove(tensor.data_ptr()) or mine

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True for memory torch pinned and for tensors whose bytes lie within one buffer from
        ``new_cpu_locked_tensor`` of any handle of this process (views and slices included)."""
        if tensor.device.type != "cpu":
            return False
        return tensor.is_pinned() or _LOCKED.contains(
            tensor.data_ptr(), tensor.numel() * tensor.element_size()
        )

    # -- lifetime --------------------------------------------------------------------------------
    @property
    def handle(self) -> AsyncIOHandle:
        """The underlying :class:`~dsio.AsyncIOHandle` (statistics, backend)."""
        return self._h

    def close(self) -> None:
        """Finish every started ``async_*`` operation (its data lands), then free the engine.

        Failures of operations nobody ``wait()``-ed for are logged, not raised. Never blocks when
        called on dsio's loop thread (garbage collection there) or while the interpreter exits.
        """
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, []
        lt, h = self._lt, self._h
        lt.remove_finalizer(self._finalizer)
        try:
            if lt.in_loop_thread():
                # Blocking here would wait on the very loop we run on: close once they are done.
                lt.loop.create_task(_close_after(h, pending))
            elif lt.closed or is_exiting():
                # The exit hook already let submitted work finish; what is left is closing now.
                if not sys.is_finalizing():
                    h.close()
            else:
                lt.run(_close_after(h, pending))
        finally:
            self._locked.clear()

    def __enter__(self) -> aio_handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):
                self.close()


def _engine_block(block_size: int) -> int:
    """DeepSpeed accepts any positive block size (its tests use 1024); dsio's engine splits requests
    into power-of-two blocks of at least 4096 bytes, so that every O_DIRECT piece is aligned."""
    return max(ALIGNMENT, 1 << (block_size - 1).bit_length())


def _target(filename: str | int | None, fd: int | None) -> str | int:
    if (filename is None) == (fd is None):
        raise TypeError("pass exactly one of filename and fd")
    if fd is not None:
        if type(fd) is not int or fd < 0:
            raise TypeError(f"fd must be an open file descriptor (an int >= 0), got {fd!r}")
        return fd
    assert filename is not None
    return filename


class _LockedRegions:
    """Every buffer from ``new_cpu_locked_tensor`` of any handle of this process (DeepSpeed keeps one
    shared pinned-tensor manager too): base address -> (bytes, weak reference to its memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[int, weakref.ref[Any]]] = {}

    def add(self, base: int, nbytes: int, mem: Any) -> None:
        with self._lock:
            self._regions[base] = (nbytes, weakref.ref(mem))

    def remove(self, base: int) -> bool:
        with self._lock:
            return self._regions.pop(base, None) is not None

    def contains(self, ptr: int, nbytes: int) -> bool:
        """``[ptr, ptr + nbytes)`` lies within one live region."""
        with self._lock:
            dead = [b for b, (_, ref) in self._regions.items() if ref() is None]
            for b in dead:  # memory freed (its tensors are gone): a new buffer may reuse the address
                del self._regions[b]
            return any(b <= ptr and ptr + nbytes <= b + n for b, (n, _) in self._regions.items())


_LOCKED = _LockedRegions()


async def _close_after(h: AsyncIOHandle, pending: Iterable[concurrent.futures.Future[int]]) -> None:
    """On the loop: let ``pending`` operations finish (logging failures nobody collected), close ``h``."""
    futs = [asyncio.wrap_future(f) for f in pending]
    if futs:
        await asyncio.wait(futs)
        failed = first_error(futs)
        if failed is not None:
            log.warning("dsio.compat: an operation never wait()-ed for failed: %r", failed)
    await h.aclose()


def _validate(buffer: torch.Tensor, filename: str, file_offset: int) -> None:
    """DeepSpeed's ``validate``: compare the buffer with the file read back through the page cache."""
    n = buffer.numel() * buffer.element_size()
    with open(filename, "rb") as f:
        f.seek(file_offset)
        disk = f.read(n)
    mine = buffer.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    if disk != mine:
        raise ChecksumError(f"validation failed: {filename} at offset {file_offset} differs from the buffer")


class gds_handle(aio_handle):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``gds_handle``: the ``aio_handle`` methods for CUDA tensors, plus device-buffer
    pinning. Uses cuFile where GPUDirect Storage is available, else dsio's pipelined bounce path
    (``IOConfig.gpu_backend="auto"``); pass ``gpu_backend="cufile"`` to insist on cuFile."""

    def __init__(
        self,
        block_size: int = 8 * 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        backend: str = "auto",
        gpu_backend: str = "auto",
    ) -> None:
        if not torch.cuda.is_available():
            from .errors import BackendUnavailableError

            raise BackendUnavailableError("gds_handle needs a CUDA device; torch sees none here")
        super().__init__(
            block_size,
            queue_depth,
            single_submit,
            overlap_events,
            intra_op_parallelism,
            backend=backend,
            gpu_backend=gpu_backend,
        )
        self._registered: dict[int, int] = {}

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor of ``num_elem`` elements, registered with cuFile where it is in use."""
        device = example_tensor.device if example_tensor.is_cuda else torch.device("cuda")
        t = torch.empty(int(num_elem), dtype=example_tensor.dtype, device=device)
        self.pin_device_tensor(t)
        return t

    def free_pinned_device_tensor(self, tensor: torch.Tensor) -> bool:
        return self.unpin_device_tensor(tensor)

    def pin_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Register the tensor's memory with cuFile (``cuFileBufRegister``); True if registered."""
        C = native()
        ok, _reason, _nvfs = C.cufile_status()
        if not ok or tensor.nbytes == 0:
            return False
        rc = C.cufile_buf_register(tensor.data_ptr(), tensor.nbytes)
        if rc == 0:
            self._registered[tensor.data_ptr()] = tensor.nbytes
        return rc == 0

    def unpin_device_tensor(self, tensor: torch.Tensor) -> bool:
        if self._registered.pop(tensor.data_ptr(), None) is None:
            return False
        return native().cufile_buf_deregister(tensor.data_ptr()) == 0

    def close(self) -> None:
        C = native()
        for ptr in list(self._registered):
            C.cufile_buf_deregister(ptr)
        self._registered.clear()
        super().close()


class _AsyncIOModule:
    """What ``AsyncIOBuilder().load()`` returns: exposes ``aio_handle`` like DeepSpeed's op module."""

    aio_handle = aio_handle


class AsyncIOBuilder:
    """Stand-in for ``deepspeed.ops.op_builder.AsyncIOBuilder``: nothing to JIT-compile."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> type[_AsyncIOModule]:
        return _AsyncIOModule


class _GDSModule:
    """What ``GDSBuilder().load()`` returns: exposes ``gds_handle`` like DeepSpeed's op module."""

    gds_handle = gds_handle


class GDSBuilder:
    """Stand-in for ``deepspeed.ops.op_builder.GDSBuilder``."""

    NAME = "gds"

    def is_compatible(self, verbose: bool = False) -> bool:
        return torch.cuda.is_available()

    def load(self, verbose: bool = True) -> type[_GDSModule]:
        return _GDSModule
