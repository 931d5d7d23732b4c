"""dsio._gather: wait for all, raise the first error (in order), leave nothing running."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc

import pytest

from dsio._gather import all_done, started, wait_all, wait_all_futures


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


async def test_started_stops_starting_at_the_first_failure_and_joins_those_running():
    """``started()``: a producer stops starting pieces once one failed, and the block ends (raising
    the first failure) only after every piece started ended: here piece 1 still writes into its
    buffer when piece 0 fails, and that buffer must not be reused or freed before it is done."""
    buffer = bytearray(4)
    events: list[str] = []

    async def piece(i: int) -> int:
        if i == 0:
            await asyncio.sleep(0.01)
            events.append("0 failed")
            raise OSError(5, "piece 0")
        await asyncio.sleep(0.05)
        buffer[i] = 1  # still writing into the caller's memory after piece 0 failed
        events.append(f"{i} ended")
        return i

    n_started = 0
    with pytest.raises(OSError):
        async with started() as work:
            for i in range(4):
                if work.failed:
                    break
                work.start(piece(i))
                n_started += 1
                await asyncio.sleep(0.02 if i else 0)  # piece 1 starts before piece 0 fails
    events.append("left")
    assert n_started == 2  # piece 2 was never started: piece 0 had failed
    assert events == ["0 failed", "1 ended", "left"]
    assert buffer[1] == 1


async def test_started_lets_the_blocks_own_error_win_once_the_pieces_ended(caplog):
    ended: list[int] = []

    async def piece(i: int) -> int:
        await asyncio.sleep(0.02)
        ended.append(i)
        if i == 1:
            raise OSError(5, "piece 1")
        return i

    with pytest.raises(KeyError):
        async with started() as work:
            work.start(piece(0))
            work.start(piece(1))
            raise KeyError("the producer's own failure")
    assert sorted(ended) == [0, 1]  # both ran to their end, neither was cancelled
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_started_with_no_failure_and_a_cancelled_producer():
    async with started() as work:
        work.start(_ok(1, 0.01))
        work.start(_ok(2))
    assert [f.result() for f in work.futures] == [1, 2]

    ended: list[str] = []

    async def io() -> int:
        await asyncio.sleep(0.05)
        ended.append("io")
        return 1

    async def producer() -> None:
        async with started() as w:
            w.start(io())
            await asyncio.sleep(10)  # e.g. waiting for a free buffer

    task = asyncio.ensure_future(producer())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["io"]  # drained, not cancelled


def test_all_done_waits_for_every_future_and_hands_back_the_rest():
    """The non-blocking combinator: done only when every future is (piece 0 fails while piece 1 is
    still reading into its buffer), the first failure in order, the other results discarded."""
    a: concurrent.futures.Future[str] = concurrent.futures.Future()
    b: concurrent.futures.Future[str] = concurrent.futures.Future()
    discarded: list[str] = []
    out = all_done([a, b], discard=discarded.append)
    a.set_exception(OSError(5, "piece 0"))
    assert not out.done()  # piece 1 still in flight: its buffer is not free yet
    b.set_result("lease 1")
    assert out.done() and isinstance(out.exception(), OSError)
    assert discarded == ["lease 1"]

    c: concurrent.futures.Future[str] = concurrent.futures.Future()
    d: concurrent.futures.Future[str] = concurrent.futures.Future()
    out = all_done([c, d], discard=discarded.append)
    d.set_exception(ValueError("second in order, first in time"))
    c.set_exception(KeyError("first in order"))
    assert isinstance(out.exception(), KeyError)

    e: concurrent.futures.Future[str] = concurrent.futures.Future()
    f: concurrent.futures.Future[str] = concurrent.futures.Future()
    out = all_done([e, f])
    f.set_result("f")
    e.set_result("e")
    assert out.result() == ["e", "f"]
    assert all_done([]).result() == []

    g: concurrent.futures.Future[str] = concurrent.futures.Future()
    h: concurrent.futures.Future[str] = concurrent.futures.Future()
    out = all_done([g, h], discard=discarded.append)
    g.cancel()
    h.set_result("lease h")
    assert out.cancelled() and discarded[-1] == "lease h"
    concurrent.futures.wait([out], timeout=1)  # a waiter sees the cancellation


def test_all_done_is_done_even_when_a_discard_raises(caplog):
    """A discard that raises (the swapper closed under a shard read) must not leave the combined
    future pending forever: the other results are still discarded, the piece's failure is raised."""
    a: concurrent.futures.Future[str] = concurrent.futures.Future()
    b: concurrent.futures.Future[str] = concurrent.futures.Future()
    c: concurrent.futures.Future[str] = concurrent.futures.Future()
    discarded: list[str] = []

    def discard(lease: str) -> None:
        if lease == "lease b":
            raise RuntimeError("pool closed")
        discarded.append(lease)

    out = all_done([a, b, c], discard=discard)
    a.set_exception(OSError(5, "piece 0"))
    b.set_result("lease b")
    c.set_result("lease c")
    assert out.done() and isinstance(out.exception(timeout=0), OSError)
    assert discarded == ["lease c"]
    assert "discarding a result failed" in caplog.text


def test_a_cancelled_all_done_hands_every_result_back():
    """Cancelling the combined future stops no piece (a read still fills its buffer); once they are
    all done, every result goes to ``discard``, since no one will take them, and waiters see the
    cancellation."""
    a: concurrent.futures.Future[str] = concurrent.futures.Future()
    b: concurrent.futures.Future[str] = concurrent.futures.Future()
    discarded: list[str] = []
    out = all_done([a, b], discard=discarded.append)
    assert out.cancel()
    a.set_result("lease a")
    b.set_result("lease b")
    assert discarded == ["lease a", "lease b"]
    done, _ = concurrent.futures.wait([out], timeout=1)
    assert done == {out} and out.cancelled()
    c: concurrent.futures.Future[str] = concurrent.futures.Future()
    d: concurrent.futures.Future[str] = concurrent.futures.Future()
    out = all_done([c, d], discard=discarded.append)
    out.cancel()
    c.set_exception(OSError(5, "piece 0"))
    d.set_result("lease d")
    assert discarded[-1] == "lease d" and out.cancelled()
