"""The MoE layer: forward equals a dense top-k reference, expert parallelism over 2 gloo ranks equals
EP=1 (forward, expert/gate/input gradients with the l_aux term), exchange mismatches are typed errors on
every rank within a wall-clock bound, and the DeepSpeed surface (signature, names, param tagging)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from _dstrain_helpers import spawn_bounded as spawn
from _moe_workers import (
    EP_CASES,
    D,
    E,
    dense_topk,
    layer_scenarios,
    make_expert,
    reference_layer,
    rel_err,
)

from dstrain.moe import ExpertGroupError, MoE, MoEConfigError, is_moe_param
from dstrain.moe import split_params_into_different_moe_groups_for_optimizer as split


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [False, True])
def test_forward_equals_dense_topk_reference(k: int, drop: bool) -> None:
    # with drop_tokens=True a capacity factor of E makes room for every token: nothing dropped either way
    layer = reference_layer(
        D,
        E,
        k,
        capacity_factor=float(E),
        min_capacity=0,
        drop_tokens=drop,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    torch.manual_seed(3)
    x = torch.randn(2, 20, D)  # (B, T, M): any leading shape
    y, l_aux, counts = layer(x)
    assert y.shape == x.shape
    assert layer.statistics().dropped_routes == 0
    assert rel_err(y, dense_topk(layer, x.reshape(-1, D), k).reshape(x.shape)) <= 1e-6
    assert int(counts.sum()) == 40 * k and l_aux.ndim == 0


def test_dropped_tokens_contribute_zero() -> None:
    layer = reference_layer(D, E, 1, capacity_factor=0.25, min_capacity=0, use_rts=False)
    x = torch.randn(32, D)
    y, _, _ = layer(x)
    route = layer.deepspeed_moe.last_route
    dropped = ~route.kept[0]
    assert dropped.any() and (~dropped).any()
    assert torch.equal(y[dropped], torch.zeros_like(y[dropped]))
    assert rel_err(y[~dropped], dense_topk(layer, x, 1)[~dropped]) <= 1e-6
    assert layer.statistics().dropped_routes == int(dropped.sum())


def test_residual_moe_mixes_dense_branch() -> None:
    torch.manual_seed(0)
    layer = MoE(
        D,
        make_expert(D),
        num_experts=E,
        k=1,
        use_residual=True,
        min_capacity=0,
        capacity_factor=4.0,
        use_rts=False,
    )
    x = torch.randn(16, D)
    y, _, _ = layer(x)
    moe_out = layer.deepspeed_moe(x)
    coef = torch.softmax(layer.coefficient(x), dim=-1)
    expected = moe_out * coef[:, :1] + layer.mlp(x) * coef[:, 1:]
    assert torch.allclose(y, expected, rtol=0, atol=1e-6)
    assert not is_moe_param(layer.mlp[0].weight) and not is_moe_param(layer.coefficient.weight)


def test_eval_mode_uses_eval_capacity_factor() -> None:
    layer = MoE(
        D, make_expert(D), num_experts=E, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0
    )
    x = torch.randn(32, D)
    layer(x)
    assert layer.statistics().capacity == 4
    layer.eval()
    layer(x)
    assert layer.statistics().capacity == 16


def test_signature_and_defaults_are_deepspeeds() -> None:
    sig = inspect.signature(MoE.__init__)
    expected = {
        "hidden_size": inspect.Parameter.empty,
        "expert": inspect.Parameter.empty,
        "num_experts": 1,
        "ep_size": 1,
        "k": 1,
        "capacity_factor": 1.0,
        "eval_capacity_factor": 1.0,
        "min_capacity": 4,
        "use_residual": False,
        "noisy_gate_policy": None,
        "drop_tokens": True,
        "use_rts": True,
        "top2_2nd_expert_sampling": True,
    }
    got = {n: p.default for n, p in sig.parameters.items() if n != "self"}
    assert got == expected
    layer = MoE(D, make_expert(D), num_experts=4)
    names = set(dict(layer.named_parameters()))
    assert "deepspeed_moe.gate.wg.weight" in names
    assert "deepspeed_moe.experts.deepspeed_experts.3.0.weight" in names


def test_expert_params_split_into_their_own_group() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(D, D), MoE(D, make_expert(D), num_experts=2))
    groups = split({"params": list(model.parameters()), "lr": 0.1})
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert groups[1]["name"] == "ep_size_1" and groups[1]["lr"] == 0.1
    experts = {id(p) for p in model[1].deepspeed_moe.experts.parameters()}
    assert {id(p) for p in groups[1]["params"]} == experts
    assert all(not is_moe_param(p) for p in groups[0]["params"])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_experts": 3, "ep_size": 2}, "num_experts"),
        ({"num_experts": 0}, "num_experts"),
        ({"ep_size": 0}, "ep_size"),
        ({"k": 3, "num_experts": 2}, "k"),
        ({"drop_tokens": "yes"}, "drop_tokens"),
        ({"noisy_gate_policy": "gumbel"}, "noisy_gate_policy"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(MoEConfigError) as info:
        MoE(D, make_expert(D), **kwargs)
    assert info.value.field == field


def test_unbound_expert_group_is_a_typed_error() -> None:
    layer = MoE(D, make_expert(D), num_experts=4, ep_size=2)
    with pytest.raises(ExpertGroupError):
        layer(torch.randn(8, D))
    with pytest.raises(ExpertGroupError):
        layer.set_expert_group(None)  # no process group in this process


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One pair of gloo ranks runs every scenario; a hang anywhere fails after the bound."""
    return spawn(layer_scenarios, timeout=240, start_method="forkserver")


@pytest.fixture(scope="module")
def ep_results(two_ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["ep"] for r in two_ranks]


@pytest.mark.parametrize("case", [f"k{k}-{'drop' if d else 'nodrop'}" for k, d, _, _ in EP_CASES])
def test_ep2_equals_ep1(ep_results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(ep_results):
        r = res[case]
        assert r["fwd_vs_ep1"] <= 1e-6, (rank, r)
        if r["fwd_vs_dense"] is not None:
            assert r["fwd_vs_dense"] <= 1e-6, (rank, r)
        assert r["l_aux"] <= 1e-7
        assert r["expert_grad"] <= 1e-5, (rank, r)
        assert r["gate_grad"] <= 1e-5, (rank, r)
        assert r["input_grad"] <= 1e-5, (rank, r)
        st = r["stats"].exchange
        assert st.agreements == 1 and st.all_to_all_calls == 4  # 2 forward, 2 backward
        assert st.all_to_all_bytes > 0
    if "drop" in case and "nodrop" not in case:
        assert sum(res[case]["dropped"] for res in ep_results) > 0  # the capacity limit was exercised


def test_exchange_mismatch_raises_on_every_rank_without_hanging(two_ranks: list[dict[str, Any]]) -> None:
    results = [r["mismatch"] for r in two_ranks]
    for rank, res in enumerate(results):
        assert res["raised"] is not None, rank
        assert res["raised"]["type"] == "ExchangeMismatchError"
        assert {v["capacity"] for v in res["raised"]["values"].values()} == {2 * 16 // E, 2 * 24 // E}
        assert res["seconds"] < 30
        assert res["hidden"] == "ExchangeMismatchError"
        assert res["nodrop_shape"] == (16 + 8 * rank, D)
    assert results[0]["nodrop_capacity"] == results[1]["nodrop_capacity"]
