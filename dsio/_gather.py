"""Wait for all, raise the first error, leave nothing running: the one way dsio joins work.

``asyncio.gather`` returns at the first exception while the other awaitables keep running, and
cancelling it mid-way leaves no record of what finished; hand-written ``asyncio.wait`` loops did
this right in some places and not in others. Here:

- every awaitable runs to its end, even after one failed (nothing half-done is left behind,
  every exception is retrieved: no "exception was never retrieved" warnings);
- the first failure *in submission order* is raised (deterministic), after all are done;
- if the waiting task is cancelled, the awaitables are cancelled and waited for before the
  cancellation propagates (structured concurrency: nothing outlives the call).

Three shapes of the one rule: `wait_all` (awaitables known up front), `Started` (a producer that
starts pieces one by one and stops starting them at the first failure, e.g. chunks that each need a
buffer), and `all_done` / `wait_all_futures` for ``concurrent.futures`` (non-blocking / blocking).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, Generic, TypeVar

__all__ = ["Started", "all_done", "first_error", "started", "wait_all", "wait_all_futures"]

T = TypeVar("T")

log = logging.getLogger("dsio")


def first_error(
    futures: Iterable[asyncio.Future[Any] | concurrent.futures.Future[Any]],
) -> BaseException | None:
    """The first exception among finished ``futures`` in order (cancellations skipped); reading
    each one marks it retrieved."""
    first: BaseException | None = None
    for f in futures:
        if f.cancelled():
            continue
        exc = f.exception()
        if exc is not None and first is None:
            first = exc
    return first


async def wait_all(aws: Iterable[Awaitable[T]], *, drain: bool = False) -> list[T]:
    """Run ``aws`` concurrently until every one is done; return their results in order, or raise
    the first failure (in order) once all are done.

    Cancelling the caller cancels them all and waits for them before re-raising
    ``CancelledError``. With ``drain=True`` they are *not* cancelled but waited for to their end
    (for work that cannot be recalled once started, such as kernel I/O requests: cancelling their
    futures would only stop us watching while the kernel still reads or writes the memory);
    the cancellation propagates once the last one is done.
    """
    futs = [asyncio.ensure_future(a) for a in aws]
    if not futs:
        return []
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.wait(futs)
            break
        except asyncio.CancelledError as e:
            cancelled = cancelled or e
            if not drain:
                for f in futs:
                    f.cancel()
    if cancelled is not None:
        first_error(futs)  # retrieve what failed meanwhile
        raise cancelled
    exc = first_error(futs)
    if exc is not None:
        raise exc
    return [f.result() for f in futs]


class Started(Generic[T]):
    """The pieces a producer has started so far (`started`); ``failed`` says one ended in error,
    the cue to start no more."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[T]] = []

    def start(self, aw: Awaitable[T]) -> asyncio.Future[T]:
        fut = asyncio.ensure_future(aw)
        self.futures.append(fut)
        return fut

    @property
    def failed(self) -> bool:
        return any(f.done() and not f.cancelled() and f.exception() is not None for f in self.futures)


@asynccontextmanager
async def started() -> AsyncIterator[Started[Any]]:
    """Start pieces one by one and stop at the first failure, still joining every one started::

        async with started() as work:
            for piece in pieces:
                if work.failed:
                    break  # start no more; those running are still waited for
                work.start(do(piece, await pool.acquire()))

    On leaving, every started piece is waited for to its end (never cancelled: like
    ``wait_all(drain=True)``, for work that cannot be recalled, such as I/O into a buffer), then
    the block's own exception propagates (e.g. the caller's cancellation), else the first failure
    in start order."""
    work: Started[Any] = Started()
    try:
        yield work
    except BaseException:
        # every piece's error retrieved; the block's own exception wins
        with suppress(BaseException):
            await wait_all(work.futures, drain=True)
        raise
    await wait_all(work.futures, drain=True)


def all_done(
    futures: Sequence[concurrent.futures.Future[T]], *, discard: Callable[[T], Any] | None = None
) -> concurrent.futures.Future[list[T]]:
    """The non-blocking twin of `wait_all_futures`: one future, done when every one of
    ``futures`` is done, with their results in order or the first failure in order. When one
    failed (or was cancelled, the result is then a cancellation), ``discard`` is called with each
    other one's result (e.g. a buffer read for nothing goes back to its pool). A ``discard`` that
    raises (e.g. the pool's owner is closed) is logged and the rest are still discarded: the future
    is done either way, with the failure that caused the discards. Cancelling the returned future
    stops no piece; their results are discarded once all are done (nobody will take them)."""
    out: concurrent.futures.Future[list[T]] = concurrent.futures.Future()
    futs = list(futures)
    left = [len(futs)]
    lock = threading.Lock()

    def finish() -> None:
        exc = first_error(futs)
        if exc is None and not any(f.cancelled() for f in futs):
            try:
                out.set_result([f.result() for f in futs])
                return
            except concurrent.futures.InvalidStateError:  # the caller cancelled it: hand them back
                pass
        if discard is not None:
            for f in futs:
                if not f.cancelled() and f.exception() is None:
                    try:
                        discard(f.result())
                    except Exception:  # (raised in a done callback, it would leave `out` pending)
                        log.warning("all_done: discarding a result failed", exc_info=True)
        if out.cancelled():
            out.set_running_or_notify_cancel()  # (its waiters see the caller's cancellation)
        elif exc is not None:
            out.set_exception(exc)
        else:
            out.cancel()
            out.set_running_or_notify_cancel()

    def done(_: concurrent.futures.Future[T]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        finish()

    if not futs:
        out.set_result([])
    for f in futs:
        f.add_done_callback(done)
    return out


def wait_all_futures(
    futures: Iterable[concurrent.futures.Future[T]], timeout: float | None = None
) -> list[T]:
    """The blocking twin for ``concurrent.futures`` (e.g. work submitted to a loop thread):
    wait for every one, then raise the first failure in order, else return the results.
    ``timeout``: seconds to wait at most; ``TimeoutError`` (saying how many are still running)
    when some are not done by then."""
    futs = list(futures)
    if futs:
        _, not_done = concurrent.futures.wait(futs, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} of {len(futs)} still running after {timeout} s")
    exc = first_error(futs)
    if exc is not None:
        raise exc
    return [f.result() for f in futs]
