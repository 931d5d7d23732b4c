"""Reshape on load: a checkpoint saved at world size W, ZeRO stage S, offload O loads into any W', S', O'
(optimizer state included) and training continues as if uninterrupted; each rank reads only its slices."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, engine_losses, make_model, spawn
from _reshape_workers import AFTER, BEFORE, GLOBAL_BATCH, damaged_load, resume_many, save_many

import dsio
import dstrain

SAVED = {  # world -> name: (stage, offload)
    1: {"w1s0": (0, "none")},
    2: {"w2s1": (1, "none"), "w2s3cpu": (3, "cpu")},
    4: {"w4s2": (2, "none")},
}
RESUMED = {  # world -> (saved, stage, offload)
    1: [("w2s1", 3, "none"), ("w2s3cpu", 0, "none"), ("w4s2", 1, "nvme")],
    2: [("w2s1", 2, "nvme"), ("w2s3cpu", 3, "none"), ("w4s2", 3, "none"), ("w1s0", 3, "cpu")],
    4: [("w2s1", 0, "none"), ("w2s3cpu", 1, "cpu"), ("w1s0", 2, "none")],
}


def _run(fn: Any, root: str, arg: Any, world: int) -> list[Any]:
    if world == 1:
        return [fn(root, arg)]
    return spawn(fn, root, arg, world=world, start_method="forkserver")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    root = str(tmp_path_factory.mktemp("reshape"))
    saved: dict[str, Any] = {}
    for world, scenarios in SAVED.items():
        saved.update(_run(save_many, root, scenarios, world)[0])
    resumed: dict[str, list[Any]] = {}
    for world, scenarios in RESUMED.items():
        per_rank = _run(resume_many, root, scenarios, world)
        for name in per_rank[0]:
            resumed[name] = [r[name] for r in per_rank]
    return saved, resumed


CASES = [f"{s}->w{w}s{st}{o}" for w, cases in RESUMED.items() for s, st, o in cases]


@pytest.mark.parametrize("case", CASES)
def test_resumes_at_another_world_stage_and_offload_as_if_uninterrupted(
    case: str, runs: tuple[dict[str, Any], dict[str, list[Any]]]
) -> None:
    saved, resumed = runs
    expected = saved[case.split("->")[0]]["losses"][BEFORE:]
    for rank, r in enumerate(resumed[case]):
        assert r["global_steps"] == BEFORE, rank
        assert r["client"] == {"data_position": BEFORE * GLOBAL_BATCH}
        assert len(r["losses"]) == AFTER
        # Adam's m, v and step came along: a fresh optimizer state would give other losses at once
        assert r["losses"] == pytest.approx(expected, rel=1e-6), rank


def test_each_rank_reads_only_its_slices(runs: tuple[dict[str, Any], dict[str, list[Any]]]) -> None:
    _, resumed = runs
    # one copy of the model's fp32 master + Adam m, v (3 x 4 bytes per element), read by one rank at stage 0
    whole = resumed["w2s3cpu->w1s0none"][0]["bytes_read"]
    for case in ("w2s1->w4s0none", "w2s3cpu->w4s1cpu", "w1s0->w4s2none"):
        reads = [r["bytes_read"] for r in resumed[case]]
        if "s0" in case.split("->")[1]:  # every stage-0 rank holds everything
            assert all(0.9 * whole <= b <= 1.1 * whole for b in reads), (case, reads, whole)
        else:  # a quarter each, plus the small per-rank entries (counters, RNG, buffers)
            assert all(0 < b < 0.5 * whole for b in reads), (case, reads, whole)
            assert sum(reads) < 1.6 * whole, (case, reads, whole)


def test_without_the_optimizer_state_the_losses_differ(tmp_path) -> None:
    # the control of the matrix above: the resumed losses depend on the Adam state that came along

    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(1, world=1))
    engine_losses(engine, BEFORE)
    engine.save_checkpoint(tmp_path)
    expected = engine_losses(engine, AFTER, start=BEFORE)
    fresh, _, _, _ = dstrain.initialize(model=make_model(seed=2), config=base_config(3, world=1))
    fresh.load_checkpoint(tmp_path, load_optimizer_states=False)
    got = engine_losses(fresh, AFTER, start=BEFORE)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)  # the same weights before the first step
    assert got[1] != pytest.approx(expected[1], rel=1e-3)  # a fresh Adam takes another first step


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameters(tmp_path) -> None:

    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(2, world=1))
    engine_losses(engine, 1)
    engine.save_checkpoint(tmp_path)
    for stage in (2, 3):  # the same shape (native load) and another (resharded): refused alike
        other, _, _, _ = dstrain.initialize(model=make_model(dim=8), config=base_config(stage, world=1))
        before = other.full_state_dict()
        with pytest.raises(dstrain.CheckpointMismatchError) as e:
            other.load_checkpoint(tmp_path)
        assert set(e.value.reshaped) == {"emb.weight", "pos", "block.0.weight", "block.0.bias", "block.2.weight",
                                         "block.2.bias", "ln.weight", "ln.bias"}  # fmt: skip
        assert "emb.weight [32, 16] (model [32, 8])" in str(e.value)
        assert other.global_steps == 0  # nothing was applied
        assert all(torch.equal(before[k], v) for k, v in other.full_state_dict().items())
        other.close()


@pytest.mark.parametrize("damage", ["bit-flip", "truncate"])
@pytest.mark.parametrize("stage", [1, 3])  # the same shape (native load) and another (resharded)
def test_a_damaged_rank_file_is_detected_before_anything_is_applied(
    tmp_path, damage: str, stage: int
) -> None:

    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(1, world=1))
    engine_losses(engine, 2)
    path = engine.save_checkpoint(tmp_path)
    engine.close()
    data = bytearray(path.read_bytes())
    if damage == "bit-flip":
        data[len(data) // 2] ^= 0x10  # inside the tensors' bytes (the header is a few KB at the start)
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    other, _, _, _ = dstrain.initialize(model=make_model(seed=4), config=base_config(stage, world=1))
    before = other.full_state_dict()
    with pytest.raises((dsio.ChecksumError, dsio.CheckpointFormatError)):
        other.load_checkpoint(tmp_path)
    assert other.global_steps == 0
    assert all(torch.equal(before[k], v) for k, v in other.full_state_dict().items())
    other.close()


def test_a_bit_flip_in_the_slice_another_rank_reads_is_detected_before_anything_is_applied(tmp_path) -> None:
    # saved by one rank, loaded by two: the new rank 1 reads only the second half of each saved tensor
    # (a partial read, which the whole-tensor crc32c cannot check): the blocks it reads are checked first
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(1, world=1))
    engine_losses(engine, 2)
    path = engine.save_checkpoint(tmp_path)
    engine.close()
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    entries = {k: v for k, v in json.loads(data[8 : 8 + n]).items() if k != "__metadata__"}
    masters = [k for k in entries if "master" in k]
    assert masters, sorted(entries)
    begin, end = entries[masters[0]]["data_offsets"]
    data[8 + n + begin + (end - begin) * 3 // 4] ^= 0x04  # a bit of the master's second half
    path.write_bytes(bytes(data))
    out = spawn(damaged_load, str(tmp_path), 1, world=2, start_method="forkserver")
    assert out[1]["error"] == "ChecksumError", out
    for r in out:  # (the small tensors of this model are one block each: rank 0 reads that block too)
        assert r["error"] == "ChecksumError", out
        assert r["global_steps"] == 1 and r["params_unchanged"] and r["optimizer_unchanged"], out


def test_one_bit_adam_state_at_another_stage_is_refused_naming_both_shapes(tmp_path) -> None:

    onebit = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 2}}
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(0, world=1, optimizer=onebit))
    engine_losses(engine, 3)
    engine.save_checkpoint(tmp_path)
    engine.close()
    other, _, _, _ = dstrain.initialize(
        model=make_model(seed=1), config=base_config(1, world=1, optimizer=onebit)
    )
    with pytest.raises(dstrain.ReshapeError) as e:
        other.load_checkpoint(tmp_path)
    assert "ZeRO stage 0" in str(e.value) and "stage 1" in str(e.value) and "error feedback" in str(e.value)
    other.load_checkpoint(tmp_path, load_optimizer_states=False)  # the weights alone reshard
    assert other.global_steps == 3
    other.close()


def test_loss_scaler_and_lr_schedule_come_along_when_resharded(tmp_path) -> None:
    warmup = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8},
    }
    fp16 = {
        "enabled": True,
        "initial_scale_power": 20,
        "loss_scale_window": 2,
    }  # skips, then grows and shrinks
    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=base_config(1, world=1, fp16=fp16, scheduler=warmup)
    )
    engine_losses(engine, BEFORE)
    engine.save_checkpoint(tmp_path)
    state = (engine.loss_scale, engine.get_lr(), engine.skipped_steps)
    expected = engine_losses(engine, AFTER, start=BEFORE)
    other, _, _, _ = dstrain.initialize(
        model=make_model(seed=6), config=base_config(3, world=1, fp16=fp16, scheduler=warmup)
    )
    other.load_checkpoint(tmp_path)
    assert (other.loss_scale, other.get_lr(), other.skipped_steps) == state
    assert state[0] != 2.0**20 and state[2] > 0  # the scaler moved: restoring it is what is tested
    assert engine_losses(other, AFTER, start=BEFORE) == pytest.approx(expected, rel=1e-6)


def test_resharded_into_stage3_with_parameters_and_optimizer_state_on_nvme(tmp_path) -> None:
    # the master and Adam's m, v are streamed from the saved file into the swap files, never whole
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(1, world=1))
    engine_losses(engine, BEFORE)
    engine.save_checkpoint(tmp_path / "ck")
    expected = engine_losses(engine, AFTER, start=BEFORE)
    engine.close()
    cfg = base_config(3, world=1)
    nvme = str(tmp_path / "nvme")
    cfg["zero_optimization"].update(
        sub_group_size=1024,
        offload_optimizer={"device": "nvme", "nvme_path": nvme, "buffer_count": 2},
        offload_param={"device": "nvme", "nvme_path": nvme, "buffer_count": 3, "buffer_size": 1 << 20},
    )
    (tmp_path / "nvme").mkdir()
    other, _, _, _ = dstrain.initialize(model=make_model(seed=5), config=cfg)
    other.load_checkpoint(tmp_path / "ck")
    assert engine_losses(other, AFTER, start=BEFORE) == pytest.approx(expected, rel=1e-6)
    other.close()


def test_an_assembled_tensor_raises_only_once_every_piece_read_ended():
    # a piece that fails at once must not leave another still reading into the caller's buffer
    import asyncio

    from dsio.checkpoint import LazyTensor
    from dstrain.checkpoint.reshape import Assembled

    class Failing(LazyTensor):
        async def read_into(self, io: Any, offset: int, out: torch.Tensor) -> None:
            raise OSError(5, "the disk said no")

    class Slow(LazyTensor):
        ended = False

        async def read_into(self, io: Any, offset: int, out: torch.Tensor) -> None:
            await asyncio.sleep(0.05)
            out.fill_(7)
            self.ended = True

    slow = Slow(torch.uint8, (8,))
    whole = Assembled(torch.uint8, (16,), [(0, 8, Failing(torch.uint8, (8,)), 0), (8, 8, slow, 0)])
    out = torch.zeros(16, dtype=torch.uint8)

    async def read() -> bool:
        with pytest.raises(OSError):
            await whole.read_into(None, 0, out)  # type: ignore[arg-type]
        return slow.ended

    assert asyncio.run(read()) is True
    assert torch.equal(out[8:], torch.full((8,), 7, dtype=torch.uint8))
