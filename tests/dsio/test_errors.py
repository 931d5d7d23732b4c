"""Every error is typed, clear, and leaves data intact."""

import asyncio
import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dsio
from dsio import ClosedError, IOFailedError, ShortIOError, TensorLayoutError, WrongLoopError


def test_missing_directory(run, data_dir):
    async def main():
        async with dsio.AsyncIOHandle() as h:
            with pytest.raises(FileNotFoundError) as ei:
                await h.pwrite(torch.ones(10), os.path.join(data_dir, "nope", "f.bin"))
            assert ei.value.errno == errno.ENOENT and "nope" in ei.value.filename
            with pytest.raises(FileNotFoundError):
                await h.pread(torch.ones(10), os.path.join(data_dir, "missing.bin"))

    run(main())


def test_read_only_directory(data_dir):
    ro = os.path.join(data_dir, "ro")
    os.mkdir(ro)
    os.chmod(ro, 0o555)
    # Root ignores permission bits, so the check runs as an unprivileged user when we are root.
    code = textwrap.dedent(
        f"""
        import asyncio, errno, os, torch, dsio
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        async def main():
            async with dsio.AsyncIOHandle() as h:
                try:
                    await h.pwrite(torch.ones(10), {os.path.join(ro, "f.bin")!r})
                except PermissionError as e:
                    assert e.errno == errno.EACCES
                    print("PERMISSION_ERROR")
        asyncio.run(main())
        """
    )
    os.chmod(data_dir, 0o755)
    os.chmod(os.path.dirname(data_dir), 0o755)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert "PERMISSION_ERROR" in r.stdout, r.stderr


def test_file_shorter_than_tensor(run, data_dir):
    async def main():
        path = os.path.join(data_dir, "short.bin")
        async with dsio.AsyncIOHandle() as h:
            await h.pwrite(torch.arange(1000, dtype=torch.uint8), path)
            dst = torch.zeros(2000, dtype=torch.uint8)
            with pytest.raises(ShortIOError) as ei:
                await h.pread(dst, path)
            e = ei.value
            assert isinstance(e, IOFailedError) and isinstance(e, OSError)
            assert (
                e.errno == errno.EIO and e.filename == path and e.transferred == 1000 and e.expected == 2000
            )
            with pytest.raises(ShortIOError):
                await h.pread(torch.zeros(10, dtype=torch.uint8), path, offset=995)

    run(main())


def test_write_failure_is_ioerror_with_errno(run):
    async def main():
        async with dsio.AsyncIOHandle() as h:
            with pytest.raises(IOFailedError) as ei:
                await h.pwrite(torch.ones(1 << 16), "/dev/full", offset=0)
            assert ei.value.errno == errno.ENOSPC and ei.value.filename == "/dev/full"
            st = h.statistics()
            assert st.errors == 1
            assert st.engine.write.errors_by_errno == {errno.ENOSPC: 1}
            assert sum(st.engine.write.size_buckets) == st.engine.write.ops == 1

    run(main())


def test_short_read_detected_by_engine(backend, run, data_dir, monkeypatch):
    """With the up-front size check bypassed, the engine itself reports the end of file."""
    import dsio.handle

    monkeypatch.setattr(dsio.handle, "check_readable", lambda *a: None)

    async def main():
        path = os.path.join(data_dir, "s.bin")
        async with dsio.AsyncIOHandle(backend=backend) as h:
            await h.pwrite(torch.ones(1 << 18, dtype=torch.uint8), path)
            async with h.open(path, "r+") as f:
                f.truncate(5000)
                with pytest.raises(ShortIOError) as ei:
                    await f.pread(torch.zeros(1 << 18, dtype=torch.uint8), 0)
                assert ei.value.errno == errno.EIO and ei.value.transferred < (1 << 18)
            assert h.statistics().engine.short >= 1

    run(main())


def test_closed_handle(run, data_dir):
    async def main():
        h = dsio.AsyncIOHandle()
        await h.aclose()
        with pytest.raises(ClosedError):
            await h.pwrite(torch.ones(4), os.path.join(data_dir, "x"))
        with pytest.raises(ClosedError):
            h.open(os.path.join(data_dir, "x"), "w")
        h.close()  # idempotent

    run(main())


def test_closed_file(run, data_dir):
    async def main():
        async with dsio.AsyncIOHandle() as h:
            f = h.open(os.path.join(data_dir, "x"), "w")
            f.close()
            with pytest.raises(ClosedError):
                await f.pwrite(torch.ones(4))

    run(main())


def test_wrong_loop(data_dir):
    h = dsio.AsyncIOHandle()
    p = os.path.join(data_dir, "x")
    asyncio.run(h.pwrite(torch.ones(4), p))
    with pytest.raises(WrongLoopError):
        asyncio.run(h.pwrite(torch.ones(4), p))
    h.close()


def test_bad_tensors_and_args(run, data_dir):
    async def main():
        p = os.path.join(data_dir, "x")
        async with dsio.AsyncIOHandle() as h:
            with pytest.raises(TensorLayoutError):
                await h.pwrite(torch.ones(4, 4).t(), p)
            with pytest.raises(TensorLayoutError):
                await h.pwrite([1, 2, 3], p)  # type: ignore[arg-type]
            with pytest.raises(TensorLayoutError):
                await h.pwrite(torch.ones(3).to_sparse(), p)
            with pytest.raises(ValueError):
                await h.pwrite(torch.ones(4), p, offset=-1)
            with pytest.raises(ValueError):
                h.open(p, "a")
            assert not os.path.exists(p)  # nothing was created by rejected calls

    run(main())


def test_failed_write_leaves_other_files_intact(run, data_dir):
    async def main():
        p = os.path.join(data_dir, "keep.bin")
        async with dsio.AsyncIOHandle() as h:
            t = torch.arange(5000, dtype=torch.int32)
            await h.pwrite(t, p)
            with pytest.raises(TensorLayoutError):
                await h.pwrite(torch.ones(4, 4).t(), p)
            back = torch.empty_like(t)
            await h.pread(back, p)
            assert torch.equal(back, t)

    run(main())
