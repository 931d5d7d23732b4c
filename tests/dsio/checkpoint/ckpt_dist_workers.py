"""Code that runs inside spawned ranks (importable by module name for the spawn start method)."""

from __future__ import annotations

import asyncio
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from ckpt_helpers import assert_same, make_state

import dsio
import dsio.checkpoint as C


def checkpointer_scenario(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    run = os.path.join(root, "run")

    async def main() -> dict:
        async with C.Checkpointer(run, keep_last=2) as ck:
            assert (ck.rank, ck.world_size) == (rank, world)
            # 1. Realistic state, different on each rank; training mutates it as soon as it is staged.
            state = make_state(seed=10 + rank)
            task = await ck.save(1, state)
            await ck.wait_staged()
            for t in state["model"].values():
                t.zero_()
            res = await task
            assert res.step == 1
            d = os.path.join(run, "step-000000001")
            assert sorted(os.listdir(d)) == [
                "manifest.json",
                "rank-00000.safetensors",
                "rank-00001.safetensors",
            ]
            with open(os.path.join(d, "manifest.json")) as f:
                assert json.load(f)["world_size"] == 2
            assert_same(make_state(seed=10 + rank), await ck.load())

            # 2. One rank fails: nothing is committed anywhere, and the partial step is removed.
            if rank == 1:
                with pytest.raises(dsio.UnsupportedStateError):
                    await ck.save(2, {"bad": lambda: 0})
            else:
                task = await ck.save(2, {"good": torch.ones(3)})
                with pytest.raises(dsio.checkpoint.CheckpointCommitError, match="rank 1"):
                    await task
            dist.barrier()
            assert ck.steps() == [1]
            assert sorted(os.listdir(run)) == ["latest", "step-000000001", "writer.lock"], os.listdir(run)
            dist.barrier()  # before anyone starts the next step's .tmp

            # 3. Saving goes on; retention keeps the newest two.
            for step in (3, 4):
                await (await ck.save(step, {"step": step, "w": torch.full((5,), float(rank))}))
            assert ck.steps() == [3, 4]
            back = await ck.load()
            assert back["step"] == 4 and torch.equal(back["w"], torch.full((5,), float(rank)))
            return {"stats": ck.statistics().saves}

    return asyncio.run(main())


def dcp_scenario(root: str) -> bool:
    import torch.distributed.checkpoint as dcp

    from dsio.checkpoint.dcp import DsioStorageReader, DsioStorageWriter

    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    torch.manual_seed(0)  # replicated model: DCP writes each tensor once
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), f"only_rank{rank}": torch.full((4,), float(rank)), "step": 7}
    path = os.path.join(root, "dcp")
    dcp.save(sd, storage_writer=DsioStorageWriter(path))
    fresh = {"model": torch.nn.Linear(16, 8).state_dict(), f"only_rank{rank}": torch.zeros(4), "step": 0}
    dcp.load(fresh, storage_reader=DsioStorageReader(path))
    assert torch.equal(fresh["model"]["weight"], model.weight.detach())
    assert torch.equal(fresh[f"only_rank{rank}"], torch.full((4,), float(rank)))
    assert fresh["step"] == 7
    apath = os.path.join(root, "dcp_async")
    fut = dcp.async_save(sd, storage_writer=DsioStorageWriter(apath))
    fut.result()
    fresh2 = {"model": torch.nn.Linear(16, 8).state_dict(), f"only_rank{rank}": torch.zeros(4), "step": 0}
    dcp.load(fresh2, storage_reader=DsioStorageReader(apath))
    assert torch.equal(fresh2["model"]["bias"], model.bias.detach()) and fresh2["step"] == 7
    return True


def both(root: str) -> tuple:
    return checkpointer_scenario(root), dcp_scenario(root)
