"""One writer per directory, one staging user per Checkpointer (issue 9 items 4 and 5)."""

from __future__ import annotations

import asyncio
import os
import socket

import _forkserver
import pytest
import torch

import dsio.checkpoint as C

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_concurrent_saves_on_one_checkpointer_never_share_staging(tmp_path):
    a = {"w": torch.full((50_000,), 1.0), "tag": "a"}
    b = {"w": torch.full((50_000,), 2.0), "tag": "b"}

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as ck:
            t1, t2 = await asyncio.gather(ck.save(1, a), ck.save(2, b))
            await t1
            await t2
            s1, s2 = await ck.load(step=1), await ck.load(step=2)
            assert s1["tag"] == "a" and torch.equal(s1["w"], a["w"])
            assert s2["tag"] == "b" and torch.equal(s2["w"], b["w"])

    asyncio.run(main())


def test_second_writer_in_this_process_is_refused_naming_the_holder(tmp_path):
    async def main() -> None:
        async with C.Checkpointer(tmp_path) as first:
            await (await first.save(1, {"x": torch.ones(3)}))
            async with C.Checkpointer(tmp_path) as second:
                with pytest.raises(C.CheckpointLockedError) as ei:
                    await second.save(2, {"x": torch.zeros(3)})
                assert ei.value.pid == os.getpid() and ei.value.host == socket.gethostname()
                assert second.steps() == [1]  # it may still read
                assert torch.equal((await second.load())["x"], torch.ones(3))
        # Released at close: a new writer may save.
        async with C.Checkpointer(tmp_path) as third:
            await (await third.save(2, {"x": torch.zeros(3)}))
            assert third.steps() == [1, 2]

    asyncio.run(main())


def _other_writer(root: str, q) -> None:
    async def main():
        async with C.Checkpointer(root) as ck:
            try:
                await ck.save(7, {"x": torch.ones(1)})
            except C.CheckpointLockedError as e:
                return ("locked", e.pid, e.host)
            return ("saved", None, None)

    q.put(asyncio.run(main()))


def test_writer_in_another_process_is_refused_naming_pid_and_host(tmp_path):
    ctx = _forkserver.context()  # the session's one fork server (tests/_forkserver.py)

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, {"x": torch.ones(1)}))
            q = ctx.Queue()
            p = ctx.Process(target=_other_writer, args=(str(tmp_path), q))
            p.start()
            got = await asyncio.get_running_loop().run_in_executor(None, q.get, True, 120)
            p.join(30)
            assert got == ("locked", os.getpid(), socket.gethostname())
            assert ck.steps() == [1]

    asyncio.run(main())


def test_a_reader_never_touches_a_live_save(tmp_path):
    """Constructing a Checkpointer (an evaluator) while a save is in flight deletes nothing."""

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as writer:
            await (await writer.save(1, {"x": torch.ones(4)}))
            task = await writer.save(2, {"x": torch.full((4,), 2.0)})  # staged, not committed
            tmp = tmp_path / "step-000000002.tmp"
            assert tmp.is_dir()
            reader = C.Checkpointer(tmp_path)
            try:
                assert reader.steps() == [1]
                assert torch.equal((await reader.load())["x"], torch.ones(4))
                assert tmp.is_dir() or (tmp_path / "step-000000002").is_dir()
            finally:
                reader.close()
            await task
            assert writer.steps() == [1, 2]
            assert torch.equal((await writer.load())["x"], torch.full((4,), 2.0))

    asyncio.run(main())
