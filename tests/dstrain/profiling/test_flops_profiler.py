"""The flops profiler (dstrain.profiling): get_model_profile's totals and module tree against hand-counted
matmul FLOPs, the flops_profiler section counting one training step (forward + backward) and the MFU it
gives engine.statistics() and Prometheus."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import dstrain
from dstrain.errors import ConfigError
from dstrain.profiling import FlopsProfiler, FlopsProfilerConfig, get_model_profile, peak_flops

B, D, H = 8, 16, 32
FWD = 2 * B * D * H + 2 * B * H * 1  # the two Linear layers' matmuls (bias, ReLU and the loss count 0)
# backward: both weight gradients, plus the input gradient of the second layer (x needs no gradient)
STEP = FWD + (2 * B * D * H + 2 * B * H) + 2 * B * H


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, H), nn.ReLU(), nn.Linear(H, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc2(self.act(self.fc1(x)))  # (B, 1)
        return out if y is None else nn.functional.mse_loss(out.squeeze(-1), y)


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


def test_get_model_profile_counts_the_forward() -> None:
    flops, macs, params = get_model_profile(_mlp(), input_shape=(B, D), print_profile=False, as_string=False)
    assert flops == FWD and macs == FWD // 2
    assert params == D * H + H + H + 1
    assert get_model_profile(_mlp(), args=[torch.randn(B, D)], print_profile=False) == (
        f"{FWD / 1e3:.2f} K",
        f"{FWD / 2e3:.2f} KMACs",
        f"{params}.00",
    )


def test_module_tree_and_printed_profile(tmp_path) -> None:
    model = _mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(B, D))
    prof.stop_profile()
    root = prof.tree()
    by = {c.name: c for c in root.children}
    assert by["fc1"].flops == 2 * B * D * H and by["fc2"].flops == 2 * B * H and by["act"].flops == 0
    assert root.flops == sum(c.flops for c in root.children) == FWD
    assert by["fc1"].params == D * H + H and all(c.latency_s > 0 for c in root.children)
    assert root.latency_s >= by["fc1"].latency_s + by["fc2"].latency_s
    out = tmp_path / "profile.txt"
    text = prof.print_model_profile(module_depth=1, top_modules=2, output_file=str(out))
    assert out.read_text() == text
    assert "(fc1): Linear" in text and "depth 1: fc1 (Linear)" in text
    shallow = prof.print_model_profile(module_depth=0, detailed=True)
    assert "(fc1)" not in shallow


def test_section_keys_and_refusals() -> None:
    c = FlopsProfilerConfig.from_dict(
        {
            "enabled": True,
            "profile_step": 3,
            "module_depth": -1,
            "top_modules": 1,
            "detailed": True,
            "output_file": None,
        }
    )
    assert c.profile_step == 3
    with pytest.raises(ConfigError) as e:
        FlopsProfilerConfig.from_dict({"recompute_fwd_factor": 0.5})
    assert e.value.field == "flops_profiler.recompute_fwd_factor"
    with pytest.raises(ConfigError) as e:
        FlopsProfilerConfig.from_dict({"profile_steps": 1})
    assert "profile_step" in str(e.value)
    assert dstrain.DSConfig.load({"train_batch_size": 1, "flops_profiler": {"enabled": False}}).flops_profiler


def _train(cfg: dict[str, Any], steps: int) -> Any:
    engine, _, _, _ = dstrain.initialize(model=_mlp(), config=cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = engine(torch.randn(B, D, generator=g), torch.randn(B, generator=g))
        engine.backward(loss)
        engine.step()
    return engine


def test_profile_step_sets_flops_and_mfu(tmp_path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from dstrain.metrics import labels, register

    out = tmp_path / "flops.txt"
    cfg = {
        "train_batch_size": B,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(out), "peak_tflops": 0.5},
        "steps_per_print": 1000,
    }
    engine = _train(cfg, 1)
    assert math.isnan(engine.statistics().model_flops_per_step)  # step 2 not reached yet
    engine = _train(cfg, 3)
    s = engine.statistics()
    assert s.model_flops_per_step == STEP  # forward + backward of step 2, Adam's update counts 0
    assert s.mfu == pytest.approx(STEP / s.last_step_seconds / 0.5e12)
    assert "Profile Summary at step 2" in out.read_text()
    registry = prometheus_client.CollectorRegistry()
    register(engine, registry)
    assert registry.get_sample_value("dstrain_mfu", labels(engine)) == pytest.approx(s.mfu, rel=0.5)
    engine.close()


def test_measured_peak_is_positive_and_used_without_a_given_one() -> None:
    assert peak_flops("cpu", n=128) > 1e6
    cfg = {
        "train_batch_size": B,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True},
    }
    engine = _train(cfg, 2)
    assert engine.peak_flops is not None and engine.peak_flops > 1e6
    assert engine.statistics().model_flops_per_step == STEP and engine.statistics().mfu > 0
    engine.close()
