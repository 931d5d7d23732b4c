"""dsio._gather: wait for all, raise the first error (in order), leave nothing running."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc

import pytest

from dsio._gather import wait_all, wait_all_futures


async def _ok(v: int, delay: float = 0.0) -> int:
    await asyncio.sleep(delay)
    return v


async def _fail(exc: BaseException, delay: float = 0.0) -> int:
    await asyncio.sleep(delay)
    raise exc


async def test_results_in_order():
    assert await wait_all([_ok(1, 0.02), _ok(2), _ok(3, 0.01)]) == [1, 2, 3]
    assert await wait_all([]) == []


async def test_every_awaitable_finishes_before_the_first_error_is_raised():
    finished: list[int] = []

    async def slow() -> int:
        await asyncio.sleep(0.05)
        finished.append(1)
        return 1

    # The later-submitted failure happens first in time; the earlier-submitted one is raised.
    with pytest.raises(KeyError):
        await wait_all([_fail(KeyError("first in order"), 0.03), _fail(ValueError("first in time")), slow()])
    assert finished == [1]  # asyncio.gather would have returned before slow() finished


async def test_cancelling_the_caller_cancels_and_awaits_everything():
    started = asyncio.Event()
    cleaned: list[str] = []

    async def child() -> int:
        try:
            started.set()
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.01)  # cleanup that needs the loop
            cleaned.append("done")
        return 0

    task = asyncio.ensure_future(wait_all([child(), child()]))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["done", "done"]  # nothing left running after the call ended


async def test_no_unretrieved_exceptions(caplog):
    with pytest.raises(OSError):
        await wait_all([_fail(OSError(5, "a")), _fail(OSError(28, "b")), _fail(OSError(5, "c"))])
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


def test_blocking_twin_for_concurrent_futures():
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        assert wait_all_futures([ex.submit(lambda: 1), ex.submit(lambda: 2)]) == [1, 2]
        done: list[int] = []

        def slow() -> int:
            import time

            time.sleep(0.05)
            done.append(1)
            return 1

        def bad() -> int:
            raise RuntimeError("x")

        with pytest.raises(RuntimeError):
            wait_all_futures([ex.submit(bad), ex.submit(slow)])
        assert done == [1]


async def test_drain_waits_for_uncancellable_work_then_propagates_the_cancellation():
    """``drain=True``: work that cannot be recalled (kernel I/O) is not cancelled when the caller
    is; it is waited for to its end, then CancelledError propagates."""
    started = asyncio.Event()
    finished: list[str] = []

    async def io() -> int:
        started.set()
        await asyncio.sleep(0.05)
        finished.append("io")
        return 1

    children = [asyncio.ensure_future(io()), asyncio.ensure_future(io())]
    task = asyncio.ensure_future(wait_all(children, drain=True))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == ["io", "io"]  # ran to their end, not cancelled
    assert not any(c.cancelled() for c in children)


async def test_drain_survives_repeated_cancellation_and_raises_it_after_errors():
    async def bad() -> int:
        await asyncio.sleep(0.03)
        raise OSError(5, "piece failed")

    child = asyncio.ensure_future(bad())
    task = asyncio.ensure_future(wait_all([child, _ok(2, 0.04)], drain=True))
    await asyncio.sleep(0.005)
    task.cancel()
    await asyncio.sleep(0.005)
    task.cancel()  # a second cancel while draining: still waits
    with pytest.raises(asyncio.CancelledError):
        await task
    assert child.done() and not child.cancelled()
