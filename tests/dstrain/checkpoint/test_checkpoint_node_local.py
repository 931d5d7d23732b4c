"""Checkpoints across hosts: per-host directories (checkpoint.use_node_local_storage), the step agreed by
every rank, leftovers of failed saves removed by their rank. Each rank's own directory stands in for a host."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _dstrain_helpers import base_config, engine_losses, make_model, spawn
from _reshape_workers import GLOBAL_BATCH, node_local_run

import dstrain


def _run(root: Path, node_local: bool, phase: str) -> list[dict]:
    return spawn(node_local_run, str(root), node_local, phase, world=2, start_method="forkserver")


@pytest.fixture(scope="module")
def node_local_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One node-local "save" run (the same in every test that starts from it): its hosts' directories
    and what each rank reported. Tests work on a copy (`_saved_into`)."""
    root = tmp_path_factory.mktemp("node-local-save")
    return root, _run(root, True, "save")


def _saved_into(node_local_save: tuple[Path, list[dict]], tmp_path: Path) -> list[dict]:
    root, saved = node_local_save
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    return saved


def test_a_directory_not_shared_by_every_rank_is_refused_naming_the_key(tmp_path: Path) -> None:
    for r in _run(tmp_path, False, "save"):
        kind, message, _, _ = r["error"]
        assert kind == "DstrainError" and "use_node_local_storage" in message and "not shared" in message
    assert not list(tmp_path.rglob("step-*"))  # refused before anything was written


def test_node_local_storage_commits_per_host_and_resumes(node_local_save, tmp_path: Path) -> None:
    saved = _saved_into(node_local_save, tmp_path)
    for rank, r in enumerate(saved):
        assert "error" not in r, r
        assert r["failed_save"] == "DstrainError"  # rank 1 could not store its state: nothing committed
        assert r["after_failed"] == ["latest", "step-000000002"], r["after_failed"]  # no .tmp left either
        host = tmp_path / f"host{rank}"
        assert (host / "latest").read_text().strip() == "step-000000004"
        step = host / "step-000000004"
        assert sorted(p.name for p in step.iterdir()) == ["manifest.json", f"rank-{rank:05d}.safetensors"]
        manifest = json.loads((step / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and [f["rank"] for f in manifest["files"]] == [rank]
    # a killed save left this rank's file behind: its next load removes it
    leftover = tmp_path / "host1" / "step-000000009.tmp" / "rank-00001.safetensors"
    leftover.parent.mkdir()
    leftover.write_bytes(b"partial")
    resumed = _run(tmp_path, True, "load")
    assert not leftover.parent.exists()
    for s, r in zip(saved, resumed, strict=True):
        assert r["client"] == {"at": 4}
        assert r["losses"] == s["losses"][4:]  # same world, stage and arithmetic: bitwise


def test_ranks_that_see_different_committed_steps_all_fail_naming_step_and_rank(
    node_local_save, tmp_path: Path
) -> None:
    _saved_into(node_local_save, tmp_path)
    # host 1 lost its step 4 (it died after rank 0 committed): its latest says step 2
    shutil.rmtree(tmp_path / "host1" / "step-000000004")
    (tmp_path / "host1" / "latest").write_text("step-000000002\n")
    for r in _run(tmp_path, True, "load"):
        kind, message, step, rank = r["error"]
        assert (kind, step, rank) == ("CheckpointRankError", 4, 1), r["error"]
        assert str(tmp_path / "host1") in message


def test_at_another_world_size_refused_naming_both_until_every_rank_file_is_there(
    node_local_save, tmp_path: Path
) -> None:
    # saved by 2 ranks into their own hosts' directories; one rank loads host 0's, which lacks rank 1's file
    saved = _saved_into(node_local_save, tmp_path)
    host0 = tmp_path / "host0"
    cfg = base_config(1, world=1, micro=GLOBAL_BATCH, checkpoint={"use_node_local_storage": True})
    engine, _, _, _ = dstrain.initialize(model=make_model(seed=8), config=cfg)
    with pytest.raises(dstrain.ReshapeError) as e:
        engine.load_checkpoint(host0)
    message = str(e.value)
    assert "saved at world size 2" in message and "runs world size 1" in message, message
    assert "rank-00001.safetensors" in message and "use_node_local_storage" in message, message
    assert engine.global_steps == 0
    # with host 1's file beside it, the same directory reshards into the one rank and trains on
    shutil.copy(tmp_path / "host1" / "step-000000004" / "rank-00001.safetensors", host0 / "step-000000004")
    _, client = engine.load_checkpoint(host0)
    assert client == {"at": 4} and engine.global_steps == 4
    assert engine_losses(engine, 2, start=4) == pytest.approx(saved[0]["losses"][4:], rel=1e-6)
    engine.close()
