"""Probing, fallback with a logged reason, and what single_submit / overlap_events do."""

import asyncio
import errno
import logging
import os

import pytest
import torch
from _dsio_helpers import AVAILABLE, aligned_tensor, fill_random

import dsio
from dsio import BackendUnavailableError, _backends


def test_status_lists_every_backend_with_reasons():
    st = {s.name: s for s in dsio.backend_status()}
    assert set(st) == {"io_uring", "aio", "posix"}
    assert st["posix"].available
    for s in st.values():
        assert s.available == (s.reason == "")


def test_the_kernel_is_probed_once_per_process_and_the_disable_list_read_each_call(monkeypatch):
    # every dstrain.initialize asks (its checkpoint store); a probe is ~35 ms of waiting (io_destroy)
    calls = []

    class Probes:  # stands in for dsio._C: counts the kernel probes
        def probe_io_uring(self):
            calls.append("io_uring")
            return 0

        def probe_aio(self):
            calls.append("aio")
            return -errno.ENOSYS

    monkeypatch.setattr(_backends, "native", Probes)
    _backends._probe.cache_clear()
    try:
        first = {s.name: s for s in dsio.backend_status()}
        again = {s.name: s for s in dsio.backend_status()}
        monkeypatch.setenv("DSIO_DISABLE_BACKENDS", "io_uring")
        disabled = {s.name: s for s in dsio.backend_status()}
    finally:
        _backends._probe.cache_clear()  # the real core's answers for the tests after this one
    assert sorted(calls) == ["aio", "io_uring"]  # once each, for three calls
    assert first == again
    assert (
        first["io_uring"].available
        and not first["aio"].available
        and "kernel built without" in first["aio"].reason
    )
    assert (
        not disabled["io_uring"].available
        and disabled["io_uring"].reason == "disabled by DSIO_DISABLE_BACKENDS"
    )


def test_auto_falls_back_and_logs_why(monkeypatch, caplog, data_dir):
    monkeypatch.setenv("DSIO_DISABLE_BACKENDS", "io_uring,aio")
    monkeypatch.setattr(_backends, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="dsio"):
        h = dsio.AsyncIOHandle()
    assert h.backend == "posix"
    assert "io_uring: disabled" in caplog.text and "aio: disabled" in caplog.text

    async def main():
        t = torch.arange(10000, dtype=torch.int16)
        await h.pwrite(t, os.path.join(data_dir, "p.bin"))
        back = torch.empty_like(t)
        await h.pread(back, os.path.join(data_dir, "p.bin"))
        assert torch.equal(back, t)

    asyncio.run(main())
    h.close()


def test_explicit_backend_unavailable_is_an_error(monkeypatch):
    monkeypatch.setenv("DSIO_DISABLE_BACKENDS", "io_uring")
    with pytest.raises(BackendUnavailableError):
        dsio.AsyncIOHandle(backend="io_uring")


@pytest.mark.skipif(not AVAILABLE["io_uring"].available, reason="io_uring unavailable")
@pytest.mark.parametrize("backend", ["io_uring", "aio"])
def test_single_submit_means_one_syscall_per_piece(backend, data_dir):
    if not AVAILABLE[backend].available:
        pytest.skip(f"{backend} unavailable: {AVAILABLE[backend].reason}")
    n = 64 * 4096

    async def main(single):
        async with dsio.AsyncIOHandle(
            backend=backend, block_size=4096, queue_depth=64, single_submit=single
        ) as h:
            t = fill_random(aligned_tensor(n))
            await h.pwrite(t, os.path.join(data_dir, "s.bin"))
            return h.statistics().engine

    single = asyncio.run(main(True))
    batched = asyncio.run(main(False))
    assert single.pieces == batched.pieces == 64
    assert single.submit_syscalls == 64
    assert batched.submit_syscalls < 64


@pytest.mark.parametrize("backend", ["io_uring", "aio"])
def test_overlap_events_false_is_lockstep(backend, data_dir):
    """Lock-step waits for whole batches: the number of waits is pieces / queue_depth."""
    if not AVAILABLE[backend].available:
        pytest.skip(f"{backend} unavailable: {AVAILABLE[backend].reason}")
    n = 64 * 4096

    async def main(overlap):
        cfg = dsio.IOConfig(backend=backend, block_size=4096, queue_depth=8, overlap_events=overlap)
        async with dsio.AsyncIOHandle(cfg) as h:
            t = fill_random(aligned_tensor(n))
            p = os.path.join(data_dir, "o.bin")
            await h.pwrite(t, p)
            back = aligned_tensor(n)
            await h.pread(back, p)
            assert torch.equal(back, t)
            return h.statistics().engine

    lock = asyncio.run(main(False))
    assert lock.submit_syscalls == 2 * 64 // 8  # one submit per batch of 8, writes and reads
    over = asyncio.run(main(True))
    assert over.pieces == lock.pieces == 128


@pytest.mark.parametrize("backend", ["io_uring", "aio"])
def test_overlap_events_true_refills_as_pieces_complete(backend, data_dir):
    """The default (overlap_events=True) must really slide its window: a worker refills its queue
    as pieces complete, so a write of N pieces takes more than N / queue_depth submissions, while
    lock-step takes exactly N / queue_depth. Fails if overlap_events is ignored either way (the
    engine forced into lock-step gives exactly N / queue_depth for both)."""
    if not AVAILABLE[backend].available:
        pytest.skip(f"{backend} unavailable: {AVAILABLE[backend].reason}")
    pieces, depth = 2048, 16  # 8 MiB in 4 KiB pieces, one worker

    async def submits(overlap: bool, rep: int) -> int:
        cfg = dsio.IOConfig(
            backend=backend,
            block_size=4096,
            queue_depth=depth,
            intra_op_parallelism=1,
            overlap_events=overlap,
        )
        async with dsio.AsyncIOHandle(cfg) as h:
            t = fill_random(aligned_tensor(pieces * 4096))
            await h.pwrite(t, os.path.join(data_dir, f"ov{int(overlap)}-{rep}.bin"))  # a fresh file each time
            st = h.statistics().engine
            assert st.pieces == pieces
            return st.submit_syscalls

    lock, over = [], []
    for rep in range(3):  # interleaved, so both modes see the same disk weather
        lock.append(asyncio.run(submits(False, rep)))
        over.append(asyncio.run(submits(True, rep)))
    assert lock == [pieces // depth] * 3
    assert sum(over) > 3 * (pieces // depth), over  # measured here: 300-1700 per write vs 128


@pytest.fixture
def ramfs_dir(tmp_path):
    """A ramfs mount: a real filesystem without O_DIRECT (tmpfs has it since Linux 6.6).

    Root mounts it directly; other users run the test in `unshare -Urm` (tests/_mount.py)."""
    from _mount import mounted

    with mounted(tmp_path / "ramfs", "ramfs") as d:
        yield str(d)


@pytest.mark.needs_mount
async def test_filesystem_without_o_direct_falls_back_with_a_logged_reason(monkeypatch, caplog, ramfs_dir):
    monkeypatch.setattr(_backends, "_warned", set())
    path = os.path.join(ramfs_dir, "t.bin")

    async with dsio.AsyncIOHandle() as h:
        t = torch.arange(10_000, dtype=torch.float32)
        with caplog.at_level(logging.WARNING, logger="dsio"):
            await h.pwrite(t, path)
            async with h.open(path, "r") as f:
                assert not f.direct
        back = torch.empty_like(t)
        await h.pread(back, path)
        assert torch.equal(back, t)
        assert h.statistics().buffered_bytes >= 2 * t.nbytes and h.statistics().direct_bytes == 0
    assert "O_DIRECT not supported" in caplog.text
