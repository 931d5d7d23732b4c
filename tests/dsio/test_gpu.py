"""CUDA tensors through both GPU paths (cufile, bounce) and the gds_handle; skipped without CUDA."""

import asyncio
import os

import pytest
import torch

import dsio
from dsio import BackendUnavailableError

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="no CUDA device (GPU tests run on the H200 via make gpu-check)"
)


def _cufile_ok() -> tuple[bool, str]:
    if not CUDA:
        return False, "no CUDA"
    from dsio.gpu import gpu_status

    st = gpu_status()
    return st.cufile, st.cufile_reason


def gpu_backends():
    ok, why = _cufile_ok()
    return [
        pytest.param("bounce", id="bounce"),
        pytest.param(
            "cufile", id="cufile", marks=[] if ok else [pytest.mark.skip(reason=f"cuFile unavailable: {why}")]
        ),
    ]


def _skip_unless_cufile_registers(directory) -> None:
    """cuFile opens (gpu_status) but registers files only on filesystems it can identify: on a lent
    machine whose disk lacks udev's ID_FS_USAGE (cufile.log: "unable to get volume attributes") every
    cuFileHandleRegister fails, and dsio rightly raises BackendUnavailableError naming the file. That is
    the platform, not dsio: skip, with the error, only for that registration failure."""

    async def probe() -> None:
        cfg = dsio.IOConfig(gpu_backend="cufile")
        async with dsio.AsyncIOHandle(cfg) as h:
            await h.pwrite(torch.ones(4096, dtype=torch.uint8, device="cuda"), str(directory / "probe.bin"))

    try:
        asyncio.run(probe())
    except BackendUnavailableError as e:
        if "cuFileHandleRegister failed" not in str(e):
            raise
        pytest.skip(f"cuFile cannot register files on this filesystem here: {e}")


SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3, (9 << 20) + 5]
DTYPES = [torch.uint8, torch.float32, torch.bfloat16, torch.int64]
OFFSETS = [None, 0, 4096, 4099]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gpu_backend", gpu_backends())
def test_cuda_roundtrip_matrix(gpu_backend, tmp_path):
    if gpu_backend == "cufile":
        _skip_unless_cufile_registers(tmp_path)

    async def main():
        cfg = dsio.IOConfig(gpu_backend=gpu_backend, staging_buffer_bytes=4 << 20, pool_bytes=16 << 20)
        async with dsio.AsyncIOHandle(cfg) as h:
            case = 0
            for dtype in DTYPES:
                esize = torch.empty(0, dtype=dtype).element_size()
                for nb in SIZES:
                    n = max(1, nb // esize)
                    for off in OFFSETS:
                        case += 1
                        p = str(tmp_path / f"g{case}.bin")
                        src = torch.randint(0, 120, (n,), device="cuda").to(dtype)
                        assert await h.pwrite(src, p, off) == n * esize
                        assert os.path.getsize(p) == (off or 0) + n * esize
                        dst = torch.zeros_like(src)
                        await h.pread(dst, p, off or 0)
                        assert torch.equal(src, dst), (gpu_backend, dtype, nb, off)
                        # and the same bytes as a CPU read of the file
                        cpu = torch.empty(n, dtype=dtype)
                        await h.pread(cpu, p, off or 0)
                        assert torch.equal(cpu, src.cpu())
            assert h._gpu.backend == gpu_backend
            assert h.statistics().pool.in_use == 0

    asyncio.run(main())


@pytest.mark.gpu
@needs_cuda
def test_cuda_open_file_concurrent_and_short_read(tmp_path):
    async def main():
        async with dsio.AsyncIOHandle(gpu_backend="bounce") as h:
            parts = [torch.full((1000 + i,), i, dtype=torch.int32, device="cuda") for i in range(32)]
            offs = [sum(x.nbytes for x in parts[:i]) for i in range(len(parts))]
            p = str(tmp_path / "f.bin")
            async with h.open(p, "w+") as f:
                await asyncio.gather(*(f.pwrite(x, o) for x, o in zip(parts, offs)))
                backs = [torch.empty_like(x) for x in parts]
                await asyncio.gather(*(f.pread(b, o) for b, o in zip(backs, offs)))
            assert all(torch.equal(a, b) for a, b in zip(parts, backs))
            with pytest.raises(dsio.ShortIOError):
                await h.pread(torch.empty(10**6, device="cuda"), p)

    asyncio.run(main())


@pytest.mark.gpu
@needs_cuda
def test_gds_handle_compat(tmp_path):
    from dsio.compat import GDSBuilder

    h = GDSBuilder().load().gds_handle(1 << 20, 32, False, False, 1)
    try:
        t = h.new_pinned_device_tensor(1 << 20, torch.empty(0, dtype=torch.float32, device="cuda"))
        t.copy_(torch.randn(1 << 20, device="cuda"))
        p = str(tmp_path / "gds.bin")
        assert h.sync_pwrite(t, p) == 1
        back = h.new_pinned_device_tensor(1 << 20, t)
        h.async_pread(back, p)
        assert h.wait() == 1
        assert torch.equal(back, t)
        h.free_pinned_device_tensor(back)
        h.unpin_device_tensor(t)
    finally:
        h.close()


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA error path")
def test_cuda_request_without_cuda_is_clear():
    from dsio.compat import gds_handle

    with pytest.raises(BackendUnavailableError):
        gds_handle()
    from dsio.gpu import GpuIO, gpu_status

    assert not gpu_status().cuda and gpu_status().auto_choice.startswith("none")
    # A valid config everywhere; using it needs CUDA.
    with dsio.AsyncIOHandle(gpu_backend="cufile") as h, pytest.raises(BackendUnavailableError):
        GpuIO(h)


def test_a_failed_bounce_chunk_raises_only_once_the_chunks_in_flight_ended():
    """The bounce path's join (``dsio._gather.started``), without CUDA: chunk 0's read fails while
    chunk 1 still reads into its pinned buffer; ``_bounce`` starts no further chunk and raises only
    after chunk 1 ended and gave its buffer back (returning earlier would let the caller free or
    reuse memory the I/O still writes)."""
    from types import SimpleNamespace

    from dsio._dispatch import READ
    from dsio.gpu import GpuIO

    events: list[str] = []

    class Pool:
        buffer_bytes = 4096

        def __init__(self) -> None:
            self.free = asyncio.Semaphore(2)
            self.out = 0

        async def acquire(self) -> SimpleNamespace:
            await self.free.acquire()
            self.out += 1
            return SimpleNamespace(tensor=torch.zeros(4096, dtype=torch.uint8), release=self.release)

        def release(self) -> None:
            self.out -= 1
            self.free.release()

    pool = Pool()

    async def chunk_read(lease, phase, size, off, ref, chunk, stream):  # type: ignore[no-untyped-def]
        try:
            if off == 0:
                await asyncio.sleep(0.01)
                events.append("chunk 0 failed")
                raise OSError(5, "chunk 0")
            events.append(f"chunk {off // 4096} started")
            await asyncio.sleep(0.05)
            chunk.copy_(lease.tensor[phase : phase + size])
            events.append(f"chunk {off // 4096} ended")
        finally:
            lease.release()

    fake = SimpleNamespace(
        _ops=SimpleNamespace(pool=pool, disp=None), _stream=lambda device: None, _chunk_read=chunk_read
    )
    out = torch.ones(8 * 4096, dtype=torch.uint8)

    async def go() -> None:
        with pytest.raises(OSError):
            await GpuIO._bounce(fake, READ, None, out, 0)  # type: ignore[arg-type]
        events.append("raised")

    asyncio.run(go())
    # chunk 2 got chunk 0's buffer as it failed and was started; nothing after it
    assert events == [
        "chunk 1 started",
        "chunk 0 failed",
        "chunk 2 started",
        "chunk 1 ended",
        "chunk 2 ended",
        "raised",
    ]
    assert pool.out == 0
