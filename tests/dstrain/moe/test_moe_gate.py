"""Gating equals DeepSpeed's on the same logits (fixtures recorded from deepspeed 0.19.8 by
fixtures/record_ds_gating.py), plus capacity, eval mode and the sampling options."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dstrain.moe import MoEConfigError, TopKGate
from dstrain.moe.gate import capacity, top1_gating, top2_gating, topk_gating

FIXTURES = Path(__file__).parent / "fixtures" / "ds_gating.json.gz"


def _cases() -> list[dict[str, Any]]:
    with gzip.open(FIXTURES, "rt") as f:
        return json.load(f)["cases"]


CASES = _cases()


def _ours(case: dict[str, Any]):
    logits = torch.tensor(case["logits"], dtype=torch.float32)
    k, cf, mc, drop = case["k"], case["cf"], case["min_cap"], case["drop"]
    if k == 1:
        return top1_gating(logits, cf, mc, drop_tokens=drop, use_rts=False)
    if k == 2:
        return top2_gating(logits, cf, mc, drop_tokens=drop, second_expert_sampling=False)
    return topk_gating(logits, k, cf, mc, drop_tokens=drop)


def test_fixture_covers_drops_and_every_k() -> None:
    assert {c["k"] for c in CASES} == {1, 2, 3, 4}
    dropped = [c for c in CASES if sum(c["exp_counts"]) > sum(i >= 0 for r in c["indices"] for i in r)]
    assert len(dropped) > 20  # the comparison below exercises the capacity limit, not only the easy path
    assert any(not c["drop"] for c in CASES)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_routing_equals_deepspeed(i: int) -> None:
    case = CASES[i]
    out = _ours(case)
    # routing decisions: exactly equal
    assert out.capacity == case["capacity"]
    assert torch.equal(out.indices, torch.tensor(case["indices"]))
    assert torch.equal(out.locations, torch.tensor(case["locations"]))
    assert torch.equal(out.exp_counts, torch.tensor(case["exp_counts"]))
    # gate values: within a tolerance of the recording, not bitwise. It was made on one CPU; torch's fp32
    # softmax runs exp in a vector loop (SLEEF, <= 1 ulp) or a scalar tail (libm, <= 0.5 ulp) by
    # where an element falls for this CPU's vector width, then a sum over <= 8 experts and one or two
    # divisions: <= ~12 ulps (7e-7 relative) apart on another CPU or ATEN_CPU_CAPABILITY (AVX2 showed it)
    torch.testing.assert_close(out.weights.detach(), torch.tensor(case["gates"]), rtol=1e-6, atol=1e-7)
    # l_aux: a mean over tokens of such values, its summation order set by the vector width: 1e-6 relative
    assert abs(out.l_aux.item() - case["l_aux"]) <= 1e-6 * abs(case["l_aux"])
    assert abs(out.l_aux.item() - case["dense_l_aux"]) <= 1e-6 * abs(case["dense_l_aux"])
    # DeepSpeed's dense (S, E, C) combine weights and dispatch mask
    cw = out.combine_weights().detach()
    assert tuple(cw.shape) == tuple(case["combine_shape"])
    nz = cw.nonzero().t()
    assert torch.equal(nz, torch.tensor(case["combine_idx"]).reshape(3, -1))
    torch.testing.assert_close(cw[tuple(nz)], torch.tensor(case["combine_val"]), rtol=1e-6, atol=1e-7)
    assert int(out.dispatch_mask().sum()) == case["dispatch_nnz"]
    kept_ds = sum(i >= 0 for r in case["indices"] for i in r)
    assert out.dropped_routes() == sum(case["exp_counts"]) - kept_ds


@pytest.mark.parametrize(
    ("s", "e", "cf", "mc", "k"),
    [(16, 4, 1.0, 4, 1), (37, 4, 1.25, 0, 2), (100, 8, 1.1, 0, 1), (80, 8, 1.1, 0, 2), (7, 8, 1.0, 4, 3)],
)
def test_capacity_formula(s: int, e: int, cf: float, mc: int, k: int) -> None:
    expected = max(math.ceil(k * s / e * cf - 1e-6), mc)
    got = capacity(s, e, cf, mc, k)
    assert got in (expected, expected + 1)  # float32 rounding can land just above an integer, as in DeepSpeed
    assert got >= mc


def test_eval_mode_uses_eval_capacity_and_no_randomness() -> None:
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0)
    x = torch.randn(32, 8)
    assert gate(x).capacity == capacity(32, 4, 0.5, 0)
    gate.eval()
    a, b = gate(x), gate(x)
    assert a.capacity == capacity(32, 4, 2.0, 0) == 16
    assert torch.equal(a.indices, b.indices) and torch.equal(a.locations, b.locations)


def test_rts_changes_which_tokens_are_kept_but_not_how_many() -> None:
    logits = torch.zeros(64, 4)
    logits[:, 0] = 5.0  # everyone wants expert 0; capacity 16 keeps 16 of them
    torch.manual_seed(1)
    a = top1_gating(logits, 1.0, 0, use_rts=True)
    torch.manual_seed(2)
    b = top1_gating(logits, 1.0, 0, use_rts=True)
    assert int(a.kept.sum()) == int(b.kept.sum()) == 16
    assert not torch.equal(a.kept, b.kept)
    assert a.dropped_routes() == 48


def test_drop_tokens_false_keeps_every_route() -> None:
    logits = torch.randn(64, 4)
    logits[:, 1] += 3.0
    for out in (
        top1_gating(logits, 1.0, 0, drop_tokens=False, use_rts=True),
        top2_gating(logits, 1.0, 0, drop_tokens=False),
        topk_gating(logits, 3, 1.0, 0, drop_tokens=False),
    ):
        assert out.dropped_routes() == 0
        assert out.capacity == int(out.exp_counts.max())
        assert int(out.locations.max()) < out.capacity


def test_second_expert_sampling_and_rsample_are_random_in_training() -> None:
    torch.manual_seed(0)
    logits = torch.randn(256, 8)
    a = top2_gating(logits, 1.0, 0, second_expert_sampling=True)
    b = top2_gating(logits, 1.0, 0, second_expert_sampling=False)
    assert torch.equal(a.indices[0], b.indices[0]) or (a.indices[0] < 0).any()  # first choice unchanged
    assert not torch.equal(a.indices[1], b.indices[1])
    c = top1_gating(logits, 8.0, 0, rsample=True, use_rts=False)
    d = top1_gating(logits, 8.0, 0, rsample=False, use_rts=False)
    assert not torch.equal(c.indices, d.indices)


def test_jitter_only_in_training() -> None:
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=2, min_capacity=0, noisy_gate_policy="Jitter", top2_2nd_expert_sampling=False)
    x = torch.randn(512, 8) * 10
    gate.eval()
    ref = gate(x).weights
    assert torch.equal(gate(x).weights, ref)
    gate.train()
    assert not torch.equal(gate(x).weights, ref)


def test_used_token_excludes_tokens() -> None:
    logits = torch.randn(16, 4)
    used = torch.ones(16)
    used[::2] = 0
    for out in (
        top1_gating(logits, 4.0, 0, used_token=used, use_rts=False),
        top2_gating(logits, 4.0, 0, used_token=used, second_expert_sampling=False),
        topk_gating(logits, 3, 4.0, 0, used_token=used),
    ):
        assert (out.indices[:, ::2] == -1).all() and (out.indices[:, 1::2] >= 0).all()
        assert int(out.exp_counts.sum()) == 8 * out.indices.shape[0]


def test_l_aux_gradient_flows_to_router() -> None:
    gate = TopKGate(8, 4, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    out = gate(torch.randn(32, 8))
    out.l_aux.backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"k": 5}, "k"),
        ({"k": 0}, "k"),
        ({"noisy_gate_policy": "Gumbel"}, "noisy_gate_policy"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"eval_capacity_factor": -1.0}, "eval_capacity_factor"),
        ({"min_capacity": -1}, "min_capacity"),
    ],
)
def test_bad_arguments_are_typed_errors(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(MoEConfigError) as info:
        TopKGate(8, 4, **kwargs)
    assert info.value.field == field


def test_fewer_tokens_than_min_capacity_drops_nothing() -> None:
    # DeepSpeed asserts here (top-1); a batch smaller than min_capacity simply fits
    logits = torch.randn(3, 4)
    for out in (
        top1_gating(logits, 1.0, 4, use_rts=True),
        top2_gating(logits, 1.0, 4, second_expert_sampling=False),
        topk_gating(logits, 3, 1.0, 4),
    ):
        assert out.capacity == 4 and out.dropped_routes() == 0
