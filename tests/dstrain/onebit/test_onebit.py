"""1-bit Adam: packing, the compressed all-reduce against a pure-torch simulation, error feedback,
DeepSpeed 0.16.5 parity, convergence, wire bytes and optimizer state."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dstrain_helpers import spawn
from _onebit_workers import anchor_resume, anchor_train, check_first_step, register, shared_runs, summary
from torch import nn

from dstrain.onebit import CompressedAllReduce, OneBitAdam
from dstrain.onebit.compressed import pack_signs, padded_numel, sign_pm1, simulate, unpack_signs

FIXTURE = Path(__file__).parents[1] / "fixtures" / "onebit_deepspeed_0.16.5.json"


def test_sign_of_zeros_and_nan_is_plus_one_and_packing_agrees() -> None:
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), -1e-30, 1e-30, float("-inf")])
    assert sign_pm1(x).tolist() == [1, 1, 1, -1, 1, -1, 1, -1]
    assert torch.equal(unpack_signs(pack_signs(x)), sign_pm1(x))


def test_packing_is_msb_first_like_numpy_packbits() -> None:
    x = torch.randn(1024)
    ref = np.packbits((x.numpy() >= 0) | np.isnan(x.numpy()))
    assert np.array_equal(pack_signs(x).numpy(), ref)
    with pytest.raises(ValueError):
        pack_signs(torch.randn(7))


def test_padding_rule() -> None:
    assert padded_numel(1, 2) == 16 and padded_numel(16, 2) == 16 and padded_numel(17, 2) == 32
    assert padded_numel(5, 3) == 72  # 3 * lcm(3, 8)
    for w in (1, 2, 3, 4, 8):
        n = padded_numel(1000, w)
        assert n >= 1000 and (n // w) % 8 == 0 and n % w == 0


def test_simulation_error_feedback_identity_holds_exactly() -> None:
    """worker_error' == (b + worker_error) - s * sign(b + worker_error), bit for bit, on every rank,
    and the result is what the decoded server signs say."""
    torch.manual_seed(0)
    w, numel = 3, 1000
    n = padded_numel(numel, w)
    bufs = [torch.randn(numel) for _ in range(w)]
    we = [torch.randn(n) * 0.01 for _ in range(w)]
    se = [torch.randn(n // w) * 0.01 for _ in range(w)]
    we0 = [e.clone() for e in we]
    out = simulate(bufs, we, se)
    for r in range(w):
        b = torch.zeros(n)
        b[:numel] = bufs[r]
        b += we0[r]
        s = torch.linalg.norm(b) / np.sqrt(n)
        assert torch.equal(we[r], b - s * sign_pm1(b))
    assert out.shape == (numel,)
    # every output chunk is +-one scale
    chunk = n // w
    full = torch.zeros(n)
    full[:numel] = out
    for r in range(w):
        vals = full[r * chunk : (r + 1) * chunk].abs()
        vals = vals[: max(0, min(chunk, numel - r * chunk))]
        if vals.numel():
            assert torch.allclose(vals, vals[0].expand_as(vals), rtol=0, atol=0)


def test_error_feedback_makes_the_running_average_unbiased() -> None:
    """Over many calls with a constant input, the mean output converges to the true average (error feedback
    carries what one bit dropped into the next call); without feedback it would stay biased."""
    torch.manual_seed(1)
    w, numel = 2, 256
    n = padded_numel(numel, w)
    inputs = [torch.randn(numel) for _ in range(w)]
    true = (inputs[0] + inputs[1]) / 2
    we = [torch.zeros(n) for _ in range(w)]
    se = [torch.zeros(n // w) for _ in range(w)]
    acc = torch.zeros(numel)
    steps = 400
    for _ in range(steps):
        acc += simulate(inputs, we, se)
    err = (acc / steps - true).abs().max().item()
    one_shot = (simulate(inputs, [torch.zeros(n)] * 2, [torch.zeros(n // w)] * 2) - true).abs().max().item()
    assert err < 0.05 * one_shot


def _compressed_worker(numel: int, calls: int) -> dict[str, Any]:
    return _compressed_worker_on(numel, calls, torch.device("cpu"))


def _onebit(freeze: int, fused: bool = True, compat: bool = False) -> Any:
    return lambda ps: OneBitAdam(ps, lr=1e-2, freeze_step=freeze, deepspeed_compat=compat, fused=fused)


def _all_runs(root: str) -> dict[str, Any]:
    return {
        "compressed": _compressed_worker(1000, 3),
        "compat": summary(anchor_train(_onebit(10, fused=False, compat=True), 40)),
        "resume": anchor_resume(_onebit(10), split=25, steps=35),
        "fused": summary(anchor_train(_onebit(10), 40)),
        "conv_onebit": summary(anchor_train(_onebit(30), 300, noise=True)),
        "conv_adam": summary(anchor_train(_onebit(10**9), 300, noise=True)),
    }


register("onebit", _all_runs)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return shared_runs("onebit")


def _simulated(
    numel: int, calls: int, world: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The workers' inputs (seed 123) run through `simulate`: per-call results and the final error buffers."""
    torch.manual_seed(123)
    bufs = [[torch.randn(numel) for _ in range(world)] for _ in range(calls)]
    n = padded_numel(numel, world)
    we = [torch.zeros(n) for _ in range(world)]
    se = [torch.zeros(n // world) for _ in range(world)]
    return [simulate(bufs[c], we, se) for c in range(calls)], we, se


def test_distributed_compressed_allreduce_equals_simulation_exactly(runs) -> None:
    refs, we, se = _simulated(1000, 3, 2)
    for c, ref in enumerate(refs):
        for r in range(2):
            assert torch.equal(runs[r]["compressed"]["outs"][c], ref)
    for r in range(2):
        assert torch.equal(runs[r]["compressed"]["we"], we[r])
        assert torch.equal(runs[r]["compressed"]["se"], se[r])


def test_wire_bytes_after_freeze_at_most_1_28_of_fp32(runs) -> None:
    st = runs[0]["fused"]["stats"]
    assert st.calls == 30  # 40 steps, freeze at 10, one fused buffer per group
    assert st.wire_bytes * 28 <= st.fp32_allreduce_bytes


def test_matches_deepspeed_0_16_5_per_step_loss(runs) -> None:
    """Against a recording made on another CPU (bench/onebit_anchor.py), so within a tolerance: 1e-6
    relative (~8 fp32 ulps: torch's vector and scalar loops round differently) at every step where
    torch runs its vectorized kernels (AVX2, AVX-512: measured <= 2.4e-7 on both). With
    ``ATEN_CPU_CAPABILITY=default`` (other exp/FMA code) only the 10 uncompressed warm-up steps hold
    that: once momentum is compressed to signs, an element within an ulp of zero can take the other
    sign, moving its update by twice the scale, and the runs part (measured at default: from step 17,
    up to 2.2%); the compressed phase is then held to 5%."""
    ref = json.loads(FIXTURE.read_text())
    ours = runs[0]["compat"]["losses"]
    assert len(ref["losses"]) == len(ours) == 40
    vectorized = torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    for step, (a, b) in enumerate(zip(ref["losses"], ours, strict=True), 1):
        tol = 1e-6 if vectorized or step <= 10 else 5e-2
        assert abs(a - b) <= tol * abs(a), f"step {step}: deepspeed {a} vs dstrain {b}"


def test_gradients_reduced_only_during_warmup_and_ranks_agree(runs) -> None:
    for kind in ("compat", "fused"):
        assert runs[0][kind]["reduced"] == [True] * 10 + [False] * 30
        for a, b in zip(runs[0][kind]["params"], runs[1][kind]["params"], strict=True):
            assert torch.equal(a, b)


def test_convergence_within_5_percent_of_uncompressed_adam(runs) -> None:
    """A noisy regression (loss floor ~1), 300 steps, variance frozen after 30: the mean loss of the last
    50 steps is within 5% of the same optimizer never frozen (uncompressed, bias-corrected Adam)."""
    onebit = np.mean(runs[0]["conv_onebit"]["losses"][-50:])
    adam = np.mean(runs[0]["conv_adam"]["losses"][-50:])
    assert runs[0]["conv_onebit"]["reduced"].count(False) == 270
    assert onebit <= adam * 1.05, (onebit, adam)


def test_error_feedback_state_saved_per_rank_and_restored_bitwise(runs) -> None:
    we0 = runs[0]["fused"]["state"]["state"][0]["worker_error"]
    we1 = runs[1]["fused"]["state"]["state"][0]["worker_error"]
    assert not torch.equal(we0, we1)  # per rank: the two workers' errors differ
    for r in range(2):
        res = runs[r]["resume"]
        for key in ("worker_error", "server_error", "exp_avg", "exp_avg_sq"):
            assert torch.equal(res["saved"]["state"][0][key], res["restored"]["state"][0][key]), key
        # training continued from the loaded state equals training that never stopped, bit for bit
        for a, b in zip(res["straight"], res["resumed"], strict=True):
            assert torch.equal(a, b)
        assert res["resumed_losses"] == res["straight_losses"]


def test_loading_on_another_world_size_resets_error_feedback() -> None:
    model = nn.Linear(4, 4)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    sd = opt.state_dict()
    sd["state"] = {
        0: {
            "step": 5,
            "exp_avg": torch.zeros(4, 4),
            "exp_avg_sq": torch.zeros(4, 4),
            "worker_error": torch.ones(16),
            "server_error": torch.ones(8),
        }
    }
    sd["onebit"] = {"steps": 5, "freeze_step": 2, "world": 2}
    opt.load_state_dict(sd)
    assert opt.frozen and "worker_error" not in opt.state[model.weight]


def test_loading_state_from_before_freeze_returns_to_warmup() -> None:
    model = nn.Linear(4, 4)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    for _ in range(5):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    assert opt.frozen
    early = OneBitAdam(nn.Linear(4, 4).parameters(), lr=1e-2, freeze_step=3)
    early.step()  # no grads: nothing happens, but the call counts
    sd = early.state_dict()
    opt.load_state_dict(sd)
    assert not opt.frozen and opt.reduces_gradients()


def test_first_step_and_bias_correction_behaviours() -> None:
    """Default: the first step moves the parameters by ~lr (bias-corrected Adam); DeepSpeed's behaviour:
    the first step only fills the moments."""
    check_first_step(lambda ps, compat: OneBitAdam(ps, lr=0.1, freeze_step=5, deepspeed_compat=compat))


def test_bad_arguments_are_value_errors() -> None:
    ps = list(nn.Linear(2, 2).parameters())
    for kw in ({"lr": -1}, {"freeze_step": 0}, {"betas": (1.0, 0.9)}, {"eps": -1.0}):
        with pytest.raises(ValueError):
            OneBitAdam(ps, **kw)
    backend = CompressedAllReduce()
    we, se = backend.new_errors(10)
    with pytest.raises(TypeError):
        backend.all_reduce(torch.zeros(10, dtype=torch.float64), we, se)
    with pytest.raises(ValueError):
        backend.all_reduce(torch.zeros(17), we, se)
    assert math.isfinite(float(backend.all_reduce(torch.ones(10), we, se).sum()))


def _nccl_worker(numel: int, calls: int) -> dict[str, Any]:
    """The compressed all-reduce on CUDA tensors over NCCL, results moved to the CPU."""
    out = _compressed_worker_on(numel, calls, torch.device("cuda", dist.get_rank()))
    return out


def _compressed_worker_on(numel: int, calls: int, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = CompressedAllReduce()
    torch.manual_seed(123)
    bufs = [[torch.randn(numel) for _ in range(world)] for _ in range(calls)]
    we, se = backend.new_errors(numel, device)
    outs = [backend.all_reduce(bufs[c][rank].to(device), we, se).cpu() for c in range(calls)]
    return {"outs": outs, "we": we.cpu(), "se": se.cpu()}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group")
def test_compressed_allreduce_on_nccl_cuda_matches_simulation() -> None:
    numel, calls, world = 100_003, 3, 2
    res = spawn(_nccl_worker, numel, calls, world=2, backend="nccl")
    refs, _, _ = _simulated(numel, calls, world)
    for c, ref in enumerate(refs):
        for r in range(world):
            # CUDA's norm reduces in another order than the CPU's, so the scales differ in the last bits and
            # the error feedback carries that into later calls: every sign equal, magnitudes within 1e-4
            got = res[r]["outs"][c]
            assert torch.equal(torch.signbit(got), torch.signbit(ref))
            torch.testing.assert_close(got.abs(), ref.abs(), rtol=1e-4, atol=0.0)
    assert torch.equal(res[0]["outs"][-1], res[1]["outs"][-1])  # both ranks hold the same average
