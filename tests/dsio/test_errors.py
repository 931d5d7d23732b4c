"""Every error is typed, clear, and leaves data intact."""

import asyncio
import errno
import os

import pytest
import torch

import dsio
from dsio import ClosedError, IOFailedError, ShortIOError, TensorLayoutError, WrongLoopError


async def test_missing_directory(data_dir):
    async with dsio.AsyncIOHandle() as h:
        with pytest.raises(FileNotFoundError) as ei:
            await h.pwrite(torch.ones(10), os.path.join(data_dir, "nope", "f.bin"))
        assert ei.value.errno == errno.ENOENT and "nope" in ei.value.filename
        with pytest.raises(FileNotFoundError):
            await h.pread(torch.ones(10), os.path.join(data_dir, "missing.bin"))


def _in_child(fn, *args, timeout: float = 120.0):
    """``fn(*args)`` in a child forked from the session's fork server (torch and dsio already imported:
    no interpreter start-up); (exit code, what ``fn`` returned or None)."""
    import _forkserver

    ctx = _forkserver.context()
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child_main, args=(send, fn, args))
    p.start()
    send.close()
    got = recv.recv() if recv.poll(timeout) else None
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        pytest.fail(f"{fn.__name__}: the child did not finish within {timeout:.0f} s")
    return p.exitcode, got


def _child_main(send, fn, args) -> None:
    send.send(fn(*args))
    send.close()


def _write_as_nobody(path: str) -> str:
    """Root ignores permission bits: drop to an unprivileged user first (this is a child process)."""
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)

    async def main() -> str:
        async with dsio.AsyncIOHandle() as h:
            try:
                await h.pwrite(torch.ones(10), path)
            except PermissionError as e:
                return "PERMISSION_ERROR" if e.errno == errno.EACCES else f"errno {e.errno}"
        return "written"

    return asyncio.run(main())


def test_read_only_directory(data_dir):
    ro = os.path.join(data_dir, "ro")
    os.mkdir(ro)
    os.chmod(ro, 0o555)
    os.chmod(data_dir, 0o755)
    os.chmod(os.path.dirname(data_dir), 0o755)
    code, got = _in_child(_write_as_nobody, os.path.join(ro, "f.bin"))
    assert code == 0 and got == "PERMISSION_ERROR", (code, got)


async def test_file_shorter_than_tensor(data_dir):
    path = os.path.join(data_dir, "short.bin")
    async with dsio.AsyncIOHandle() as h:
        await h.pwrite(torch.arange(1000, dtype=torch.uint8), path)
        dst = torch.zeros(2000, dtype=torch.uint8)
        with pytest.raises(ShortIOError) as ei:
            await h.pread(dst, path)
        e = ei.value
        assert isinstance(e, IOFailedError) and isinstance(e, OSError)
        assert e.errno == errno.EIO and e.filename == path and e.transferred == 1000 and e.expected == 2000
        with pytest.raises(ShortIOError):
            await h.pread(torch.zeros(10, dtype=torch.uint8), path, offset=995)


async def test_write_failure_is_ioerror_with_errno():
    async with dsio.AsyncIOHandle() as h:
        with pytest.raises(IOFailedError) as ei:
            await h.pwrite(torch.ones(1 << 16), "/dev/full", offset=0)
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == "/dev/full"
        st = h.statistics()
        assert st.errors == 1
        assert st.engine.write.errors_by_errno == {errno.ENOSPC: 1}
        assert sum(st.engine.write.size_buckets) == st.engine.write.ops == 1


async def test_short_read_detected_by_engine(backend, data_dir, monkeypatch):
    """With the up-front size check bypassed, the engine itself reports the end of file."""
    import dsio._op

    monkeypatch.setattr(dsio._op, "check_readable", lambda *a: None)

    path = os.path.join(data_dir, "s.bin")
    async with dsio.AsyncIOHandle(backend=backend) as h:
        await h.pwrite(torch.ones(1 << 18, dtype=torch.uint8), path)
        async with h.open(path, "r+") as f:
            f.truncate(5000)
            with pytest.raises(ShortIOError) as ei:
                await f.pread(torch.zeros(1 << 18, dtype=torch.uint8), 0)
            assert ei.value.errno == errno.EIO and ei.value.transferred < (1 << 18)
        assert h.statistics().engine.short >= 1


async def test_closed_handle(data_dir):
    h = dsio.AsyncIOHandle()
    await h.aclose()
    with pytest.raises(ClosedError):
        await h.pwrite(torch.ones(4), os.path.join(data_dir, "x"))
    with pytest.raises(ClosedError):
        h.open(os.path.join(data_dir, "x"), "w")
    h.close()  # idempotent


async def test_closed_file(data_dir):
    async with dsio.AsyncIOHandle() as h:
        f = h.open(os.path.join(data_dir, "x"), "w")
        f.close()
        with pytest.raises(ClosedError):
            await f.pwrite(torch.ones(4))


def test_wrong_loop(data_dir):
    h = dsio.AsyncIOHandle()
    p = os.path.join(data_dir, "x")
    asyncio.run(h.pwrite(torch.ones(4), p))
    with pytest.raises(WrongLoopError):
        asyncio.run(h.pwrite(torch.ones(4), p))
    h.close()


async def test_bad_tensors_and_args(data_dir):
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


async def test_failed_write_leaves_other_files_intact(data_dir):
    p = os.path.join(data_dir, "keep.bin")
    async with dsio.AsyncIOHandle() as h:
        t = torch.arange(5000, dtype=torch.int32)
        await h.pwrite(t, p)
        with pytest.raises(TensorLayoutError):
            await h.pwrite(torch.ones(4, 4).t(), p)
        back = torch.empty_like(t)
        await h.pread(back, p)
        assert torch.equal(back, t)


@pytest.mark.parametrize(
    "offset",
    [2**63, 2**63 - 1, 2**64, -1, -(2**63), 1 << 50, 1.5, True, "0"],
    ids=["2^63", "offmax", "2^64", "neg", "neg63", "past-ext4-max", "float", "bool", "str"],
)
async def test_bad_offsets_are_offset_errors_before_the_file_exists(data_dir, offset):
    """Past off_t, negative, past the filesystem's largest file (ext4 here: 16 TiB), not an int:
    OffsetError (a DsioError and ValueError), and the path is never created."""

    p = os.path.join(data_dir, "never")
    async with dsio.AsyncIOHandle() as h:
        with pytest.raises(dsio.OffsetError) as ei:
            await h.pwrite(torch.ones(1024, dtype=torch.uint8), p, offset=offset)
        assert isinstance(ei.value, dsio.DsioError) and isinstance(ei.value, ValueError)
        assert not os.path.exists(p)
        with open(p, "wb"):
            pass
        # A read past the filesystem's size limit (but inside off_t) is simply past end of file.
        past_eof = isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset < 2**63 - 1024
        with pytest.raises(ShortIOError if past_eof else dsio.OffsetError):
            await h.pread(torch.ones(1024, dtype=torch.uint8), p, offset=offset)
        async with h.open(p, "r+") as f:
            with pytest.raises(dsio.OffsetError):
                await f.pwrite(torch.ones(1024, dtype=torch.uint8), offset)
        assert os.path.getsize(p) == 0


def _write_past_rlimit_fsize(data_dir: str) -> str:
    """A 1 MiB RLIMIT_FSIZE (this is a child process): a write past it is an OffsetError, not SIGXFSZ."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    async def main() -> str:
        async with dsio.AsyncIOHandle() as h:
            p = os.path.join(data_dir, "limited")
            await h.pwrite(torch.ones(4096, dtype=torch.uint8), p, offset=(1 << 20) - 4096)
            try:
                await h.pwrite(torch.ones(4096, dtype=torch.uint8), p, offset=1 << 20)
            except dsio.OffsetError:
                return "typed"
        return "no error"

    return asyncio.run(main())


def test_rlimit_fsize_is_an_offset_error(data_dir):
    code, got = _in_child(_write_past_rlimit_fsize, data_dir)
    assert code == 0 and got == "typed", (code, got)


async def test_large_valid_offset_still_works(data_dir):
    """The filesystem probe accepts what the filesystem accepts (a sparse 2 TiB offset on ext4)."""

    p = os.path.join(data_dir, "sparse")
    async with dsio.AsyncIOHandle() as h:
        t = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        off = 2 << 40
        try:
            await h.pwrite(t, p, offset=off)
        except IOFailedError as e:  # pragma: no cover - a filesystem with a smaller limit
            pytest.skip(f"this filesystem refuses a 2 TiB file: {e}")
        back = torch.empty_like(t)
        await h.pread(back, p, offset=off)
        assert torch.equal(back, t)
        os.unlink(p)
