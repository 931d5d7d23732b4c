import asyncio

import pytest
import torch

from dsio import ClosedError, ConfigError, PinnedPool, PoolBusyError


def test_buffers_are_aligned_locked_views():
    with PinnedPool(4 * 8192, 8192) as pool:
        st = pool.statistics()
        assert st.buffers == 4 and st.buffer_bytes == 8192 and st.locked
        lease = pool.try_acquire()
        assert lease is not None and lease.ptr % 4096 == 0
        assert lease.tensor.dtype == torch.uint8 and lease.tensor.numel() == 8192
        lease.release()
        with pytest.raises(RuntimeError):
            lease.release()


async def test_backpressure_and_statistics():
    pool = PinnedPool(2 * 4096, 4096)
    order = []

    async def user(i):
        async with pool.buffer() as buf:
            buf.fill_(i)
            order.append(("in", i))
            await asyncio.sleep(0.01)
            assert bool((buf == i).all())  # nobody else got this buffer meanwhile
            order.append(("out", i))

    await asyncio.gather(*(user(i) for i in range(6)))
    st = pool.statistics()
    assert st.acquired_total == 6 and st.waited_total == 4 and st.in_use == 0 and st.waiters == 0
    # never more than two inside at once
    inside = peak = 0
    for kind, _ in order:
        inside += 1 if kind == "in" else -1
        peak = max(peak, inside)
    assert peak == 2
    pool.close()


def test_close_refuses_while_out_and_views_survive():
    pool = PinnedPool(2 * 4096, 4096)
    lease = pool.try_acquire()
    with pytest.raises(PoolBusyError):
        pool.close()
    view = lease.tensor
    view.fill_(7)
    lease.release()
    pool.close()
    with pytest.raises(ClosedError):
        pool.try_acquire()
    assert int(view.sum()) == 7 * 4096  # memory lives as long as a view does


async def test_cancelled_waiter_does_not_lose_a_buffer():
    pool = PinnedPool(4096, 4096)
    first = await pool.acquire()
    waiter = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    first.release()
    await asyncio.sleep(0)
    assert pool.statistics().in_use == 0
    again = await asyncio.wait_for(pool.acquire(), 1)
    again.release()


def test_bad_sizes():
    with pytest.raises(ConfigError):
        PinnedPool(4096, 1000)
    with pytest.raises(ConfigError):
        PinnedPool(4096, 8192)
