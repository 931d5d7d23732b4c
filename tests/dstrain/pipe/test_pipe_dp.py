"""PP x DP on 4 real gloo processes (2 stages x 2 data-parallel ranks): ZeRO-1 over the data-parallel group gives
bitwise the weights of PP without ZeRO, ZeRO-2 (also with weights tied across stages) within 1e-6; tied weights stay
identical on every rank holding them; with clipping the global norm is the same at ZeRO 0, 1 and 2 (summed over
stages and dp slices, tied weights once); ZeRO-3 is refused (NotImplementedConfigError), not run wrongly."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dstrain_helpers import spawn
from test_pipe_train import config, lm_data, lm_loss, mlp_data, mlp_layers, tied_layers

from dstrain.errors import NotImplementedConfigError
from dstrain.pipe.module import PipelineModule

GAS, STEPS = 4, 2
NEVER = 1e6
"""A clipping threshold no step reaches: the global norm is computed (and compared) but nothing is scaled, so
ZeRO-1 stays bitwise ZeRO-0 (clipping itself, with PP=2, is tested in test_pipe_train.py)."""


def _run(kind: str, stage: int, clip: float = 0.0) -> dict[str, Any]:
    import dstrain

    rank = dist.get_rank()
    dp_rank = rank % 2  # layout: rank = stage * dp + dp_rank
    layers, loss_fn, data = (
        (mlp_layers(), F.cross_entropy, mlp_data(GAS * STEPS, seed=10 + dp_rank))
        if kind == "mlp"
        else (tied_layers(), lm_loss, lm_data(GAS * STEPS, seed=20 + dp_rank))
    )
    module = PipelineModule(
        layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform", seed_layers=True
    )
    cfg = config(GAS, zero_optimization={"stage": stage}, gradient_clipping=clip)
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
    engine, _, _, _ = dstrain.initialize(model=module, config=cfg)
    it = iter(data)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(it).item())
        norms.append(engine.statistics().last_grad_norm)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out: dict[str, Any] = {
        "losses": losses,
        "state": state,
        "dp": engine.topology.dp.world_size,
        "norms": norms,
    }
    if kind == "tied":
        w = module.tied_modules["emb"].weight.detach().clone()
        got = [torch.zeros_like(w) for _ in range(4)]
        dist.all_gather(got, w)
        out["tied_identical"] = all(torch.equal(got[0], g) for g in got[1:])
    engine.close()
    return out


def _refused(kind: str, stage: int) -> str | None:
    """initialize refuses what is not implemented (typed), on every rank, instead of training wrongly."""
    try:
        _run(kind, stage)
    except NotImplementedConfigError as e:
        return e.field
    return None


def _scenarios() -> dict[str, Any]:
    out: dict[str, Any] = {
        f"{kind}{stage}": _run(kind, stage, NEVER if kind == "tied" else 0.0)
        for kind in ("mlp", "tied")
        for stage in (0, 1)
    }
    out["mlp2"] = _run("mlp", 2)
    out["tied2"] = _run("tied", 2, NEVER)
    out["refused"] = [_refused("mlp", 3)]
    return out


def test_pp_x_dp_with_zero() -> None:
    start = time.monotonic()
    results = spawn(_scenarios, world=4, start_method="forkserver")
    assert time.monotonic() - start < 400
    for kind in ("mlp", "tied"):
        for r in results:
            assert r[f"{kind}0"]["dp"] == 2
            # ZeRO-1 partitions only the optimizer step: bitwise what stage 0 computes
            got, want = r[f"{kind}1"], r[f"{kind}0"]
            assert got["losses"] == want["losses"], kind
            for k, v in want["state"].items():
                assert torch.equal(got["state"][k], v), (kind, k)
            # ZeRO-2 reduces each micro-batch's gradient as backward produces it and accumulates the
            # reduced pieces (x 1/dp): another summation order than stage 0's one reduction, so <= 1e-6.
            # Tied: each stage's slices of the tied weight's master gradient are summed over stages x dp.
            got = r[f"{kind}2"]
            assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True)) <= 1e-6
            for k, v in want["state"].items():
                assert (got["state"][k] - v).abs().max().item() <= 1e-6, (kind, k)
        # the mean loss over micro-batches and dp ranks is the same on all four ranks
        assert len({tuple(r[f"{kind}0"]["losses"]) for r in results}) == 1
        # the two dp replicas of a stage hold the same weights
        for a, b in ((0, 1), (2, 3)):
            for k, v in results[a][f"{kind}1"]["state"].items():
                assert torch.equal(results[b][f"{kind}1"]["state"][k], v)
    for r in results:
        for stage in (0, 1):
            assert r[f"tied{stage}"]["tied_identical"], stage
        assert r["refused"] == ["zero_optimization.stage"]
        assert r["tied2"]["tied_identical"]
        # the global norm (tied weights once): the same on all ranks and at ZeRO 0, 1 and 2, within summation
        # order (stage 0 sums squares over the stages, 1-2 over stages x dp slices)
        want = results[0]["tied0"]["norms"]
        assert all(0 < n < NEVER for n in want)
        for stage in (0, 1, 2):
            for got, ref in zip(r[f"tied{stage}"]["norms"], want, strict=True):
                assert abs(got - ref) <= 1e-6 * ref, (stage, r[f"tied{stage}"]["norms"], want)
