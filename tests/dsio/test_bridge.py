"""dsio._bridge: the one sync -> asyncio bridge, and exit safety of loop threads left open."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dsio._bridge import LoopThread, run_sync, shared_loop
from dsio.errors import ClosedError


def test_run_returns_result_and_raises_exceptions() -> None:
    with LoopThread("t") as lt:
        assert lt.run(asyncio.sleep(0, result=7)) == 7

        async def boom() -> None:
            raise KeyError("x")

        with pytest.raises(KeyError):
            lt.run(boom())


def test_runs_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    with LoopThread("t") as lt:
        assert isinstance(lt.loop, uvloop.Loop)


def test_close_waits_for_submitted_work_and_runs_finalizers() -> None:
    lt = LoopThread("t")
    done: list[str] = []

    async def slow() -> None:
        await asyncio.sleep(0.2)
        done.append("work")

    async def fin() -> None:
        done.append("finalizer")

    lt.add_finalizer(fin)
    lt.submit(slow())
    lt.close()
    assert done == ["work", "finalizer"]
    with pytest.raises(ClosedError):
        lt.submit(asyncio.sleep(0))


def test_run_from_loop_thread_raises_instead_of_deadlocking() -> None:
    with LoopThread("t") as lt:

        async def inner() -> None:
            lt.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError):
            lt.run(inner())


def test_run_timeout() -> None:
    with LoopThread("t") as lt, pytest.raises(TimeoutError):
        lt.run(asyncio.sleep(5), timeout=0.1)


def test_shared_loop_is_one_thread_and_restarts_after_close() -> None:
    a = shared_loop()
    assert shared_loop() is a
    assert run_sync(asyncio.sleep(0, result=1)) == 1
    a.close()
    b = shared_loop()
    assert b is not a and run_sync(asyncio.sleep(0, result=2)) == 2


def test_close_from_loop_thread_does_not_deadlock() -> None:
    lt = LoopThread("t")

    async def closer() -> None:
        lt.close()

    lt.submit(closer()).result(5)
    lt._thread.join(5)
    assert not lt._thread.is_alive()


def test_process_exits_promptly_with_loop_left_open_and_flushes_work(tmp_path) -> None:
    out = tmp_path / "flushed"
    code = textwrap.dedent(
        f"""
        import asyncio
        from dsio._bridge import LoopThread, shared_loop
        lt = LoopThread("left-open")
        async def late_write():
            await asyncio.sleep(0.3)
            open({str(out)!r}, "w").write("ok")
        lt.submit(late_write())
        shared_loop().submit(asyncio.sleep(0))
        class Owner:
            def __del__(self):
                lt.close()
        keep = Owner()
        print("ready", flush=True)
        """
    )
    # The 10 s bound is on the exit itself: importing torch alone can take longer on a loaded machine.
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if p.stdout.readline().strip() != "ready":
        p.kill()
        pytest.fail(f"the child failed before its body ended: {p.communicate()[1]}")
    t0 = time.monotonic()
    try:
        _out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("the process hung at exit")
    assert p.returncode == 0, err
    assert time.monotonic() - t0 < 10
    assert out.read_text() == "ok"
    assert threading.active_count() >= 1
