"""The one bridge between synchronous callers and dsio's asyncio world.

A :class:`LoopThread` runs one event loop (uvloop when importable) on one daemon thread.
Synchronous code (``dsio.compat``, the DCP plugin, dstrain's checkpoints and offload) submits
coroutines to it with :meth:`LoopThread.submit` (a ``concurrent.futures.Future``) or
:meth:`LoopThread.run` (blocks for the result).

Exit safety, the reason this module exists: objects that own a loop thread are often never
closed (DeepSpeed scripts never close their handles). At interpreter exit a hook (threading's
exit hooks, before ``concurrent.futures`` shuts its executors; ``atexit`` as a backstop) drains
every live loop thread -- work already submitted finishes (bounded by ``DRAIN_TIMEOUT_S``),
registered finalizers run on the loop (closing handles, flushing files), tasks that work left
running (a background checkpoint save) finish, bounded, then are cancelled -- then stops the
loop and joins the thread, while daemon threads can still run. After that,
and whenever ``sys.is_finalizing()``, nothing here blocks: a ``__del__`` that calls ``close()``
late returns at once instead of waiting on a thread the interpreter has frozen.

``shared_loop()`` is the process-wide instance that every dsio component uses unless it is
given its own.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["DRAIN_TIMEOUT_S", "LoopThread", "new_loop", "run_sync", "shared_loop"]

T = TypeVar("T")
log = logging.getLogger("dsio")

DRAIN_TIMEOUT_S = 60.0
"""At exit, how long to let already-submitted work (pending writes) finish before giving up."""

_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_exiting = False
_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; tolerate its absence
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop on its own daemon thread, for synchronous callers.

    ``finalizers`` registered with :meth:`add_finalizer` are coroutine functions run on the loop
    (in reverse order of registration) by :meth:`close` and at interpreter exit, so an object
    that was never closed still flushes and releases what it holds.
    """

    def __init__(self, name: str = "dsio-loop") -> None:
        self.name = name
        self._loop = new_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._closed = False
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._finalizers: dict[int, Callable[[], Awaitable[Any]]] = {}
        self._next_key = 0
        self._thread.start()
        self._ready.wait()
        _live.add(self)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    # -- submitting work -----------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a future for its result."""
        with self._lock:
            if self._closed:
                coro.close()
                from .errors import ClosedError

                raise ClosedError(f"loop thread {self.name!r} is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block for its result (its exception is raised here).

        Calling this from the loop's own thread would deadlock; it raises ``RuntimeError`` instead.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{self.name}: operation did not finish within {timeout} s") from None

    def add_finalizer(self, fn: Callable[[], Awaitable[Any]]) -> int:
        """Register a coroutine function to run on the loop at close/exit; returns a key."""
        with self._lock:
            key = self._next_key
            self._next_key += 1
            self._finalizers[key] = fn
        return key

    def remove_finalizer(self, key: int) -> None:
        with self._lock:
            self._finalizers.pop(key, None)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self, timeout: float | None = DRAIN_TIMEOUT_S) -> None:
        """Let submitted work finish (up to ``timeout``), run finalizers, let tasks that work left
        running finish too (up to ``timeout``, then cancelled), stop the loop, join.

        Never blocks when the interpreter is finalizing or when called on the loop thread itself
        (then the loop is only told to stop).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            finalizers = list(self._finalizers.values())[::-1]
            self._finalizers.clear()
            pending = list(self._pending)
        if sys.is_finalizing() or not self._thread.is_alive():
            return
        if self.in_loop_thread():
            self._loop.call_soon(self._loop.stop)
            return
        if pending:
            _done, not_done = concurrent.futures.wait(pending, timeout)
            if not_done:
                log.warning(
                    "%s: %d operation(s) still running after %.0f s at close",
                    self.name,
                    len(not_done),
                    timeout or 0,
                )
        for fn in finalizers:
            try:
                asyncio.run_coroutine_threadsafe(_call(fn), self._loop).result(timeout)
            except Exception as e:  # a finalizer must not stop the others
                log.warning("%s: finalizer failed at close: %r", self.name, e)
        # Tasks that submitted work started and left running (a background checkpoint save) are
        # work the user asked for: let them finish, bounded, then cancel what is left.
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_settle(self.name, timeout), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(fn: Callable[[], Awaitable[Any]]) -> Any:
    return await fn()


async def _settle(name: str, timeout: float | None) -> None:
    """On the loop: wait (up to ``timeout``) for every other task, then cancel the stragglers."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    if not tasks:
        return
    _done, left = await asyncio.wait(tasks, timeout=timeout)
    if left:
        log.warning(
            "%s: cancelling %d task(s) still running after %.0f s at close", name, len(left), timeout or 0
        )
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=1.0)


def shared_loop() -> LoopThread:
    """The process-wide loop thread (started on first use, restarted if it was closed)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.closed:
            if _exiting:
                from .errors import ClosedError

                raise ClosedError("the interpreter is exiting; no new dsio loop thread")
            _shared = LoopThread("dsio-shared-loop")
        return _shared


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the shared loop thread and return its result (for synchronous callers)."""
    return shared_loop().run(coro, timeout)


def is_exiting() -> bool:
    """True once the interpreter's exit hook has drained the loop threads."""
    return _exiting or sys.is_finalizing()


def _drain_at_exit() -> None:
    global _exiting
    _exiting = True
    for lt in list(_live):
        with contextlib.suppress(Exception):
            lt.close()


# Drain before concurrent.futures shuts its executors down (work being drained may still need
# ``run_in_executor``, e.g. a checkpoint commit's fsyncs): threading's exit hooks run in reverse
# order of registration and before ``atexit``'s, so register after importing its module.
# ``atexit`` stays as a backstop (draining twice is a no-op).
import concurrent.futures.thread  # noqa: E402,F401

with contextlib.suppress(AttributeError, RuntimeError):  # other interpreters / already exiting
    threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
atexit.register(_drain_at_exit)
