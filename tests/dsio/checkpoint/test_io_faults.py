"""An I/O error at the N-th operation, for every N, of a small save and of a load.

The operations are the engine's (each ``pwrite``/``pread``/``fsync`` of an open checkpoint file,
patched to fail with EIO) and the commit's (each durable ``_fs`` operation, failed through its
hook). A failed save raises a typed error (a ``DsioError`` that is an ``OSError`` with errno);
afterwards every listed step loads bit-exact and nothing half-written is ever listed or loaded.
A failed load raises a typed error and returns nothing.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil

import pytest
import torch

import dsio
import dsio.checkpoint as C
from dsio.checkpoint import _fs
from dsio.errors import IOFailedError
from dsio.file import AsyncFile

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Faults:
    """Counts operations; fails the ``fail_at``-th one (0 = never)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.fail_at = 0
        self.failed: str | None = None
        faults = self

        def tick(what: str, path: str) -> None:
            faults.count += 1
            if faults.count == faults.fail_at:
                faults.failed = f"{what} {os.path.basename(path)}"
                raise IOFailedError(errno.EIO, path, None, f"injected at {what}")

        for name in ("pwrite", "pread", "fsync"):
            real = getattr(AsyncFile, name)

            def wrapped(self, *a, _real=real, _name=name, **kw):
                tick(_name, self.path)
                return _real(self, *a, **kw)

            monkeypatch.setattr(AsyncFile, name, wrapped)
        prev = _fs.set_trace(lambda op, path: tick(op, path))
        monkeypatch.setattr(self, "_restore", lambda: _fs.set_trace(prev), raising=False)

    def reset(self, fail_at: int) -> None:
        self.count, self.fail_at, self.failed = 0, fail_at, None


def _st(step: int) -> dict:
    # Two tensors in different staging chunks plus small ones: several writes per file.
    return {"big": torch.full((300_000,), float(step)), "small": torch.arange(10) + step, "step": step}


async def _check_dir(root: str) -> list[int]:
    ck = C.Checkpointer(root)
    try:
        steps = ck.steps()
        for s in steps:
            st = await ck.load(step=s)
            want = _st(s)
            assert (
                st["step"] == s
                and torch.equal(st["big"], want["big"])
                and torch.equal(st["small"], want["small"])
            )
        return steps
    finally:
        ck.close()


def test_io_error_at_each_operation_of_a_save(tmp_path, monkeypatch):
    seed = str(tmp_path / "seed")

    async def seed_dir() -> None:
        async with C.Checkpointer(seed) as ck:
            await (await ck.save(1, _st(1)))

    asyncio.run(seed_dir())
    faults = Faults(monkeypatch)

    async def save_once(root: str, fail_at: int) -> BaseException | None:
        faults.reset(fail_at)
        try:
            async with C.Checkpointer(root, keep_last=1) as ck:
                task = await ck.save(2, _st(2))
                await task
                await ck.wait()
        except BaseException as e:  # noqa: BLE001 - classified below
            return e
        return None

    try:
        total = None
        outcomes = []
        for n in range(1, 80):
            root = str(tmp_path / f"n{n}")
            shutil.copytree(seed, root)
            err = asyncio.run(save_once(root, n))
            if faults.failed is None:  # fewer than n operations: all were visited
                assert err is None, err
                total = n - 1
                break
            faults.reset(0)
            if err is not None:
                assert isinstance(err, dsio.DsioError) and isinstance(err, OSError), (
                    faults.failed,
                    repr(err),
                )
                assert err.errno == errno.EIO, repr(err)
            steps = asyncio.run(_check_dir(root))
            if isinstance(err, C.LatestNotUpdatedError) or err is None:
                assert 2 in steps  # committed, as the (absent) error says
                if err is not None:  # and latest names what the error says it names
                    ck = C.Checkpointer(root)
                    assert ck.latest_step() == (err.previous if err.previous is not None else 2)
                    ck.close()
            else:
                assert steps == [1], (faults.failed, repr(err), steps)  # nothing of step 2 visible
            outcomes.append((faults.failed, type(err).__name__))
            shutil.rmtree(root)
    finally:
        faults._restore()
    assert total is not None and total >= 8, total
    kinds = {k for _, k in outcomes}
    assert {"IOFailedError", "CheckpointCommitError", "LatestNotUpdatedError"} <= kinds, outcomes


def test_io_error_at_each_operation_of_a_load(tmp_path, monkeypatch):
    root = str(tmp_path / "run")

    async def seed_dir() -> None:
        async with C.Checkpointer(root) as ck:
            await (await ck.save(1, _st(1)))

    asyncio.run(seed_dir())
    faults = Faults(monkeypatch)

    async def load_once(fail_at: int):
        faults.reset(fail_at)
        ck = C.Checkpointer(root)
        try:
            return await ck.load()
        finally:
            ck.close()

    try:
        for n in range(1, 40):
            try:
                st = asyncio.run(load_once(n))
            except IOFailedError:
                assert faults.failed is not None and faults.failed.startswith("pread")
                continue
            assert faults.failed is None
            assert torch.equal(st["big"], _st(1)["big"]) and n > 2
            break
        else:
            pytest.fail("the load never completed")
    finally:
        faults._restore()
