"""Child processes for test_exit.py: each scenario uses a dsio object and ends WITHOUT closing it.

``python _exit_scenarios.py SCENARIO DIR``: prints ``READY`` when its body is done, waits for
one line on stdin (so the parent can start every exit at once, after every slow torch import),
then the interpreter exits on its own. The parent checks the exit status, how long the exit took, and
that every write the scenario started is on disk in ``DIR`` (``expected_<name>`` files hold the
bytes each ``<name>`` file must contain).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys

import torch


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _expect(d: str, name: str, t: torch.Tensor) -> str:
    with open(os.path.join(d, "expected_" + name), "wb") as f:
        f.write(t.numpy().tobytes())
    return os.path.join(d, name)


def compat_open(d: str) -> None:
    """DeepSpeed style: a handle, async writes never waited for, never closed."""
    from dsio.compat import AsyncIOBuilder

    h = AsyncIOBuilder().load().aio_handle()
    for i, n in enumerate((8 << 20, (4 << 20) + 1000, 12345)):  # aligned, staged, tiny
        t = _data(n, i)
        h.async_pwrite(t, _expect(d, f"w{i}", t))
    globals()["keep"] = h  # alive until interpreter teardown


def compat_del(d: str) -> None:
    """``del h`` mid-script with async writes pending, then GC of a handle on the loop thread."""
    from dsio._bridge import run_sync
    from dsio.compat import aio_handle

    h = aio_handle(intra_op_parallelism=2)
    for i in range(3):
        t = _data(6 << 20, 10 + i)
        h.async_pwrite(t, _expect(d, f"d{i}", t))
    del h  # __del__ -> close(): the writes finish first
    gc.collect()

    holder = [aio_handle()]
    t = _data(3 << 20, 20)
    holder[0].async_pwrite(t, _expect(d, "loopgc", t))

    async def drop_on_loop() -> None:
        holder.clear()  # the last reference dies on the loop thread
        gc.collect()

    run_sync(drop_on_loop(), timeout=30)


def handle_bridge(d: str) -> None:
    """An AsyncIOHandle on the shared loop thread, a write submitted and never awaited."""
    from dsio import AsyncIOHandle
    from dsio._bridge import run_sync, shared_loop

    h = AsyncIOHandle()
    t0 = _data(1 << 20, 30)
    run_sync(h.pwrite(t0, _expect(d, "b0", t0)))
    t1 = _data(16 << 20, 31)
    shared_loop().submit(h.pwrite(t1, _expect(d, "b1", t1)))
    globals()["keep"] = h


def handle_asyncio(d: str) -> None:
    """An AsyncIOHandle used under asyncio.run and left open, plus one dropped on its loop."""
    from dsio import AsyncIOHandle

    async def main() -> AsyncIOHandle:
        h = AsyncIOHandle()
        t = _data(2 << 20, 40)
        await h.pwrite(t, _expect(d, "a0", t))
        other = AsyncIOHandle()
        t2 = _data(1 << 20, 41)
        await other.pwrite(t2, _expect(d, "a1", t2))
        del other
        gc.collect()  # collected on the loop it is bound to
        return h

    globals()["keep"] = asyncio.run(main())


def metrics_server(d: str) -> None:
    """The exporter left serving, with a tracked handle."""
    import urllib.request

    from dsio import AsyncIOHandle, metrics

    srv = metrics.serve(port=0)
    h = AsyncIOHandle()
    body = urllib.request.urlopen(srv.url, timeout=30).read()
    assert b"dsio_requests_total" in body
    globals()["keep"] = (srv, h)


def checkpointer(d: str) -> None:
    """A Checkpointer on the bridge: one save committed, a second left running, never closed."""
    from dsio._bridge import run_sync
    from dsio.checkpoint import Checkpointer

    ck = Checkpointer(os.path.join(d, "ck"), keep_last=2)
    run_sync(_save_and_wait(ck, 1))
    task = run_sync(ck.save(2, {"x": _data(4 << 20, 2)}))  # a background save, not awaited
    globals()["keep"] = (ck, task)


async def _save_and_wait(ck, step: int) -> None:
    task = await ck.save(step, {"x": _data(4 << 20, step)})
    await task


def control(d: str) -> None:
    """Imports what the others import and uses nothing: the machine's own exit time, for comparison."""
    import dsio.checkpoint
    import dsio.compat
    import dsio.metrics  # noqa: F401


SCENARIOS = {
    f.__name__: f
    for f in (control, compat_open, compat_del, handle_bridge, handle_asyncio, metrics_server, checkpointer)
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2])
    print("READY", flush=True)
    sys.stdin.readline()
