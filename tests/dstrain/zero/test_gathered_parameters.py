"""``dstrain.zero.GatheredParameters`` on an engine's ZeRO-3 units (after ``initialize``): every rank
sees whole values inside the block; with ``modifier_rank`` that rank's changes become every rank's
shard and fp32 master wherever they live (offload none / cpu / nvme), so training continues exactly
as a model changed before ``initialize`` does; other ranks' changes, and every change without
``modifier_rank``, are discarded."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
from _dstrain_helpers import DIM, base_config, engine_losses, global_batch, make_model, spawn

import dstrain
from dstrain.errors import InitError
from dstrain.zero import GatheredParameters

STEPS = 2
CASES = ("none", "none-persistent", "cpu", "cpu-bf16", "nvme", "nvme-bf16")


def _config(case: str, root: str, world: int) -> dict[str, Any]:
    cfg = base_config(3, world=world, micro=2)
    z = cfg["zero_optimization"]
    offload = case.split("-")[0]
    if offload in ("cpu", "nvme"):
        where = {"device": offload} if offload == "cpu" else {"device": "nvme", "nvme_path": root}
        z["offload_param"] = dict(where)
        z["offload_optimizer"] = dict(where)
        z["sub_group_size"] = 1 << 10  # several optimizer sub-groups over the units
    if case.endswith("persistent"):
        z["stage3_param_persistence_threshold"] = 1 << 30  # every unit stays gathered
    if case.endswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def _modify(model: torch.nn.Module, rank: int, modifier: int) -> None:
    """What the modifier rank changes (in place, by index, and by assigning ``.data``); the other
    ranks change the same parameters differently (to be discarded)."""
    emb, out, ln = model.emb.weight, model.block[2].weight, model.ln.bias
    with torch.no_grad():
        if rank == modifier:
            emb[3] = torch.linspace(-1.0, 1.0, DIM)  # rounded to the parameter's dtype as a cast would
            out.mul_(-1.0)
            ln.data = torch.full(ln.shape, 0.3, dtype=ln.dtype)
        else:
            emb.fill_(9.0)
            out.zero_()
            ln.data = torch.full(ln.shape, -4.0, dtype=ln.dtype)


def _whole(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's whole value, as this rank sees it inside a read-only block."""
    module = engine.module
    with GatheredParameters(list(module.parameters())):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _case(case: str) -> dict[str, Any]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    modifier = 1 if case == "none" else 0  # one case names the other rank
    root = tempfile.mkdtemp(prefix="gathered-", dir=os.environ.get("DSTRAIN_TEST_NVME"))
    try:
        cfg = _config(case, root, world)
        # the reference: the same change made to the whole model before initialize
        ref_model = make_model()
        _modify(ref_model, modifier, modifier)
        ref = dstrain.initialize(model=ref_model, config=cfg)[0]
        ref_values = _whole(ref)
        ref_losses = engine_losses(ref, STEPS)
        ref_state = {k: v.float().clone() for k, v in ref.full_state_dict().items()}
        ref.close()

        engine = dstrain.initialize(model=make_model(), config=cfg)[0]
        before = _whole(engine)
        names = ("emb.weight", "block.2.weight", "ln.bias")
        params = [engine.module.get_parameter(n) for n in names]
        with GatheredParameters(params):  # read-only: every rank's changes are discarded
            _modify(engine.module, rank, modifier)
            _modify(engine.module, modifier, modifier)
        discarded = _whole(engine)
        with torch.no_grad():  # an evaluation pass first: an NVMe store's read-ahead holds buffers now
            engine(*global_batch(0, 2))
        with GatheredParameters(params, modifier_rank=modifier):
            seen = {n: p.detach().float().clone() for n, p in zip(names, params, strict=True)}
            _modify(engine.module, rank, modifier)
        after = _whole(engine)
        losses = engine_losses(engine, STEPS)
        state = {k: v.float().clone() for k, v in engine.full_state_dict().items()}
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "seen_equal_before": all(torch.equal(v, before[n]) for n, v in seen.items()),
        "discarded": all(torch.equal(discarded[n], v) for n, v in before.items()),
        "after_equal_ref": all(torch.equal(after[n], v) for n, v in ref_values.items()),
        "changed": not torch.equal(after["emb.weight"], before["emb.weight"]),
        "ref_losses": ref_losses,
        "losses": losses,
        "state_equal": sorted(state) == sorted(ref_state)
        and all(torch.equal(state[k], v) for k, v in ref_state.items()),
    }


def _mid_training(case: str) -> dict[str, Any]:
    """A change after a step and an evaluation pass: the pass leaves the NVMe store's read-ahead
    holding shards of the trace's backward half (read before the change, so stale after it)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    root = tempfile.mkdtemp(prefix="gathered-", dir=os.environ.get("DSTRAIN_TEST_NVME"))
    try:
        engine = dstrain.initialize(model=make_model(), config=_config(case, root, world))[0]
        engine_losses(engine, 1)
        plain = make_model()  # the expected model: the engine's values after the step, then the change
        plain.load_state_dict(_whole(engine), strict=False)  # head.weight: tied to emb.weight
        _modify(plain, 0, 0)
        batch = global_batch(1, 2)
        with torch.no_grad():
            engine(*batch)
            with GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
                _modify(engine.module, rank, 0)
            after = _whole(engine)
            loss = engine(*batch).item()
            expected_loss = plain(*batch).item()
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "after_equal": all(torch.equal(after[n], p.detach()) for n, p in plain.named_parameters()),
        "loss": loss,
        "expected_loss": expected_loss,
    }


def _all_cases() -> dict[str, Any]:
    out = {case: _case(case) for case in CASES}
    out["mid-training"] = _mid_training("nvme")
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return spawn(_all_cases, world=2, start_method="forkserver")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank", [0, 1])
def test_modifier_rank_writes_into_every_partition(
    world2: list[dict[str, Any]], case: str, rank: int
) -> None:
    out = world2[rank][case]
    assert out["seen_equal_before"]  # inside the block: the whole parameters, the same on every rank
    assert out["discarded"]  # modifier_rank=None: nothing written back (persistent units regathered)
    assert out["changed"] and out["after_equal_ref"]  # the modifier's values only, on every rank
    # the next steps start from the written shards and fp32 master: the same arithmetic as the model
    # changed before initialize, so the same losses and weights, bitwise (at bf16 both masters are
    # the half-precision values upcast)
    assert out["losses"] == out["ref_losses"]
    assert out["state_equal"]


def test_modifier_rank_after_initialize_at_world_size_1() -> None:
    engine = dstrain.initialize(model=make_model(), config=base_config(3, world=1))[0]
    w = engine.module.emb.weight
    with GatheredParameters(w, modifier_rank=0), torch.no_grad():
        w[0].fill_(3.0)
    with GatheredParameters(w):
        assert torch.equal(w[0], torch.full((DIM,), 3.0))
    with pytest.raises(InitError), GatheredParameters(w, modifier_rank=1):  # no such rank
        pass
    with pytest.raises(InitError), GatheredParameters(w, modifier_rank=0), torch.no_grad():
        w.data = torch.zeros(5)  # another shape: refused, the old values kept
    with GatheredParameters(w):
        assert w.shape == (32, DIM) and torch.equal(w[0], torch.full((DIM,), 3.0))
    with pytest.raises(ValueError), GatheredParameters(w, modifier_rank=0), torch.no_grad():
        w[1].fill_(7.0)
        raise ValueError("inside the block")  # an exception discards the changes
    with GatheredParameters(w):
        assert not torch.equal(w[1], torch.full((DIM,), 7.0))
    engine.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_change_after_an_evaluation_pass_is_seen_by_the_next_pass(
    world2: list[dict[str, Any]], rank: int
) -> None:
    out = world2[rank]["mid-training"]
    assert out["after_equal"]  # no gather used a shard read ahead before the change
    assert out["loss"] == out["expected_loss"]  # the same fp32 forward on the same values


@pytest.mark.parametrize("case", ["none", "cpu-bf16", "nvme", "nvme-bf16"])
def test_write_shard_replaces_shard_and_master_and_drops_stale_read_ahead(tmp_path: Any, case: str) -> None:
    """`ShardStore.write_shard` at world size 1: the next gather and the fp32 master see the new
    values, also when the store had read the old shards ahead (a pass just started)."""
    from dstrain.zero.units import HoldsShards

    engine = dstrain.initialize(model=make_model(), config=_config(case, str(tmp_path), 1))[0]
    engine_losses(engine, 1)  # records the order of a pass's shard reads
    zero = engine.zero
    assert isinstance(zero, HoldsShards)
    units = zero.units
    new = {u.index: torch.arange(u.layout.shard, dtype=torch.float32).div(64).to(u.dtype) for u in units}
    zero.store.begin_pass()  # an NVMe store reads the first shards of the trace ahead now
    for u in units:
        assert u.group is not None
        zero.store.write_shard(u.group, u, new[u.index])
    for u in units:
        u.finish_gather()
        assert torch.equal(u.full[u.layout.lo : u.layout.hi], new[u.index]), u.index
        u.release()
    for g in zero.groups:
        master = zero.store.read_master(g)
        for u in g.units:
            off = g.offsets[u.index]
            assert torch.equal(master[off : off + u.layout.shard], new[u.index].float()), u.index
    engine.close()
