"""Crash points, enumerated: the saving process is SIGKILLed before each durable operation of the
commit and of retention in turn (the K-th ``_fs`` operation, K = 1, 2, ... until a save
completes), for a new step (with retention), a re-save by ``RENAME_EXCHANGE`` and a re-save by
the rename fallback. After each kill:

- a reader (no lock) sees only complete steps, every listed step loads bit-exact (as one of the
  versions saved for it), the step reported committed before the crash is listed, and the
  reader changed nothing on disk;
- the next writer's recovery leaves no ``*.tmp``, and the same holds again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import _forkserver
import pytest
import torch

import dsio.checkpoint as C
from dsio.checkpoint import _fs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _st(step: int, version: int) -> dict:
    return {
        "w": torch.full((3000,), float(step * 10 + version)),
        "i": torch.arange(64, dtype=torch.int64) * (step * 10 + version),
        "version": version,
    }


def _child(root: str, scenario: str, k: int) -> None:
    """Save per ``scenario``, SIGKILLing itself just before the k-th durable operation."""
    count = 0
    # A re-save writes its manifest exactly as a new step does ("new" covers those points):
    # count from the commit's first operation on.
    counting = scenario == "new"

    def hook(op: str, path: str) -> None:
        nonlocal count, counting
        if not counting and op == "fsync_dir" and os.path.basename(path).startswith("step-"):
            counting = True
        if not counting:
            return
        count += 1
        if count == k:
            os.kill(os.getpid(), signal.SIGKILL)

    async def main() -> None:
        async with C.Checkpointer(root, keep_last=2) as ck:
            if scenario == "fallback":
                _fs.exchange_enabled = False
            _fs.set_trace(hook)
            step, version = (3, 0) if scenario == "new" else (2, 1)
            await (await ck.save(step, _st(step, version)))
            await ck.wait()  # retention's deletion included

    try:
        asyncio.run(main())
    finally:
        os._exit(0)


def _seed(root: str) -> None:
    async def main() -> None:
        async with C.Checkpointer(root, keep_last=2) as ck:
            for s in (1, 2):
                await (await ck.save(s, _st(s, 0)))

    asyncio.run(main())


async def _verify(root: str, must_have: int, versions: dict[int, set[int]]) -> list[int]:
    ck = C.Checkpointer(root, keep_last=2)
    try:
        steps = ck.steps()
        assert must_have in steps, (steps, sorted(os.listdir(root)))
        latest = ck.latest_step()
        assert latest in steps
        for s in steps:
            st = await ck.load(step=s)
            v = st["version"]
            assert v in versions[s], (s, v)
            want = _st(s, v)
            assert torch.equal(st["w"], want["w"]) and torch.equal(st["i"], want["i"])
        assert (await ck.load())["version"] in versions[latest]
        return steps
    finally:
        ck.close()


@pytest.mark.parametrize("scenario", ["new", "exchange", "fallback"])
def test_sigkill_before_each_commit_and_retention_operation(tmp_path, scenario):
    ctx = _forkserver.context()  # the session's one fork server (tests/_forkserver.py)
    versions = {1: {0}, 2: {0, 1}, 3: {0}}
    must_have = 2  # committed before the crashing save started
    seed = str(tmp_path / "seed")
    _seed(seed)
    os.unlink(os.path.join(seed, "writer.lock"))

    async def run_all() -> int | None:
        for k in range(1, 40):
            root = str(tmp_path / f"k{k}")
            shutil.copytree(seed, root)
            p = ctx.Process(target=_child, args=(root, scenario, k))
            p.start()
            await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
            assert p.exitcode is not None, "child hung"
            if p.exitcode == 0:  # fewer than k operations: every crash point was visited
                final = await _verify(root, 3 if scenario == "new" else 2, versions)
                assert final == ([2, 3] if scenario == "new" else [1, 2])  # in place, as reported
                return k
            assert p.exitcode == -signal.SIGKILL, p.exitcode
            before = sorted(os.listdir(root))
            await _verify(root, must_have, versions)
            assert sorted(os.listdir(root)) == before, "a reader changed the directory"
            w = C.Checkpointer(root, keep_last=2)
            try:
                w._become_writer_sync()  # what the next writer's first save does
            finally:
                w.close()
            assert not [n for n in os.listdir(root) if n.endswith(".tmp")], os.listdir(root)
            steps = await _verify(root, must_have, versions)
            if scenario != "new":
                assert steps == [1, 2]
            shutil.rmtree(root)
        return None

    completed_at = asyncio.run(run_all())
    assert completed_at is not None and completed_at > 4, f"only {completed_at} operations enumerated"
    print(f"{scenario}: {completed_at - 1} crash points")
