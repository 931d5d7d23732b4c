"""Untrusted checkpoint directories (issue 9 item 6): FIFOs never block, symlinks are not
followed, sizes are bounded, file contents never appear in errors."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch

import dsio
import dsio.checkpoint as C

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(60)]

SECRET = "TOP-SECRET-0123456789"


@pytest.fixture
def ckdir(tmp_path):
    root = tmp_path / "run"

    async def main() -> None:
        async with C.Checkpointer(root) as ck:
            await (await ck.save(5, {"x": torch.arange(10.0)}))

    asyncio.run(main())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text(SECRET + "\n" * 10)
    return root, outside


def _load(root, step=None):
    async def main():
        ck = C.Checkpointer(root)
        try:
            return await ck.load(step=step)
        finally:
            ck.close()

    return asyncio.run(main())


def _replace(path, kind: str, target=None) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(target, path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    elif kind == "file":
        with open(path, "w") as f:
            f.write("not a directory")


STEP = "step-000000005"


@pytest.mark.parametrize(
    "where,kind",
    [
        ("latest", "fifo"),
        ("latest", "symlink"),
        ("latest", "dir"),
        ("latest", "sparse"),
        (f"{STEP}/manifest.json", "fifo"),
        (f"{STEP}/manifest.json", "symlink"),
        (f"{STEP}/manifest.json", "dir"),
        (f"{STEP}/manifest.json", "sparse"),
        (f"{STEP}/manifest.json", "devzero"),
        (f"{STEP}/rank-00000.safetensors", "fifo"),
        (f"{STEP}/rank-00000.safetensors", "symlink"),
        (f"{STEP}/rank-00000.safetensors", "devzero"),
        (STEP, "symlink"),
        (STEP, "file"),
    ],
)
def test_hostile_entry_is_a_format_error_without_blocking_or_leaking(ckdir, where, kind):
    root, outside = ckdir
    path = root / where
    target = outside / "secret"
    if kind == "devzero":
        kind, target = "symlink", "/dev/zero"
    elif where == STEP and kind == "symlink":
        shutil.copytree(root / STEP, outside / STEP)
        target = outside / STEP
    _replace(path, kind, target)
    with pytest.raises(dsio.CheckpointFormatError) as ei:
        _load(root, step=None if where == "latest" else 5)  # latest is read only for the latest step
    assert SECRET not in str(ei.value)


def test_step_with_hostile_manifest_is_not_listed(ckdir):
    root, outside = ckdir
    _replace(root / STEP / "manifest.json", "symlink", outside / "secret")
    ck = C.Checkpointer(root)
    try:
        assert ck.steps() == []
    finally:
        ck.close()


def test_single_file_load_of_a_fifo_or_device_does_not_block(tmp_path):
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(dsio.CheckpointFormatError):
        asyncio.run(C.load(fifo))
    with pytest.raises(dsio.CheckpointFormatError):
        asyncio.run(C.load("/dev/zero"))


def test_a_symlinked_root_the_caller_names_is_fine(ckdir, tmp_path):
    """Only entries inside the directory must not be links; the directory itself may be one."""
    root, _ = ckdir
    link = tmp_path / "link-to-run"
    os.symlink(root, link)
    assert torch.equal(_load(link)["x"], torch.arange(10.0))
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(3.0)}, storage_writer=C.DsioStorageWriter(tmp_path / "d"))
    os.symlink(tmp_path / "d", tmp_path / "dlink")
    back = {"w": torch.zeros(3)}
    dcp.load(back, storage_reader=C.DsioStorageReader(tmp_path / "dlink"))
    assert torch.equal(back["w"], torch.arange(3.0))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("where", ["latest", f"{STEP}/manifest.json"])
def test_a_huge_sparse_file_is_refused_by_its_size_not_read(ckdir, where):
    root, _ = ckdir
    _replace(root / where, "sparse")
    before = _rchar()
    with pytest.raises(dsio.CheckpointFormatError):
        _load(root, step=None if where == "latest" else 5)
    assert _rchar() - before < (8 << 20), "the 1 GiB file was read"
