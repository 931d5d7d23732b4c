"""Global gradient norm over any set of (gradients, group) pairs, and clipping by it."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _dstrain_helpers import spawn
from _optim_helpers import clip_run

from dstrain.optim.clip import GradSet, clip_grads_, global_grad_norm


def test_two_local_sets_sum_their_squares() -> None:
    a = [torch.tensor([3.0]), torch.tensor([0.0, 4.0])]
    b = [torch.tensor([12.0])]
    assert global_grad_norm([GradSet(a), GradSet(b)]) == 13.0
    assert global_grad_norm([]) == 0.0


def test_norm_is_float64_exact_for_large_fp32_gradients() -> None:
    g = [torch.tensor([1e30]), torch.tensor([1e30])]  # squares overflow fp32 (1e60), not float64
    assert global_grad_norm([GradSet(g)]) == pytest.approx(math.sqrt(2) * 1e30, rel=1e-6)
    assert global_grad_norm([GradSet([torch.tensor([float("inf")])])]) == math.inf


def test_clip_scales_to_max_norm_and_only_above_it() -> None:
    g = [torch.tensor([3.0, 4.0])]
    assert clip_grads_(g, 10.0, 5.0) == 1.0 and g[0].tolist() == [3.0, 4.0]
    assert clip_grads_(g, 0.0, 5.0) == 1.0  # 0 disables
    coef = clip_grads_(g, 1.0, 5.0)
    assert coef == pytest.approx(0.2, rel=1e-6)
    assert global_grad_norm([GradSet(g)]) == pytest.approx(1.0, rel=1e-5)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(clip_run, world=2, start_method="forkserver")


def test_partitioned_and_replicated_sets_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6)  # per-tensor norms are fp32
        assert r["after"] == pytest.approx(1.0, rel=1e-5)
        assert r["overflow"] == math.inf  # rank 0's gradient was finite: it still learns of the overflow
    assert two_ranks[0]["norm"] == two_ranks[1]["norm"]
