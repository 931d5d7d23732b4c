"""Outcome and error agree (issue 9 item 8), readers racing retention, and no fsync on the loop
(issue 16): each failure of a save is a typed OSError with errno that says what is on disk."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
import time

import pytest
import torch

import dsio
import dsio.checkpoint as C
from dsio.checkpoint import _fs, _load, _read

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _st(step: int) -> dict:
    return {"w": torch.full((2000,), float(step)), "step": step}


def _fail_on(op: str, name_part: str, err: int = errno.ENOSPC):
    def hook(o: str, path: str) -> None:
        if o == op and name_part in os.path.basename(path):
            raise OSError(err, os.strerror(err), path)

    return hook


def test_enospc_writing_latest_says_committed_but_latest_not_updated(tmp_path):
    async def main() -> None:
        async with C.Checkpointer(tmp_path, keep_last=1) as ck:
            await (await ck.save(1, _st(1)))
            prev = _fs.set_trace(_fail_on("write", "latest"))
            try:
                task = await ck.save(2, _st(2))
                with pytest.raises(C.LatestNotUpdatedError) as ei:
                    await task
            finally:
                _fs.set_trace(prev)
            e = ei.value
            assert isinstance(e, OSError) and isinstance(e, dsio.DsioError)
            assert e.errno == errno.ENOSPC and e.committed and e.step == 2 and e.previous == 1
            # What the error says is what is on disk: step 2 committed and listed, latest at 1,
            # and retention skipped (keep_last=1 would otherwise have removed step 1).
            assert ck.steps() == [1, 2] and ck.latest_step() == 1
            assert (await ck.load(step=2))["step"] == 2
            await (await ck.save(3, _st(3)))
            assert ck.latest_step() == 3 and (await ck.load())["step"] == 3

    asyncio.run(main())


@pytest.mark.parametrize("op,part", [("write", "manifest"), ("rename", "step-"), ("fsync_dir", "step-")])
def test_commit_failure_is_typed_with_errno_and_commits_nothing(tmp_path, op, part):
    async def main() -> None:
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, _st(1)))
            prev = _fs.set_trace(_fail_on(op, part))
            try:
                task = await ck.save(2, _st(2))
                with pytest.raises(C.CheckpointCommitError) as ei:
                    await task
            finally:
                _fs.set_trace(prev)
            assert ei.value.errno == errno.ENOSPC and not ei.value.committed
            assert not isinstance(ei.value, C.LatestNotUpdatedError)
            assert ck.steps() == [1] and (await ck.load())["step"] == 1

    asyncio.run(main())


def test_reader_racing_retention_retries_the_new_latest(tmp_path, monkeypatch):
    """Retention retires the step load() chose before load() opens it: load() re-reads latest."""

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as w:
            await (await w.save(1, _st(1)))
            await (await w.save(2, _st(2)))
        reader = C.Checkpointer(tmp_path)
        calls = {"n": 0}
        real = reader.latest_step

        def stale_latest() -> int | None:
            calls["n"] += 1
            if calls["n"] == 1:  # chose step 1, which is then retired away
                os.rename(tmp_path / "step-000000001", tmp_path / "step-000000001.9.del.tmp")
                return 1
            return real()

        monkeypatch.setattr(reader, "latest_step", stale_latest)
        try:
            assert (await reader.load())["step"] == 2 and calls["n"] == 2
            with pytest.raises(dsio.CheckpointNotFoundError):  # an explicit step: no retry
                await reader.load(step=1)
        finally:
            reader.close()

    asyncio.run(main())


def test_step_deleted_after_open_still_loads(tmp_path, monkeypatch):
    async def main() -> None:
        async with C.Checkpointer(tmp_path) as w:
            await (await w.save(1, _st(1)))
        real = _read.read_file

        async def delete_then_read(*a, **kw):
            shutil.rmtree(tmp_path / "step-000000001")  # retention's deletion, after the open
            return await real(*a, **kw)

        monkeypatch.setattr(_load, "read_file", delete_then_read)  # Checkpointer.load's reader
        reader = C.Checkpointer(tmp_path)
        try:
            assert (await reader.load(step=1))["step"] == 1
        finally:
            reader.close()

    asyncio.run(main())


def test_no_fsync_on_the_event_loop_thread_and_the_loop_keeps_ticking(tmp_path, monkeypatch):
    """The commit's metadata work runs off the loop: every os.fsync of a save happens on another
    thread, and the loop's longest stall during the background part of a save is small."""
    loop_thread: list[threading.Thread] = []
    on_loop: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if loop_thread and threading.current_thread() is loop_thread[0]:
            on_loop.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    state = {f"w{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB
    stalls: list[float] = []

    async def main() -> None:
        loop_thread.append(threading.current_thread())
        async with C.Checkpointer(tmp_path, keep_last=1) as ck:
            for step in range(3):
                task = await ck.save(step, state)
                worst = 0.0
                last = time.perf_counter()
                while not task.done():
                    await asyncio.sleep(0.0005)
                    now = time.perf_counter()
                    worst = max(worst, now - last)
                    last = now
                await task
                await ck.wait()
                stalls.append(worst)

    asyncio.run(main())
    assert on_loop == [], f"fsync ran on the event loop thread: {on_loop}"
    print(
        f"longest loop stall during background saves (ms, machine under load): {[round(s * 1e3, 2) for s in stalls]}"
    )
    # A gross-regression guard only (100 ms). The 2 ms target is measured against an idle loop of the
    # same run in tests/test_loop_stall.py (strict on a quiet machine, an explicit warning when relaxed),
    # which also checks that no thread is started or joined on the loop during the save.
    assert min(stalls) < 0.100
