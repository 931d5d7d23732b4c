"""Saving a stage-3 run whose parameters and optimizer state are on NVMe streams the fp32 master from
its swap file (the shard file at fp32, the master file at bf16) into the checkpoint: the writer reads
it a window at a time, so the save's peak RSS grows by its windows, never by the master. An async
save holds the master of the step it was taken at while the next step rewrites it (the step waits
per sub-group until the save has read that sub-group's master bytes), and a kill -9 in the middle of
such a save leaves the previous checkpoint, which resumes bitwise."""

from __future__ import annotations

import ctypes
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, least_peak_growth, make_model
from _offload_helpers import kill_at, param_config, slow_swap_reads

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
from dsio._bridge import run_sync  # noqa: E402
from dsio.checkpoint import Checkpointer, LazyTensor, _stream  # noqa: E402
from dstrain.checkpoint.sources import SwapRegions  # noqa: E402
from dstrain.offload.param.swapped_master import SwappedMaster  # noqa: E402
from dstrain.zero.stage3 import Stage3Zero  # noqa: E402

TINY = 16  # the helpers' default model: ~3k parameters
BIG = 1448  # ~16.9M parameters: a 67 MB master
DIM = 96  # ~60k parameters: ~15 sub-groups of 4096 elements, ~15 master windows of 16 KiB
READ_DELAY = 0.02  # seconds per swap-file read of the save: staging outlasts forward and backward
BOTH = {"param": "nvme", "optimizer": "nvme"}


def _engine(
    root: Path, *, dim: int, seed: int = 0, sub_group: int = 1 << 20, device: str = "cpu", **offload: Any
) -> Any:
    cfg = param_config(str(root), sub_group=sub_group, **offload)
    engine, _, _, _ = dstrain.initialize(model=make_model(seed=seed, dim=dim).to(device), config=cfg)
    return engine


def _saved_state(root: Path) -> Any:
    async def load() -> Any:
        async with Checkpointer(root) as ckpt:
            return await ckpt.load()

    return run_sync(load())


def _save_growth(engine: Any, ckpt: Path, reps: int = 2) -> int:
    """Peak RSS growth of a ``save_checkpoint``, each after one more training step: the least of
    ``reps`` saves (a materialized master is allocated by every save, a first touch by one)."""

    def step() -> None:
        engine_losses(engine, 1, start=engine.global_steps)
        # free heap memory goes back to the OS first, so a save that allocates the master must fault
        # in new pages instead of reusing resident ones (the unprivileged fresh clone measured a 20 MB
        # growth for a 67 MB materialized master without this)
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    return least_peak_growth(lambda: engine.save_checkpoint(ckpt), reps=reps, prepare=step)


def test_save_streams_the_offloaded_master_without_materializing_it(
    tmp_path, one_thread, monkeypatch
) -> None:
    """Peak RSS growth of a save of a params + optimizer NVMe run: the master streamed from the shard
    file vs the same save with the master read into memory first (``state_dict``, the old path)."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", 1 << 20)  # 3 windows of 1 MiB, not 3 of 8
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = _engine(swap, dim=BIG, **BOTH)
    try:
        master_bytes = 4 * sum(g.total for g in engine.zero.groups)
        assert all(isinstance(m, SwapRegions) for m in engine.zero.checkpoint_state()["master"])
        engine_losses(engine, 1)
        engine.save_checkpoint(tmp_path / "ck")  # the first save opens the Checkpointer and its handle
        streamed = _save_growth(engine, tmp_path / "ck")
        expected = [engine.zero.store.read_master(g) for g in engine.zero.groups]  # step 3's master
        # the control: collect takes the materialized state_dict (one save: noise only adds to it)
        monkeypatch.setattr(Stage3Zero, "checkpoint_state", Stage3Zero.state_dict)
        in_memory = _save_growth(engine, tmp_path / "ck-mem", reps=1)
    finally:
        engine.close()
    saved = _saved_state(tmp_path / "ck")  # latest: step 3, the last streamed save
    assert saved["engine"]["global_steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(saved["zero"]["master"], expected, strict=True))
    # materialized: the master tensor (67 MB) on top of the windows; streamed: the windows only
    assert in_memory > 0.9 * master_bytes, (in_memory, master_bytes)
    assert streamed < master_bytes / 4, (streamed, master_bytes)


# -- async saves: the checkpoint holds the master of the step it was taken at ---------------------


@pytest.fixture
def slow_small_windows(monkeypatch, one_thread):
    slow_swap_reads(monkeypatch, READ_DELAY)


def _async_save_then_step(tmp_path: Path, bf16: bool) -> dict[str, Any]:
    """Train 2 steps, async-save, train 1 step at once (it rewrites every master range while the save
    still streams); returns the master at the save, what was saved, and the step's counters."""
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = _engine(swap, dim=DIM, sub_group=4096, bf16=bf16, **BOTH)
    try:
        assert engine.zero.store.holds_master
        assert len(engine.stepper.sub_groups) >= 8
        engine_losses(engine, 2)
        expected = [engine.zero.store.read_master(g) for g in engine.zero.groups]
        engine.save_checkpoint(tmp_path / "ck", async_save=True)
        pending = engine.checkpoints.pending
        assert pending is not None and pending.gated  # still staging: the step below is gated
        capture = pending._capture
        engine_losses(engine, 1, start=2)
        # the step waited per sub-group: it ended while the save still had windows to read
        staged_when_stepped = all(f.done() for f in capture.futures)
        engine.wait_checkpoint()
        after = [engine.zero.store.read_master(g) for g in engine.zero.groups]
    finally:
        engine.close()
    return {
        "expected": expected,
        "after": after,
        "saved": _saved_state(tmp_path / "ck")["zero"]["master"],
        "staged_when_stepped": staged_when_stepped,
    }


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_async_save_holds_the_pre_step_master(tmp_path, slow_small_windows, bf16) -> None:
    r = _async_save_then_step(tmp_path, bf16)
    assert not all(torch.equal(a, b) for a, b in zip(r["after"], r["expected"], strict=True))  # it stepped
    assert all(torch.equal(a, b) for a, b in zip(r["saved"], r["expected"], strict=True))


def test_without_the_master_spans_the_checkpoint_holds_post_step_master(
    tmp_path, monkeypatch, slow_small_windows
) -> None:
    """The check above can fail: when the step's touch order leaves out the master's file spans, the
    step rewrites master ranges the save has not read yet, and the checkpoint holds post-step bytes."""
    from dsio.checkpoint import FileSpan

    monkeypatch.setattr(
        SwappedMaster, "master_span", lambda self, group, start, numel: FileSpan(self._swapper.path, 0, 0)
    )
    r = _async_save_then_step(tmp_path, bf16=False)
    assert not all(torch.equal(a, b) for a, b in zip(r["saved"], r["expected"], strict=True))


def test_bf16_master_is_streamed_from_the_master_file(tmp_path) -> None:
    """At bf16 the checkpoint's fp32 master is a lazy source over the master file (not the shards)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = _engine(swap, dim=DIM, sub_group=4096, bf16=True, **BOTH)
    try:
        engine_losses(engine, 1)
        masters = engine.zero.checkpoint_state()["master"]
        store = engine.zero.store
        assert all(isinstance(m, LazyTensor) for m in masters)
        assert {p for m in masters for p, _, _ in m.regions} == {store._mfile.path}
        from dstrain.checkpoint.sources import materialize

        got = materialize(masters)
        assert all(torch.equal(a, store.read_master(g)) for a, g in zip(got, engine.zero.groups, strict=True))
    finally:
        engine.close()


# -- the same on the training device (CUDA masters: run with ``pytest -m gpu``) --------------------


@pytest.mark.parametrize(
    ("device", "bf16"),
    [
        ("cpu", False),
        *[
            pytest.param(
                "cuda",
                bf16,
                id=f"cuda-{'bf16' if bf16 else 'fp32'}",
                marks=[
                    pytest.mark.gpu,
                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
                ],
            )
            for bf16 in (False, True)
        ],
    ],
)
def test_async_streamed_save_resumes_bitwise_on_the_device(tmp_path, one_thread, device, bf16) -> None:
    """Parameters and optimizer state on NVMe, the model on ``device``: an async save streams the
    master while the next steps run; it loads into a run without offload and into the same setting,
    and both continue exactly as the uninterrupted run without offload."""
    swap = tmp_path / "swap"
    swap.mkdir()
    both = {**BOTH, "bf16": bf16}
    ref = _engine(swap, dim=TINY, device=device, bf16=bf16)
    try:
        whole = engine_losses(ref, 4)
    finally:
        ref.close()
    saver = _engine(swap, dim=TINY, device=device, **both)
    try:
        assert saver.zero.store.holds_master
        assert engine_losses(saver, 2) == whole[:2]
        assert all(isinstance(m, SwapRegions) for m in saver.zero.checkpoint_state()["master"])
        saver.save_checkpoint(tmp_path / "ck", async_save=True)
        assert engine_losses(saver, 2, start=2) == whole[2:]
        assert saver.wait_checkpoint() is not None
    finally:
        saver.close()
    for offload in ({"bf16": bf16}, both):
        engine = _engine(swap, dim=TINY, seed=5, device=device, **offload)
        try:
            engine.load_checkpoint(tmp_path / "ck")
            assert engine.global_steps == 2
            assert engine_losses(engine, 2, start=2) == whole[2:], offload
        finally:
            engine.close()


# -- kill -9 in the middle of a streamed save of the master ------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    sys.path[:0] = [{helpers!r}, {helpers!r} + "/.."]  # the offload room, tests/dstrain
    from _dstrain_helpers import engine_losses, make_model
    from _offload_helpers import param_config
    import dstrain
    from dstrain.checkpoint.sources import SwapRegions

    root, swap = {root!r}, {swap!r}
    cfg = param_config(swap, param="nvme", optimizer="nvme", sub_group=1 << 20)
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    engine_losses(engine, 3)
    engine.save_checkpoint(root)  # step 3: committed
    engine_losses(engine, 1, start=3)
    masters = {{p for m in engine.zero.checkpoint_state()["master"] for p, _, _ in m.regions}}
    read = SwapRegions.read_into

    async def read_then_stop(self, io, offset, out):
        await read(self, io, offset, out)
        if {{p for p, _, _ in self.regions}} & masters:  # part of the master is in the new file
            print("AT master", flush=True)
            time.sleep(120)  # killed here

    SwapRegions.read_into = read_then_stop
    engine.save_checkpoint(root)  # step 4: killed inside
    print("SAVED", flush=True)
    """
)


@pytest.mark.usefixtures("one_thread")
def test_kill9_while_streaming_the_master_resumes_bitwise(tmp_path) -> None:
    """SIGKILL while a save streams the master from the shard file: the partial step stays
    uncommitted, and a new process resumes from step 3 exactly as an uninterrupted run."""
    root, swap = tmp_path / "ckpt", tmp_path / "swap"
    swap.mkdir()
    helpers = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(helpers=helpers, root=str(root), swap=str(swap))
    kill_at(code, "AT master")
    assert (root / "step-000000004.tmp").is_dir() and not (root / "step-000000004").exists()
    assert (root / "latest").read_text().strip() == "step-000000003"
    # one_thread: as in the child, so that float reductions split the same way
    engine = _engine(swap, dim=TINY, seed=5, **BOTH)
    try:
        engine.load_checkpoint(root)
        assert engine.global_steps == 3
        resumed = engine_losses(engine, 3, start=3)
    finally:
        engine.close()
    engine = _engine(swap, dim=TINY)
    try:
        whole = engine_losses(engine, 6)
    finally:
        engine.close()
    assert resumed == whole[3:]
