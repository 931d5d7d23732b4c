"""DeepSpeed's DeepNVMe surface, written the way DeepSpeed's tutorial uses it."""

import os

import pytest
import torch

from dsio import ShortIOError
from dsio.compat import AsyncIOBuilder, aio_handle


def test_tutorial_script_runs(data_dir):
    h = AsyncIOBuilder().load().aio_handle(1024**2, 128, False, False, 1)
    try:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events()) == (
            1024**2,
            128,
            False,
            False,
        )
        assert h.get_intra_op_parallelism() == 1 and h.get_alignment() == 4096
        n = (8 << 20) // 4
        buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.float32))
        assert buf.dtype == torch.float32 and buf.numel() == n and buf.data_ptr() % 4096 == 0
        assert h.is_pinned(buf)
        buf.copy_(torch.randn(n))
        path = os.path.join(data_dir, "t.pt")
        assert h.sync_pwrite(buf, path) == 1
        back = h.new_cpu_locked_tensor(n, buf)
        assert h.sync_pread(back, path) == 1
        assert torch.equal(back, buf)
        assert h.free_cpu_locked_tensor(back)
    finally:
        h.close()


def test_defaults_match_deepspeed():
    with aio_handle() as h:
        assert h.get_block_size() == 1048576 and h.get_queue_depth() == 128
        assert not h.get_single_submit() and not h.get_overlap_events() and h.get_intra_op_parallelism() == 1


def test_async_ops_and_wait_count(data_dir):
    with aio_handle(intra_op_parallelism=2) as h:
        ts = [torch.randn(1000 + i) for i in range(20)]  # unaligned sizes and addresses
        paths = [os.path.join(data_dir, f"a{i}") for i in range(20)]
        for t, p in zip(ts, paths):
            assert h.async_pwrite(t, p) == 0
        assert h.wait() == 20
        assert h.wait() == 0
        backs = [torch.empty_like(t) for t in ts]
        for b, p in zip(backs, paths):
            h.async_pread(b, p)
        assert h.wait() == 20
        assert all(torch.equal(a, b) for a, b in zip(ts, backs))


def test_pread_pwrite_read_write_validate_offsets(data_dir):
    with aio_handle() as h:
        p = os.path.join(data_dir, "v.bin")
        t = torch.arange(1000, dtype=torch.int32)
        assert h.pwrite(t, p, True, False, 0) == 1
        assert h.pwrite(t[:10], p, True, False, 4000) == 1  # in place at an offset
        assert os.path.getsize(p) == 4040
        assert h.pwrite(t, p, False, **{"async": True}) == 0 and h.wait() == 1
        back = torch.empty_like(t)
        assert h.read(back, p, True) == 0 and torch.equal(back, t)
        assert h.write(t[:5], p, True) == 0
        assert os.path.getsize(p) == 20  # offset 0 replaces: no stale tail, unlike DeepSpeed
        assert h.pread(torch.empty(5, dtype=torch.int32), p, True, False, 0) == 1


def test_unaligned_sizes_work_and_failures_raise(data_dir):
    with aio_handle(intra_op_parallelism=2) as h:
        p = os.path.join(data_dir, "odd.bin")
        t = torch.arange(1000, dtype=torch.uint8)  # DeepSpeed: 0-byte file, reported success
        h.sync_pwrite(t, p)
        assert os.path.getsize(p) == 1000
        with pytest.raises(ShortIOError):  # DeepSpeed: assert kills the process
            h.sync_pread(torch.empty(2000, dtype=torch.uint8), p)
        h.async_pread(torch.empty(4000, dtype=torch.uint8), p)
        h.async_pread(torch.empty(1000, dtype=torch.uint8), p)
        with pytest.raises(ShortIOError):
            h.wait()
        with pytest.raises(FileNotFoundError):
            h.sync_pread(t, os.path.join(data_dir, "missing"))


def test_async_pwrite_to_caller_fd(data_dir):
    p = os.path.join(data_dir, "fd.bin")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with aio_handle() as h:
            h.async_pwrite(torch.ones(100, dtype=torch.uint8), fd, 4096)
            assert h.wait() == 1
        assert os.path.getsize(p) == 4196
    finally:
        os.close(fd)


def test_handles_share_dsios_one_uvloop_thread(data_dir):
    """No private loop thread per handle: every aio_handle runs on the bridge's shared loop."""
    import threading

    from dsio._bridge import shared_loop

    before = {t.name for t in threading.enumerate()}
    a, b = aio_handle(), aio_handle()
    try:
        assert a._lt is b._lt is shared_loop()
        pytest.importorskip("uvloop")
        assert type(a._lt.loop).__module__.startswith("uvloop")
        t = torch.ones(5000)
        a.async_pwrite(t, os.path.join(data_dir, "u.bin"))
        assert a.wait() == 1
        new = {t.name for t in threading.enumerate()} - before
        assert not any("compat" in n for n in new), new
    finally:
        a.close()
        b.close()
    assert shared_loop() is a._lt and not a._lt.closed  # closing a handle leaves the shared loop running


@pytest.mark.parametrize("block_size", [1, 512, 1000, 1024, 4097, 3 << 20])
def test_any_positive_block_size_deepspeed_accepts_works(data_dir, block_size):
    """DeepSpeed's own tests use block_size=1024; any positive size is accepted and reported back,
    while the engine's pieces stay aligned for O_DIRECT."""
    with aio_handle(block_size, 8, False, False, 2) as h:
        assert h.get_block_size() == block_size
        engine_block = h.handle.config.block_size
        assert engine_block >= max(block_size, 4096) and engine_block & (engine_block - 1) == 0
        p = os.path.join(data_dir, "bs.bin")
        locked = h.new_cpu_locked_tensor((1 << 20) + 4096, torch.empty(0, dtype=torch.uint8))
        locked.copy_(torch.randint(0, 256, locked.shape, dtype=torch.uint8))
        odd = torch.randn(12_345)[1:]  # unaligned address and size
        h.sync_pwrite(locked, p)
        h.async_pwrite(odd, p + ".odd")
        assert h.wait() == 1
        back, back_odd = torch.empty_like(locked), torch.empty_like(odd)
        h.sync_pread(back, p)
        h.async_pread(back_odd, p + ".odd")
        assert h.wait() == 1
        assert torch.equal(back, locked) and torch.equal(back_odd, odd)


@pytest.mark.parametrize("block_size", [0, -1024, 1.5, "1M"])
def test_a_block_size_deepspeed_refuses_too_is_a_config_error(block_size):
    import dsio

    with pytest.raises(dsio.ConfigError) as ei:
        aio_handle(block_size)
    assert ei.value.field == "block_size"


def test_async_pwrite_and_pread_take_the_callers_fd_by_keyword(data_dir):
    p = os.path.join(data_dir, "fdkw.bin")
    with open(p, "wb") as f:
        f.write(bytes(range(256)) * 32)  # 8 KiB that must survive around the write
    fd = os.open(p, os.O_RDWR)
    try:
        with aio_handle() as h:
            data = torch.full((100,), 7, dtype=torch.uint8)
            assert h.async_pwrite(data, fd=fd, file_offset=4096) == 0
            assert h.wait() == 1
            back = torch.empty(300, dtype=torch.uint8)
            assert h.async_pread(back, fd=fd, file_offset=4000) == 0
            assert h.wait() == 1
            assert h.sync_pread(torch.empty(10, dtype=torch.uint8), fd=fd) == 1
            with pytest.raises(TypeError):
                h.async_pwrite(data, p, fd=fd)
            with pytest.raises(TypeError):
                h.async_pread(back)
        expect = bytearray(bytes(range(256)) * 32)
        expect[4096:4196] = b"\x07" * 100
        assert os.path.getsize(p) == 8192  # written in place, not truncated
        assert bytes(back.numpy()) == bytes(expect[4000:4300])
        assert os.pread(fd, 8192, 0) == bytes(expect)  # the caller's fd is still open and its own
    finally:
        os.close(fd)


def test_is_pinned_for_views_of_a_locked_buffer_and_buffers_locked_by_another_handle():
    with aio_handle() as a, aio_handle() as b:
        buf = a.new_cpu_locked_tensor(1 << 16, torch.empty(0, dtype=torch.float32))
        for h in (a, b):
            assert h.is_pinned(buf)
            assert h.is_pinned(buf[100:200])  # a slice
            assert h.is_pinned(buf.view(256, 256)[3])  # a view of a row
            assert h.is_pinned(buf.view(torch.uint8)[1:])  # another dtype, odd address
            assert not h.is_pinned(torch.empty(1 << 16))  # ordinary memory
        other = b.new_cpu_locked_tensor(10, torch.empty(0, dtype=torch.float64))
        assert a.is_pinned(other)
        assert b.free_cpu_locked_tensor(other) and not a.is_pinned(other)
        assert b.free_cpu_locked_tensor(buf)  # DeepSpeed's manager is shared: any handle frees
        assert not a.is_pinned(buf[100:200])
