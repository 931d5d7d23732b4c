"""Bridge from the native engine's eventfd to asyncio futures.

One ``Dispatcher`` per handle. ``submit()`` hands a request to the engine and
returns a future; the event loop watches the engine's eventfd with
``add_reader`` and the callback reaps finished requests and resolves their
futures. Resources tied to a request (file references, staging buffers, the
tensor whose memory the kernel touches) are released only when the kernel is
done with it, even if the awaiting coroutine was cancelled long before.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from .errors import BackendUnavailableError, ClosedError, IOFailedError, ShortIOError, WrongLoopError

__all__ = ["READ", "WRITE", "FSYNC", "Dispatcher"]

READ, WRITE, FSYNC = 0, 1, 2


class _Entry:
    __slots__ = ("future", "nbytes", "path", "offset", "finalize", "keep")

    def __init__(self, future, nbytes, path, offset, finalize, keep):
        self.future = future
        self.nbytes = nbytes
        self.path = path
        self.offset = offset
        self.finalize = finalize
        self.keep = keep


def _retrieve(fut: asyncio.Future) -> None:
    # A failed request whose awaiter was cancelled: mark the exception as seen.
    if not fut.cancelled():
        fut.exception()


class Dispatcher:
    def __init__(self, engine) -> None:
        self.engine = engine
        self._efd: int = engine.eventfd
        self._loop: asyncio.AbstractEventLoop | None = None
        self._entries: dict[int, _Entry] = {}
        self._tags = itertools.count(1)
        self.closed = False

    # -- binding ---------------------------------------------------------------------------
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, binding to it on first use; another loop is an error."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            raise WrongLoopError("dsio handles are used from a running asyncio event loop") from None
        if self._loop is None:
            running.add_reader(self._efd, self._on_readable)
            self._loop = running
        elif running is not self._loop:
            raise WrongLoopError(
                "this dsio handle is bound to the event loop it first ran on; create one handle per loop"
            )
        return running

    # -- requests --------------------------------------------------------------------------
    def submit(
        self,
        op: int,
        fd: int,
        ptr: int,
        nbytes: int,
        offset: int,
        *,
        path: str | None,
        finalize: Callable[[int], None] | None = None,
        keep: Any = None,
        copy_dst: int = 0,
        copy_src: int = 0,
        slots: list[int] | None = None,
        sums: tuple[int, int, int] = (0, 0, 0),
    ) -> asyncio.Future:
        """Start one request. ``finalize(result)`` runs when the kernel is done, before the future
        resolves, whether or not anyone still awaits it; ``keep`` is held alive until then.

        ``copy_dst`` (reads only): the engine's workers copy every piece read in full from ``ptr``
        to the same position under ``copy_dst`` before the request completes (a staged read's
        pool -> tensor copy, off the event-loop thread); failed or short pieces are not copied.
        ``copy_src`` (writes only): each piece is first copied from the same position under
        ``copy_src`` into ``ptr`` by the worker submitting it (a staged write's tensor -> pool copy).
        ``slots`` (reads only): a staged read as one request: ``ptr`` is the caller's
        memory and every piece cycles through these staging buffers (``Engine.submit_staged``).
        ``sums`` (reads only): `dsio._sums.ReadSums.engine_args`, checksums the engine computes as the
        pieces land (the caller keeps the `ReadSums` alive through ``keep``)."""
        if self.closed:
            raise ClosedError("the handle is closed")
        loop = self.loop()
        fut = loop.create_future()
        tag = next(self._tags)
        self._entries[tag] = _Entry(fut, nbytes, path, offset, finalize, keep)
        try:
            if slots is not None:
                self.engine.submit_staged(op, fd, ptr, nbytes, offset, tag, slots, *sums)
            elif copy_dst or copy_src or sums[0]:
                self.engine.submit(op, fd, ptr, nbytes, offset, tag, copy_dst, copy_src, *sums)
            else:
                self.engine.submit(op, fd, ptr, nbytes, offset, tag)
        except BaseException:
            del self._entries[tag]
            raise
        return fut

    def after_stream(self, stream: int) -> asyncio.Future:
        """A future resolved (through the eventfd) once the CUDA ``stream`` reaches this point."""
        if self.closed:
            raise ClosedError("the handle is closed")
        fut = self.loop().create_future()
        tag = next(self._tags)
        self._entries[tag] = _Entry(fut, 0, None, None, None, None)
        rc = self.engine.notify_stream(stream, tag)
        if rc != 0:
            del self._entries[tag]
            raise BackendUnavailableError(f"cannot wait on a CUDA stream (cuLaunchHostFunc: {rc})")
        return fut

    def futures(self) -> list[asyncio.Future]:
        return [e.future for e in self._entries.values()]

    def _on_readable(self) -> None:
        self._complete(self.engine.reap())

    def _complete(self, results) -> None:
        for tag, res, err_off in results:
            entry = self._entries.pop(tag)
            if entry.finalize is not None:
                entry.finalize(res)
            fut = entry.future
            if fut.done() or fut.get_loop().is_closed():
                continue  # nobody awaits it any more; the kernel is done, resources are free
            if res < 0:
                fut.set_exception(IOFailedError(-res, entry.path, err_off))
                fut.add_done_callback(_retrieve)
            elif res != entry.nbytes:
                fut.set_exception(ShortIOError(entry.path, err_off, res, entry.nbytes))
                fut.add_done_callback(_retrieve)
            else:
                fut.set_result(res)

    # -- shutdown --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Refuse new requests, let the kernel finish every request in flight, resolve them all."""
        if self.closed:
            return
        self.closed = True
        self.engine.shutdown()  # blocks, GIL released, until workers drained and joined
        results = self.engine.reap()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        self._complete(results)
