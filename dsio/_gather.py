"""Wait for all, raise the first error, leave nothing running: the one way dsio joins work.

``asyncio.gather`` returns at the first exception while the other awaitables keep running, and
cancelling it mid-way leaves no record of what finished; hand-written ``asyncio.wait`` loops did
this right in some places and not in others. Here:

- every awaitable runs to its end, even after one failed (nothing half-done is left behind,
  every exception is retrieved: no "exception was never retrieved" warnings);
- the first failure *in submission order* is raised (deterministic), after all are done;
- if the waiting task is cancelled, the awaitables are cancelled and waited for before the
  cancellation propagates (structured concurrency: nothing outlives the call).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

__all__ = ["first_error", "wait_all", "wait_all_futures"]

T = TypeVar("T")


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
