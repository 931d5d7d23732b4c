"""Two real ranks (gloo, processes forked from the session's fork server): per-rank files, commit after
all ranks, DCP plugin."""

from __future__ import annotations

import asyncio

import pytest
from ckpt_dist_workers import both
from ckpt_helpers import spawn

import dsio
import dsio.checkpoint as C


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist"))
    return root, spawn(both, root, world=2)


def test_two_ranks_checkpointer_and_dcp(two_rank_run):
    _, results = two_rank_run
    assert [r[0]["stats"] for r in results] == [3, 3]  # steps 1, 3, 4 committed on both ranks
    assert all(r[1] for r in results)


def test_loading_with_another_world_size_is_a_clear_error(two_rank_run):
    root, _ = two_rank_run

    async def main():
        async with C.Checkpointer(f"{root}/run") as ck:
            assert ck.steps() == [3, 4]
            with pytest.raises(dsio.errors.CheckpointMismatchError, match="2 ranks"):
                await ck.load()

    asyncio.run(main())
