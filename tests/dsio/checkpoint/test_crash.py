"""Crash safety: a process saving checkpoints in a loop is SIGKILLed at random moments; after each
kill the latest committed checkpoint loads and verifies, and no partial checkpoint is visible."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import _forkserver
import torch

import dsio.checkpoint as C

KILLS = 12  # random kills; every commit/retention step is also killed in turn by test_crash_points


def _state(step: int, n: int) -> dict:
    return {
        "step": step,
        "w": torch.full((n,), float(step)),
        "v": torch.arange(1000, dtype=torch.int64) + step,
    }


def _saver(root: str, seed: int) -> None:
    """Child: resume after the latest committed step and save forever (until killed)."""

    async def main() -> None:
        rng = random.Random(seed)
        async with C.Checkpointer(root, keep_last=2) as ck:
            steps = ck.steps()
            step = steps[-1] + 1 if steps else 0
            while True:
                task = await ck.save(step, _state(step, rng.choice([1 << 10, 1 << 20, 3 << 20])))
                await task
                step += 1

    try:
        asyncio.run(main())
    finally:
        os._exit(1)


def _check(root: str) -> tuple[int | None, bool]:
    """Verify the directory after a kill; return (latest step, whether a partial was left)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    partial = any(n.endswith(".tmp") for n in names)
    for n in names:  # every visible step directory is complete
        if re.fullmatch(r"step-\d{9}", n):
            assert os.path.isfile(os.path.join(root, n, "manifest.json")), n
    ck = C.Checkpointer(root, keep_last=2)  # a reader: takes no lock and removes nothing
    try:
        assert sorted(os.listdir(root) if os.path.isdir(root) else []) == sorted(names)
        steps = ck.steps()
        latest = ck.latest_step()
        if steps:
            assert latest in steps

            async def verify() -> None:
                for s in steps:
                    st = await ck.load(step=s)
                    assert st["step"] == s
                    assert bool((st["w"] == float(s)).all())
                    assert torch.equal(st["v"], torch.arange(1000, dtype=torch.int64) + s)
                assert (await ck.load())["step"] == latest

            asyncio.run(verify())
        return latest, partial
    finally:
        ck.close()


def test_sigkill_at_random_moments(tmp_path):
    root = str(tmp_path / "run")
    rng = random.Random(1234)
    t_start = time.monotonic()
    latest_seen: list[int | None] = []
    partials = 0
    # Children fork from a clean server process that has torch and dsio imported (fast starts,
    # and no threads inherited from this pytest process).
    ctx = _forkserver.context()  # the session's one fork server (tests/_forkserver.py)
    for i in range(KILLS):
        p = ctx.Process(target=_saver, args=(root, i))
        p.start()
        time.sleep(rng.uniform(0.05, 0.6))
        p.kill()
        p.join()
        assert p.exitcode == -signal.SIGKILL, f"child died on its own ({p.exitcode})"
        latest, partial = _check(root)
        partials += partial
        if latest_seen and latest_seen[-1] is not None:
            assert latest is not None and latest >= latest_seen[-1]  # committed steps never vanish
        latest_seen.append(latest)
    assert latest_seen[-1] is not None and latest_seen[-1] >= 3  # progress was made
    print(f"{KILLS} kills, {partials} mid-save, latest step {latest_seen[-1]}")
    assert partials >= 1, "no kill landed mid-save; the test is not exercising crashes"
    assert time.monotonic() - t_start < 90
