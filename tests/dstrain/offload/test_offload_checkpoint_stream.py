"""Saving an NVMe-offloaded run streams Adam's state from its swap file into the checkpoint: the
process's peak resident memory grows by a small fraction of that state (the writer's windows), never
by the state itself; an ``async_save`` is staged while the next forward and backward run, the step
waits for it, and the checkpoint holds the state of the step it was taken at (resumes bitwise)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, least_peak_growth, make_model
from _offload_helpers import offload_config

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402

DIM = 1448  # ~16.9M parameters: Adam's m and v are ~135 MB


def _engine(swap: str, device: str = "nvme", seed: int = 0) -> tuple[Any, Any]:
    cfg = offload_config(1, device, swap, sub_group=1 << 21)
    engine, opt, _, _ = dstrain.initialize(model=make_model(seed=seed, dim=DIM), config=cfg)
    return engine, opt


def test_save_streams_swapped_state_without_materializing_it(tmp_path, one_thread) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    engine, opt = _engine(str(swap))
    try:
        state_bytes = 2 * 4 * sum(p.numel() for p in engine.module.parameters())
        engine_losses(engine, 1)
        engine.save_checkpoint(tmp_path / "ck")  # the first save creates the I/O handle and the lock
        # the least of 2 saves, each after a step: first allocations (the concurrent window reads', the
        # engine's copier threads') happen in one of them; a materialized m and v would be in each
        paths = []
        growth = least_peak_growth(
            lambda: paths.append(engine.save_checkpoint(tmp_path / "ck")),
            reps=2,
            prepare=lambda: engine_losses(engine, 1, start=engine.global_steps),
        )
        # the writer's windows (3 x 8 MiB) and bookkeeping; materializing m and v would be >= 135 MB.
        # A third of the state: one save alone measures ~25 MB, but two concurrent fresh-clone make tests
        # (load 4) measured 40.7 MB for one save
        assert growth < state_bytes / 3, (growth, state_bytes)
        assert os.path.getsize(paths[-1]) > state_bytes  # m and v (and the weights) are in the file
        expected = opt.state_dict()  # materialized, from the swap file: what the checkpoint must hold
    finally:
        engine.close()
    # the streamed file is an ordinary checkpoint: a run without offload loads it, same state
    other, other_opt = _engine(str(swap), device="none", seed=3)
    try:
        other.load_checkpoint(tmp_path / "ck")
        got = other_opt.state_dict()["state"]
        for i, entry in expected["state"].items():
            assert torch.equal(got[i]["exp_avg"].view(-1), entry["exp_avg"].view(-1))
            assert torch.equal(got[i]["exp_avg_sq"].view(-1), entry["exp_avg_sq"].view(-1))
    finally:
        other.close()


def test_load_streams_swapped_state_without_materializing_it(tmp_path, one_thread) -> None:
    """Loading into an NVMe-offloaded run reads Adam's m and v from the checkpoint file straight into
    the swap buffers, a sub-group at a time (checksums checked on the way): the peak RSS grows by a
    small fraction of that state, while reading it into memory first grew by all of it."""
    swap = tmp_path / "swap"
    swap.mkdir()
    engine, opt = _engine(str(swap))
    try:
        state_bytes = 2 * 4 * sum(p.numel() for p in engine.module.parameters())
        master_bytes = state_bytes // 2  # the fp32 master (stage 1) is loaded into memory, as it lives there
        engine_losses(engine, 2)
        engine.save_checkpoint(tmp_path / "ck")
        expected = opt.state_dict()["state"]
    finally:
        engine.close()
    loaded, loaded_opt = _engine(str(swap), seed=3)
    try:
        engine_losses(loaded, 1)  # swap buffers, I/O handles, the checkpoint store: all created
        loaded.load_checkpoint(tmp_path / "ck")  # the first load opens the directory's Checkpointer
        # the least of 2 loads: a first touch happens in one, a materialized m and v would be in both
        growth = least_peak_growth(lambda: loaded.load_checkpoint(tmp_path / "ck"), reps=2)
        assert loaded_opt.statistics().swapper.written_bytes >= state_bytes  # through the swap file
        got = loaded_opt.state_dict()["state"]
    finally:
        loaded.close()
    # the fp32 master is read into memory (it lives there at stage 1) and the ZeRO strategy's
    # all-gather copies it once more; m and v add only the reads' buffers (in memory: >= 135 MB more)
    assert growth < 2 * master_bytes + state_bytes / 4, (growth, master_bytes, state_bytes)
    for i, entry in expected.items():
        assert torch.equal(got[i]["exp_avg"].view(-1), entry["exp_avg"].view(-1))
        assert torch.equal(got[i]["exp_avg_sq"].view(-1), entry["exp_avg_sq"].view(-1))


def test_async_save_is_staged_during_forward_backward_and_resumes_bitwise(tmp_path, one_thread) -> None:
    """The step after an async save waits for its staging (the state is streamed from the swap file,
    which that step rewrites); the checkpoint then resumes exactly where it was taken."""
    swap = tmp_path / "swap"
    swap.mkdir()
    engine, _ = _engine(str(swap))
    try:
        engine_losses(engine, 2)
        engine.save_checkpoint(tmp_path / "ck", async_save=True)
        assert engine.checkpoints.pending is not None  # returned before the save committed
        after = engine_losses(engine, 2, start=2)  # the first of these steps waits for staging
        blocked = engine.statistics().checkpoint_blocked_seconds
        assert engine.wait_checkpoint() is not None
    finally:
        engine.close()
    assert blocked > 0.0
    resumed, _ = _engine(str(swap), seed=9)
    try:
        resumed.load_checkpoint(tmp_path / "ck")
        assert resumed.global_steps == 2
        assert engine_losses(resumed, 2, start=2) == after
    finally:
        resumed.close()


def test_torch_save_store_materializes_swapped_state(tmp_path, one_thread) -> None:
    """Without dsio's writer (torch.save fallback) the lazy sources are read into tensors: the file
    holds the same Adam state, and it loads into a run without offload."""
    from dstrain.checkpoint import TorchSaveStore

    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = offload_config(2, "nvme", str(swap))
    engine, opt, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    try:
        engine.store.close()
        engine.store = TorchSaveStore()
        engine_losses(engine, 2)
        path = engine.save_checkpoint(tmp_path / "ck")
        assert path.suffix == ".pt"
        expected = opt.state_dict()["state"]
    finally:
        engine.close()
    other, other_opt, _, _ = dstrain.initialize(
        model=make_model(seed=4), config=offload_config(2, "none", str(swap))
    )
    try:
        other.store.close()
        other.store = TorchSaveStore()
        other.load_checkpoint(tmp_path / "ck")
        got = other_opt.state_dict()["state"]
        assert expected and set(got) == set(expected)
        for i, entry in expected.items():
            assert torch.equal(got[i]["exp_avg"].view(-1), entry["exp_avg"].view(-1))
            assert torch.equal(got[i]["exp_avg_sq"].view(-1), entry["exp_avg_sq"].view(-1))
    finally:
        other.close()
