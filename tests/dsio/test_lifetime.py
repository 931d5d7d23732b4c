"""No leaks, safe cancellation, clean close."""

import asyncio
import contextlib
import gc
import os
import time

import torch
from _dsio_helpers import open_fds, user_threads

import dsio


def _settle(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def test_no_leaks_after_10000_ops(backend, data_dir):
    gc.collect()
    fds0, threads0 = open_fds(), user_threads()

    async def main():
        async with dsio.AsyncIOHandle(backend=backend, intra_op_parallelism=2, queue_depth=16) as h:
            t_aligned = torch.frombuffer(dsio._C.AlignedBuffer(8192, True), dtype=torch.uint8)
            t_plain = torch.ones(5000, dtype=torch.uint8)
            path = os.path.join(data_dir, "leak.bin")
            async with h.open(path, "w+") as f:
                for _round in range(40):
                    tensors = [t_aligned if i % 2 else t_plain for i in range(100)]
                    await asyncio.gather(*(f.pwrite(t, offset=i * 16384) for i, t in enumerate(tensors)))
                    await asyncio.gather(*(f.pread(t, offset=i * 16384) for i, t in enumerate(tensors)))
            for i in range(2000):  # path ops open and close fds each time
                await (h.pwrite(t_plain, path) if i % 2 else h.pread(t_plain, path))
            st = h.statistics()
            assert st.reads + st.writes == 10000 and st.errors == 0
            assert st.pool.in_use == 0
            assert open_fds() > fds0  # engine eventfd + rings are open while the handle lives

    asyncio.run(main())
    gc.collect()
    assert open_fds() == fds0
    assert _settle(lambda: user_threads() == threads0), (user_threads(), threads0)


async def test_cancel_holds_buffers_until_io_completes(data_dir):
    path = os.path.join(data_dir, "c.bin")
    cfg = dsio.IOConfig(pool_bytes=4 << 20, staging_buffer_bytes=1 << 20, queue_depth=1, block_size=4096)
    async with dsio.AsyncIOHandle(cfg) as h:
        src = torch.randn(8 << 20)  # unaligned memory: staged through the pool
        await h.pwrite(src, path)
        dst = torch.empty_like(src)
        task = asyncio.create_task(h.pread(dst, path))
        for _ in range(1000):  # let it get buffers in flight
            await asyncio.sleep(0)
            if h.statistics().pool.in_use:
                break
        assert h.statistics().pool.in_use > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The kernel may still be writing into pool buffers: they must not be free yet...
        held = h.statistics().pool.in_use
        assert held > 0 or h.statistics().engine.in_flight == 0
        # ...and they come back once the I/O drains.
        for _ in range(2000):
            if h.statistics().engine.in_flight == 0:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)
        assert h.statistics().pool.in_use == 0
        back = torch.empty_like(src)  # the handle still works
        await h.pread(back, path)
        assert torch.equal(back, src)


async def test_close_waits_for_in_flight(data_dir):
    h = dsio.AsyncIOHandle(queue_depth=1, block_size=4096)
    t = torch.randn(1 << 20)
    fut = asyncio.ensure_future(h.pwrite(t, os.path.join(data_dir, "w.bin")))
    await asyncio.sleep(0)
    await h.aclose()
    assert fut.done() and fut.result() == t.nbytes
    assert os.path.getsize(os.path.join(data_dir, "w.bin")) == t.nbytes


def test_dropped_handle_is_collected(data_dir):
    gc.collect()
    fds0, threads0 = open_fds(), user_threads()
    h = dsio.AsyncIOHandle(intra_op_parallelism=4)
    assert user_threads() >= threads0 + 4
    del h
    gc.collect()
    assert open_fds() == fds0
    assert _settle(lambda: user_threads() == threads0)


async def test_close_while_staged_writes_wait_for_buffers_gives_closed_error(data_dir):
    """Writes from unaligned memory queue for the pool's 2 buffers; close() then hands every
    waiter ClosedError (never IndexError from a buffer handed over just before the close)."""
    kinds: dict[str, int] = {}
    for _rep in range(3):
        h = dsio.AsyncIOHandle(pool_bytes=2 * 65536, staging_buffer_bytes=65536)
        t = torch.ones((1 << 22) + 1, dtype=torch.uint8)[1:]  # unaligned address: staged
        tasks = [asyncio.ensure_future(h.pwrite(t, os.path.join(data_dir, f"s{i}"))) for i in range(8)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert h.statistics().pool.waiters > 0  # the scenario under test: tasks wait for buffers
        h.close()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            kinds[type(r).__name__] = kinds.get(type(r).__name__, 0) + 1
            assert isinstance(r, int | dsio.ClosedError), repr(r)
    assert kinds.get("ClosedError", 0) > 0
