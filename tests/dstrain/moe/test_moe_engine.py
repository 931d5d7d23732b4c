"""MoE inside the engine on 2 gloo ranks: loss curves equal DeepSpeed 0.19.8's MoE (recorded by
fixtures/record_ds_moe_losses.py) over 10 steps, EP=2 equals EP=1 (expert gradients reduced over the
expert-data-parallel group and scaled by the dp world), clipping's global norm counts every expert once,
and checkpoints resume bitwise / refuse another ep_size with a typed error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _dstrain_helpers import spawn_bounded as spawn
from _moe_workers import engine_scenarios, mm

DS = json.loads((Path(__file__).parent / "fixtures" / "ds_moe_losses.json").read_text())["scenarios"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(
        engine_scenarios, str(tmp_path_factory.mktemp("moe-ckpt")), timeout=400, start_method="forkserver"
    )


def _close(a: list[float], b: list[float], tol: float) -> float:
    assert len(a) == len(b)
    err = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert err <= tol, (err, a, b)
    return err


@pytest.mark.parametrize("name", [s[0] for s in mm.SCENARIOS])
def test_loss_curve_equals_deepspeed(results: list[dict[str, Any]], name: str) -> None:
    ours = results[0]["losses"][name]
    assert ours == results[1]["losses"][name]  # every rank reports the same global loss
    if name == "k2_ep2_s0_clip":
        # DeepSpeed's stage-0 EP=2 run clips by another norm than its ZeRO-1 and EP=1 runs (which agree):
        # its global norm at stage 0 does not count the experts of the other ep rank. Ours is the same
        # in every configuration, so the reference is the curve DeepSpeed's other configurations agree on.
        assert abs(DS[name]["losses"][2] - DS["k2_ep1_s1_clip"]["losses"][2]) > 1e-5
        _close(ours, DS["k2_ep1_s1_clip"]["losses"], 1e-5)
        return
    _close(ours, DS[name]["losses"], 1e-5)


def test_ep2_equals_ep1_in_the_engine(results: list[dict[str, Any]]) -> None:
    r = results[0]["losses"]
    _close(r["k2_ep2_s0"], r["k2_ep1_s0"], 1e-5)
    _close(r["k2_ep2_s2"], r["k2_ep1_s1"], 1e-5)
    _close(r["k2_ep2_s3"], r["k2_ep1_s0"], 1e-5)


def test_experts_have_their_own_group(results: list[dict[str, Any]]) -> None:
    # ZeRO's groups (one flat master each): the dense part, then this rank's experts, split automatically
    assert [moe for moe, _ in results[0]["groups"]] == [False, True]
    routes, dropped, a2a = results[0]["routes"]
    assert routes == 2 * mm.TOKENS * mm.STEPS and a2a == 4 * mm.STEPS
    assert dropped > 0  # capacity factor 1: the curves above include dropped tokens


def test_clipping_counts_every_expert_once(results: list[dict[str, Any]]) -> None:
    r = results[0]
    n1, n2 = r["norms"]["k2_ep1_s1_clip"], r["norms"]["k2_ep2_s1_clip"]
    assert abs(n1 - n2) <= 1e-5 * n1 and n1 > 0.05  # clipping was active
    assert abs(r["norms"]["k2_ep2_s0_clip"] - n1) <= 1e-5 * n1
    _close(r["losses"]["k2_ep2_s1_clip"], r["losses"]["k2_ep1_s1_clip"], 1e-5)
    _close(r["losses"]["k2_ep2_s0_clip"], r["losses"]["k2_ep1_s1_clip"], 1e-5)


def test_checkpoint_resumes_bitwise_and_refuses_other_ep_size(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["ckpt_resumed"] == r["ckpt_continued"][5:]
        assert r["other_ep"] == "ExpertLayoutError"
    # each rank resumed its own experts: the two ranks' expert weights differ
    w0, w1 = results[0]["ckpt_weights"], results[1]["ckpt_weights"]
    key = "moe.deepspeed_moe.experts.deepspeed_experts.0.0.weight"
    assert not (w0[key] == w1[key]).all()
