"""A full disk: a clear error, the previous checkpoint intact, the partial one removed."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
import torch
from _mount import mounted

import dsio
import dsio.checkpoint as C

# Root mounts the tmpfs directly; other users run these tests in `unshare -Urm` (tests/_mount.py).
pytestmark = pytest.mark.needs_mount


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs."""
    with mounted(tmp_path / "small", "tmpfs", "size=8m") as d:
        yield d


def test_checkpointer_disk_full(small_fs):
    async def main():
        async with C.Checkpointer(small_fs / "run", keep_last=3) as ck:
            ok = {"w": torch.full((1 << 18,), 1.0)}  # 1 MiB
            await (await ck.save(1, ok))
            too_big = {"w": torch.zeros(4 << 20)}  # 16 MiB > 8 MiB filesystem
            with pytest.raises(OSError) as ei:
                task = await ck.save(2, too_big)
                await task
            assert ei.value.errno == errno.ENOSPC
            assert isinstance(ei.value, dsio.IOFailedError)
            assert ck.steps() == [1]
            assert sorted(os.listdir(small_fs / "run")) == [
                "latest",
                "step-000000001",
                "writer.lock",
            ]  # partial removed
            back = await ck.load()
            assert torch.equal(back["w"], ok["w"])
            assert ck.statistics().failed_saves == 1
            # The space came back: the next save works.
            await (await ck.save(3, ok))
            assert ck.steps() == [1, 3]

    asyncio.run(main())


def test_save_file_disk_full_removes_partial(small_fs):
    path = str(small_fs / "x.safetensors")
    with pytest.raises(dsio.IOFailedError) as ei:
        asyncio.run(C.save({"w": torch.zeros(4 << 20)}, path))
    assert ei.value.errno == errno.ENOSPC
    assert not os.path.exists(path)


def test_disk_full_without_preallocation_fails_in_the_writes(small_fs):
    async def main():
        async with C.Checkpointer(small_fs / "run", preallocate=False) as ck:
            await (await ck.save(1, {"w": torch.ones(1 << 18)}))
            with pytest.raises(OSError) as ei:
                await (await ck.save(2, {"w": torch.zeros(4 << 20)}))
            assert ei.value.errno == errno.ENOSPC
            assert ck.steps() == [1]
            assert sorted(os.listdir(small_fs / "run")) == ["latest", "step-000000001", "writer.lock"]
            assert torch.equal((await ck.load())["w"], torch.ones(1 << 18))

    asyncio.run(main())
