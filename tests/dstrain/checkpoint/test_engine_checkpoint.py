"""Checkpoints: save, fresh processes, resume reproduces the uninterrupted losses; client_state round-trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import (
    CLIENT_STATE,
    base_config,
    checkpoint_resume_run,
    checkpoint_save_run,
    engine_losses,
    make_model,
    make_store,
    spawn,
)

import dstrain
from dstrain import CheckpointNotFoundError


def _scenarios(world: int) -> dict[str, dict[str, Any]]:
    micro = 4 // world
    warmup = {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}}
    return {
        "stage0": base_config(0, world=world, micro=micro),
        "stage1_fp16_sched": base_config(
            1, world=world, micro=micro, fp16={"enabled": True, "initial_scale_power": 8}, scheduler=warmup
        ),
        "stage2_bf16_clip": base_config(
            2, world=world, micro=micro, bf16={"enabled": True}, gradient_clipping=0.5
        ),
        "stage3_gas2": base_config(3, world=world, micro=micro // 2, gas=2),
        "stage3_async": base_config(3, world=world, micro=micro),
        "stage1_bf16_async": base_config(1, world=world, micro=micro, bf16={"enabled": True}),
        "stage2_subgroups": base_config(
            2, world=world, micro=micro, zero_optimization={"stage": 2, "sub_group_size": 300}
        ),
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    root = str(tmp_path_factory.mktemp("ckpt2"))
    uninterrupted = spawn(checkpoint_save_run, root, _scenarios(2), world=2, start_method="forkserver")
    resumed = spawn(
        checkpoint_resume_run, root, _scenarios(2), world=2, start_method="forkserver"
    )  # new processes
    return uninterrupted, resumed


@pytest.mark.parametrize("name", list(_scenarios(2)))
def test_resume_in_new_processes_reproduces_losses(name: str, world2: tuple[list[Any], list[Any]]) -> None:
    uninterrupted, resumed = world2
    for rank in (0, 1):
        expected = uninterrupted[rank][name]["losses"][10:]
        assert resumed[rank][name]["losses"] == pytest.approx(expected, rel=1e-6, abs=1e-6)
        assert torch.equal(resumed[rank][name]["rng"], uninterrupted[rank][name]["rng"])
        assert resumed[rank][name]["global_steps"] == 10
        assert resumed[rank][name]["client_state"] == CLIENT_STATE


def _dsio_store_missing() -> str | None:
    """Why DsioStore cannot run here: only a missing native core counts (any other error fails the tests)."""
    import dsio

    try:
        dsio.backend_status()
    except dsio.BackendUnavailableError as e:
        return f"dsio's native core is not built here: {e}"
    return None


STORES = [
    pytest.param("torch", id="torch.save"),
    pytest.param(
        "dsio",
        id="dsio",
        marks=pytest.mark.skipif(_dsio_store_missing() is not None, reason=str(_dsio_store_missing())),
    ),
]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", list(_scenarios(1)))
def test_resume_world1(name: str, store: str, tmp_path: Path) -> None:
    cfg = _scenarios(1)[name]
    uninterrupted = checkpoint_save_run(str(tmp_path), {name: cfg}, store)[name]
    resumed = checkpoint_resume_run(str(tmp_path), {name: cfg}, store)[name]
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][10:], rel=1e-6, abs=1e-6)
    assert torch.equal(resumed["rng"], uninterrupted["rng"])
    assert resumed["client_state"] == CLIENT_STATE


@pytest.mark.parametrize("store", STORES)
def test_layout_latest_and_tags(store: str, tmp_path: Path) -> None:
    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=base_config(1, world=1), checkpoint_store=make_store(store)
    )
    engine_losses(engine, 2)
    default = engine.save_checkpoint(tmp_path, client_state={"which": "default"})
    named = engine.save_checkpoint(tmp_path, tag="named", client_state={"which": "named"})
    engine_losses(engine, 1, start=2)
    hidden = engine.save_checkpoint(tmp_path, save_latest=False, client_state={"which": "hidden"})
    suffix = engine.store.suffix
    # save_dir is one checkpoint directory: step-N per default-tagged save, latest naming the newest
    assert default == tmp_path / "step-000000002" / f"rank-00000{suffix}" and default.is_file()
    assert (tmp_path / "latest").read_text().strip() == "step-000000002"
    # a named tag, or save_latest=False, is a checkpoint directory of its own: save_dir's latest untouched
    assert named == tmp_path / "named" / "step-000000002" / f"rank-00000{suffix}" and named.is_file()
    assert hidden == tmp_path / "global_step3" / "step-000000003" / f"rank-00000{suffix}"
    assert not list(tmp_path.rglob("*.tmp"))
    if store == "dsio":  # committed by dsio's Checkpointer: a manifest per step
        assert (tmp_path / "step-000000002" / "manifest.json").is_file()
    for tag, which in (
        (None, "default"),
        ("named", "named"),
        ("global_step2", "default"),
        ("global_step3", "hidden"),
    ):
        path, client = engine.load_checkpoint(tmp_path, tag=tag)
        assert client == {"which": which}, tag
    assert engine.global_steps == 3
    engine.close()


def test_missing_checkpoint_raises(tmp_path: Path) -> None:
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(0, world=1))
    with pytest.raises(CheckpointNotFoundError):
        engine.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        engine.load_checkpoint(tmp_path, tag="nope")
    engine.close()


def test_loading_into_another_stage_reshards(tmp_path: Path) -> None:
    # once refused (DstrainError: "saved at ZeRO stage 1 ... this engine runs stage 2"); the world-size
    # and offload matrix is tests/dstrain/checkpoint/test_checkpoint_reshape.py
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(1, world=1))
    engine_losses(engine, 2)
    engine.save_checkpoint(tmp_path)
    expected = engine_losses(engine, 2, start=2)
    other, _, _, _ = dstrain.initialize(model=make_model(seed=3), config=base_config(2, world=1))
    other.load_checkpoint(tmp_path)
    assert other.global_steps == 2
    assert engine_losses(other, 2, start=2) == pytest.approx(expected, rel=1e-6)


def test_torch_save_files_load_without_unpickling(tmp_path: Path) -> None:
    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=base_config(3, world=1), checkpoint_store=dstrain.TorchSaveStore()
    )
    engine_losses(engine, 1)
    path = engine.save_checkpoint(tmp_path, client_state={"epoch": 1})
    state = torch.load(path, weights_only=True)  # raises if anything needs arbitrary unpickling
    assert state["engine"]["global_steps"] == 1 and state["client_state"] == {"epoch": 1}
    assert set(state) >= {"format", "zero", "stepper", "precision", "lr_scheduler", "rng", "module_extra"}
    engine.close()


@pytest.mark.skipif(_dsio_store_missing() is not None, reason=str(_dsio_store_missing()))
def test_dsio_files_are_safetensors_and_torch_save_ones_stay_loadable(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    old, _, _, _ = dstrain.initialize(
        model=make_model(), config=base_config(2, world=1), checkpoint_store=dstrain.TorchSaveStore()
    )
    engine_losses(old, 2)
    old.save_checkpoint(tmp_path / "old")
    new, _, _, _ = dstrain.initialize(
        model=make_model(seed=5), config=base_config(2, world=1), checkpoint_store=dstrain.DsioStore()
    )
    new.load_checkpoint(tmp_path / "old")  # a .pt written before dsio: read with torch.load
    assert new.global_steps == 2
    path = new.save_checkpoint(tmp_path / "new")
    assert path.suffix == ".safetensors"
    tensors = safetensors.load_file(str(path))
    assert any(t.numel() == new.zero.groups[0].master.numel() for t in tensors.values())


@pytest.mark.parametrize("store", STORES)
def test_async_save_captures_the_state_at_the_call(store: str, tmp_path: Path) -> None:
    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=base_config(2, world=1), checkpoint_store=make_store(store)
    )
    engine_losses(engine, 2)
    at_save = engine.full_state_dict()
    path = engine.save_checkpoint(tmp_path, client_state={"k": 1}, async_save=True)
    engine_losses(engine, 2, start=2)  # training goes on, changing the weights; the captured state is written
    assert not torch.equal(engine.full_state_dict()["block.0.weight"], at_save["block.0.weight"])
    assert engine.wait_checkpoint() == path and path.is_file()
    assert (tmp_path / "latest").read_text().strip() == "step-000000002"
    assert engine.wait_checkpoint() is None
    engine.close()
    other, _, _, _ = dstrain.initialize(
        model=make_model(seed=9), config=base_config(2, world=1), checkpoint_store=make_store(store)
    )
    _, client = other.load_checkpoint(tmp_path)
    assert client == {"k": 1} and other.global_steps == 2
    loaded = other.full_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in at_save.items())
    other.close()


@pytest.mark.parametrize("store", STORES)
def test_a_failed_save_commits_nothing_and_keeps_the_previous_step(store: str, tmp_path: Path) -> None:
    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=base_config(1, world=1), checkpoint_store=make_store(store)
    )
    engine_losses(engine, 1)
    engine.save_checkpoint(tmp_path, client_state={"ok": True})
    engine_losses(engine, 1, start=1)
    with pytest.raises(Exception):  # noqa: B017 - each store raises its own serialisation error
        engine.save_checkpoint(tmp_path, client_state={"not storable": (i for i in range(1))})
    assert not (tmp_path / "step-000000002").exists()
    assert not list(tmp_path.glob("step-*.tmp"))
    assert (tmp_path / "latest").read_text().strip() == "step-000000001"
    _, client = engine.load_checkpoint(tmp_path)
    assert client == {"ok": True} and engine.global_steps == 1
    engine.close()
