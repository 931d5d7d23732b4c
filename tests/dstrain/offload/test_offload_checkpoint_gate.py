"""An async save of an NVMe-offloaded run lets the next optimizer step run sub-group by sub-group while
it still streams the state: each sub-group waits only until the save has read *its* bytes in memory
(its master range; its swap slot is pinned copy-on-write, tests/dstrain/offload/test_offload_checkpoint_cow.py),
and the save reads them in the order the step touches them. The checkpoint still holds exactly the
state of the step it was taken at; without the per-sub-group wait it would hold post-step masters
for some sub-groups, and this test sees that."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import offload_config, slow_swap_reads

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
from dsio._bridge import run_sync  # noqa: E402
from dsio.checkpoint import Checkpointer, _stream  # noqa: E402
from dstrain.offload.optimizer.adam import OffloadAdam  # noqa: E402

DIM = 96  # ~60k parameters: ~15 sub-groups of 4096 elements, ~60 windows of 16 KiB
READ_DELAY = 0.02  # seconds per swap-file read of the save: staging outlasts forward and backward


@pytest.fixture
def slow_small_windows(monkeypatch, one_thread):
    slow_swap_reads(monkeypatch, READ_DELAY)
    sums = _stream.piece_sums

    def slow_sums(ptr: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:  # every window's copy
        time.sleep(READ_DELAY / 4)
        return sums(ptr, offset, nbytes)

    monkeypatch.setattr(_stream, "piece_sums", slow_sums)


def _saved_state(root: str) -> Any:
    async def load() -> Any:
        async with Checkpointer(root) as ckpt:
            return await ckpt.load()

    return run_sync(load())


def _async_save_then_step(tmp_path, monkeypatch, gated: bool) -> dict[str, Any]:
    """Train 2 steps, async-save, train 1 step at once; returns what was expected and what was saved."""
    swap = tmp_path / "swap"
    swap.mkdir()
    seen: list[tuple[int, bool]] = []  # (sub-group, whole staging done when it was let through)
    lend = OffloadAdam.gate_next_step

    def spy(self: OffloadAdam, wait: Any) -> None:
        capture = engine.checkpoints.pending._capture

        def gate(i: int) -> float:
            waited = wait(i)
            seen.append((i, all(f.done() for f in capture.futures)))
            return waited

        if gated:
            lend(self, gate)

    monkeypatch.setattr(OffloadAdam, "gate_next_step", spy)  # gated=False: the step never waits
    cfg = offload_config(1, "nvme", str(swap), sub_group=4096)
    engine, opt, _, _ = dstrain.initialize(model=make_model(dim=DIM), config=cfg)
    try:
        assert len(opt.sub_groups) >= 8
        engine_losses(engine, 2)
        expected_opt = opt.state_dict()["state"]  # read from the swap file: the state at step 2
        expected_master = [m.clone() for m in engine.zero.state_dict()["master"]]
        engine.save_checkpoint(tmp_path / "ck", async_save=True)
        pending = engine.checkpoints.pending
        engine_losses(engine, 1, start=2)  # changes every sub-group while the save streams
        blocked = engine.statistics().checkpoint_blocked_seconds
        gate_s = pending.gate_seconds
        engine.wait_checkpoint()
    finally:
        engine.close()
    saved = _saved_state(str(tmp_path / "ck"))
    return {
        "expected_opt": expected_opt,
        "expected_master": expected_master,
        "saved": saved,
        "seen": seen,
        "blocked": blocked,
        "gate_s": gate_s,
    }


def _matches(r: dict[str, Any]) -> bool:
    saved_opt = r["saved"]["stepper"]["state"]
    same = all(
        torch.equal(saved_opt[i]["exp_avg"].view(-1), e["exp_avg"].view(-1))
        and torch.equal(saved_opt[i]["exp_avg_sq"].view(-1), e["exp_avg_sq"].view(-1))
        for i, e in r["expected_opt"].items()
    )
    masters = r["saved"]["zero"]["master"]
    return same and all(torch.equal(a, b) for a, b in zip(masters, r["expected_master"], strict=True))


def test_step_waits_per_sub_group_and_checkpoint_holds_the_saved_step(
    tmp_path, monkeypatch, slow_small_windows
) -> None:
    r = _async_save_then_step(tmp_path, monkeypatch, gated=True)
    assert _matches(r)  # bitwise the state at the save: no sub-group was captured after its step
    subs = [i for i, _ in r["seen"]]
    assert subs == sorted(subs) and len(subs) >= 8  # every sub-group waited, in step order
    # per sub-group, not the whole save: the first sub-groups stepped while the save was still reading
    assert not r["seen"][0][1]
    assert r["blocked"] >= r["gate_s"] > 0.0  # the waits are counted as blocked time, and apart


def test_without_the_wait_the_checkpoint_holds_post_step_bytes(
    tmp_path, monkeypatch, slow_small_windows
) -> None:
    """The check above can fail: with the per-sub-group wait removed, the step rewrites masters and
    swap slots the save has not read yet, and the checkpoint no longer equals the saved step."""
    r = _async_save_then_step(tmp_path, monkeypatch, gated=False)
    assert not _matches(r)
