"""Checkpoints of offloaded runs: they load into a run with another offload setting and continue bitwise;
a kill -9 in the middle of a save leaves the previous checkpoint loadable, and it continues bitwise."""

from __future__ import annotations

import os
import textwrap
from typing import Any

import pytest
import torch
from _dstrain_helpers import spawn
from _offload_helpers import kill_at, resume_run

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

PAIRS = [(2, "nvme", "none"), (3, "none", "nvme"), (1, "cpu", "nvme")]


def _all_pairs(root: str) -> dict[str, Any]:
    return {f"{s}-{a}-{b}": resume_run(root, s, a, b, steps=3) for s, a, b in PAIRS}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> list[dict[str, Any]]:
    return spawn(_all_pairs, str(tmp_path_factory.mktemp("offload-ckpt")), world=2, start_method="forkserver")


@pytest.mark.parametrize(("stage", "saved", "loaded"), PAIRS)
def test_checkpoint_moves_between_offload_settings_bitwise(
    resumed: list[dict[str, Any]], stage: int, saved: str, loaded: str
) -> None:
    for rank in resumed:
        r = rank[f"{stage}-{saved}-{loaded}"]
        assert r["resumed"] == r["whole"]  # exact: the resumed run is the uninterrupted one
        for a, b in zip(r["params"], r["ref_params"], strict=True):
            assert torch.equal(a, b)


CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = [{helpers!r}, {helpers!r} + "/.."]  # the offload room, tests/dstrain
    from _dstrain_helpers import engine_losses, make_model
    from _offload_helpers import offload_config
    import dstrain

    root, swap = {root!r}, {swap!r}
    engine, opt, _, _ = dstrain.initialize(model=make_model(), config=offload_config(2, "nvme", swap))
    engine_losses(engine, 3)
    engine.save_checkpoint(root)  # step 3: committed before the kill can come
    print("SAVING", flush=True)
    step = 3
    while True:  # train a step, save it, again and again until killed: the kill lands in some save
        engine_losses(engine, 1, start=step)
        step += 1
        engine.save_checkpoint(root)
    """
)


@pytest.mark.usefixtures("one_thread")
def test_kill9_during_save_previous_checkpoint_resumes_bitwise(tmp_path) -> None:
    """A process training with NVMe optimizer offload is killed with SIGKILL while saving; a new
    process loads the last committed checkpoint and its losses equal an uninterrupted run's."""
    root, swap = tmp_path / "ckpt", tmp_path / "swap"
    swap.mkdir()
    helpers = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(helpers=helpers, root=str(root), swap=str(swap))
    kill_at(code, "SAVING", after=0.3)  # inside the save loop by then (each save takes tens of ms)
    # one_thread: as in the child, so that float reductions split the same way
    (resumed, resumed_at), whole = _resume_and_reference(str(root), str(swap))
    assert resumed_at >= 3  # the first save, or a later one that did commit before the kill
    assert resumed == whole[resumed_at:]


def _resume_and_reference(root: str, swap: str) -> tuple[tuple[list[float], int], list[float]]:
    from _dstrain_helpers import engine_losses, make_model
    from _offload_helpers import offload_config

    import dstrain

    engine, opt, _, _ = dstrain.initialize(model=make_model(seed=5), config=offload_config(2, "nvme", swap))
    engine.load_checkpoint(root)
    resumed_at = engine.global_steps
    resumed = engine_losses(engine, 3, start=resumed_at)
    engine.close()
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=offload_config(2, "none", swap))
    whole = engine_losses(engine, resumed_at + 3)
    engine.close()
    return (resumed, resumed_at), whole


POINT_CHILD = textwrap.dedent(
    """
    import asyncio, os, sys, time
    sys.path[:0] = [{helpers!r}, {helpers!r} + "/.."]  # the offload room, tests/dstrain
    from _dstrain_helpers import engine_losses, make_model
    from _offload_helpers import offload_config
    import dstrain
    import dsio.checkpoint._commit as commit
    from dstrain.checkpoint.sources import SwapRegions

    root, swap, point = {root!r}, {swap!r}, {point!r}
    engine, opt, _, _ = dstrain.initialize(model=make_model(), config=offload_config(2, "nvme", swap))
    engine_losses(engine, 3)
    engine.save_checkpoint(root)  # step 3: committed
    engine_losses(engine, 1, start=3)

    def announce():
        print("AT " + point, flush=True)
        time.sleep(120)  # killed here

    if point == "streaming":  # some of the swapped state is in the new file, the rest is not
        read = SwapRegions.read_into

        async def read_then_stop(self, io, offset, out):
            await read(self, io, offset, out)
            announce()

        SwapRegions.read_into = read_then_stop
    elif point == "before_commit":  # every rank's file is written and fsynced, the step not renamed
        commit.commit = lambda *a: announce()
    engine.save_checkpoint(root)  # step 4: killed inside
    print("SAVED", flush=True)
    """
)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("point", ["streaming", "before_commit"])
def test_kill9_at_points_of_a_streamed_save_resumes_bitwise(tmp_path, point: str) -> None:
    """SIGKILL at a chosen point of a save whose Adam state streams from the NVMe swap file: the
    directory holds the partial step, and a new process resumes from step 3 exactly as an
    uninterrupted run. (Kills at every point of the commit protocol itself: tests/dsio/checkpoint.)"""
    root, swap = tmp_path / "ckpt", tmp_path / "swap"
    swap.mkdir()
    helpers = os.path.dirname(os.path.abspath(__file__))
    code = POINT_CHILD.format(helpers=helpers, root=str(root), swap=str(swap), point=point)
    kill_at(code, f"AT {point}")
    assert (root / "step-000000004.tmp").is_dir() and not (root / "step-000000004").exists()
    assert (root / "latest").read_text().strip() == "step-000000003"
    (resumed, resumed_at), whole = _resume_and_reference(str(root), str(swap))  # one_thread, as above
    assert resumed_at == 3
    assert resumed == whole[3:]
