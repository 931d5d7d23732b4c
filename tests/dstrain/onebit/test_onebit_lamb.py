"""1-bit LAMB (dstrain.onebit.OneBitLamb): per-step losses of DeepSpeed 0.16.5's OnebitLamb (its sources
run on CPU by bench/onebit_anchor.py ... lamb) within 1e-6 relative over 40 steps, wire bytes after the
freeze at most 1/28 of fp32's, a checkpoint resume, and the optimizer composed into dstrain.initialize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, engine_losses, make_model, spawn
from _onebit_workers import anchor_resume, anchor_train, summary

import dstrain
from dstrain.errors import ConfigError
from dstrain.onebit import OneBitLamb

FIXTURE = Path(__file__).parents[1] / "fixtures" / "onebit_lamb_deepspeed_0.16.5.json"
FREEZE = 10


def _lamb(params: Any) -> OneBitLamb:
    return OneBitLamb(params, lr=1e-2, freeze_step=FREEZE)


def _worker() -> dict[str, Any]:
    out: dict[str, Any] = {"anchor": summary(anchor_train(_lamb, 40))}
    out["resume"] = anchor_resume(_lamb, 15, 25)
    opt = {"type": "OneBitLamb", "params": {"lr": 1e-2, "freeze_step": 3, "comm_backend_name": "nccl"}}
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(0, world=2, optimizer=opt))
    out["engine_losses"] = engine_losses(engine, 8)
    out["engine_comm"] = engine.statistics().comm
    out["engine_compressed"] = engine.stepper.statistics().compressed
    out["engine_frozen"] = engine.stepper.statistics().frozen
    engine.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(_worker, world=2, start_method="forkserver")


def test_losses_follow_deepspeed_0165_onebit_lamb(ranks: list[dict[str, Any]]) -> None:
    ds = json.loads(FIXTURE.read_text())
    assert ds["impl"] == "deepspeed" and ds["optimizer"] == "OneBitLamb" and ds["freeze_step"] == FREEZE
    got = ranks[0]["anchor"]
    assert got["reduced"] == ds["reduced"]  # gradients averaged by the loop during warm-up only
    assert len(got["losses"]) == len(ds["losses"]) == 40
    for step, (a, b) in enumerate(zip(got["losses"], ds["losses"], strict=True)):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs DeepSpeed {b}"
    assert ranks[0]["anchor"]["losses"] == ranks[1]["anchor"]["losses"]


def test_wire_bytes_after_the_freeze(ranks: list[dict[str, Any]]) -> None:
    stats = ranks[0]["anchor"]["stats"]
    assert stats.calls == 40 - FREEZE  # one compressed all-reduce per step after the freeze
    assert stats.wire_bytes * 28 <= stats.fp32_allreduce_bytes


def test_checkpoint_resume_continues_exactly(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        res = r["resume"]
        assert res["resumed_losses"] == res["straight_losses"]
        assert all(torch.equal(a, b) for a, b in zip(res["resumed"], res["straight"], strict=True))


def test_composed_into_initialize(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["engine_frozen"]
        c, s = r["engine_comm"], r["engine_compressed"]
        assert c.compressed_calls == s.calls == 8 - 3  # compressed steps after the freeze
        assert c.compressed_wire_bytes * 28 <= c.compressed_fp32_bytes
        assert r["engine_losses"][-1] < r["engine_losses"][0]
    assert ranks[0]["engine_losses"] == ranks[1]["engine_losses"]


def test_refusals_name_the_key() -> None:
    opt = {"type": "OneBitLamb", "params": {"lr": 1e-2, "eps_inside_sqrt": True}}
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=make_model(), config=base_config(0, world=1, optimizer=opt))
    assert e.value.field == "optimizer.params.eps_inside_sqrt"
    opt = {"type": "OneBitLamb", "params": {"lr": 1e-2}}
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=make_model(), config=base_config(1, world=1, optimizer=opt))
    assert e.value.field == "zero_optimization.stage"
    with pytest.raises(ConfigError) as e:
        dstrain.DSConfig.load(
            {"train_batch_size": 1, "optimizer": {"type": "OneBitLamb", "params": {"coef_beta": 1}}}
        )
    assert e.value.field == "optimizer.params.coef_beta"
