"""Monitors (dstrain.monitor): DeepSpeed's tensorboard / csv_monitor / wandb sections and event names, the
TensorBoard event file read back, the CSV files, wandb refused when not installed; the same training
series in Prometheus."""

from __future__ import annotations

import csv
import importlib.util
import os
from typing import Any

import pytest
import torch
from _dstrain_helpers import base_config, engine_losses, make_model

import dstrain
from dstrain.errors import ConfigError
from dstrain.monitor import CSVConfig, TensorBoardConfig, WandbConfig

STEPS = 4


def _cfg(tmp_path: Any, **sections: Any) -> dict[str, Any]:
    cfg = base_config(0, world=1, gas=2, wall_clock_breakdown=True, **sections)
    cfg["fp16"] = {"enabled": False}
    return cfg


def test_sections_parse_with_deepspeeds_keys() -> None:
    tb = TensorBoardConfig.from_dict({"enabled": True, "output_path": "out", "job_name": "run1"})
    assert tb.enabled and tb.output_path == "out" and tb.job_name == "run1"
    assert CSVConfig.from_dict({"enabled": False}).job_name == "DeepSpeedJobName"
    assert WandbConfig.from_dict({"enabled": False, "group": "g", "team": "t", "project": "p"}).project == "p"
    with pytest.raises(ConfigError) as e:
        TensorBoardConfig.from_dict({"enabled": True, "output": "x"})
    assert "output_path" in str(e.value)
    cfg = dstrain.DSConfig.load(
        {
            "train_batch_size": 1,
            "tensorboard": {"enabled": False},
            "wandb": {"enabled": False},
            "csv_monitor": {},
        }
    )
    assert cfg.tensorboard is not None and not cfg.tensorboard.enabled


def test_csv_monitor_writes_deepspeeds_events(tmp_path) -> None:
    cfg = _cfg(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    losses = engine_losses(engine, STEPS)
    engine.close()
    d = tmp_path / "job"
    names = sorted(os.listdir(d))
    assert names == sorted(
        f"Train_Samples_{n}.csv"
        for n in (
            "train_loss",
            "lr",
            "elapsed_time_ms_forward",
            "elapsed_time_ms_backward",
            "elapsed_time_ms_step",
        )
    )
    with open(d / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    batch = cfg["train_batch_size"]
    assert [int(r[0]) for r in rows[1:]] == [batch * (i + 1) for i in range(STEPS)]  # global samples
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    with open(d / "Train_Samples_lr.csv") as f:
        assert [float(r[1]) for r in list(csv.reader(f))[1:]] == [1e-2] * STEPS


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="the tensorboard extra is not installed"
)
def test_tensorboard_event_file_reads_back(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(tmp_path, tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    losses = engine_losses(engine, STEPS)
    scale = engine.loss_scale
    engine.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"} <= tags
    assert "Train/Samples/elapsed_time_ms_forward" in tags
    got = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in got] == [cfg["train_batch_size"] * (i + 1) for i in range(STEPS)]
    assert [e.value for e in got] == pytest.approx(losses, rel=1e-3)  # fp16 losses, stored as fp32
    assert acc.Scalars("Train/Samples/loss_scale")[-1].value == scale


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_refused_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=make_model(), config=_cfg(tmp_path, wandb={"enabled": True}))
    assert e.value.field == "wandb.enabled" and "pip install wandb" in str(e.value)
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=_cfg(tmp_path, wandb={"enabled": False}))
    assert engine.observers == []  # disabled sections build nothing
    engine.close()


def test_training_series_in_statistics_and_prometheus() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from dstrain.metrics import labels, register

    cfg = base_config(0, world=1, gas=2, gradient_clipping=1.0)
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    registry = prometheus_client.CollectorRegistry()
    register(engine, registry)
    losses = engine_losses(engine, 3)
    s = engine.statistics()
    assert s.last_loss == pytest.approx(losses[-1], rel=1e-6)
    assert s.lr == (1e-2,)
    mb, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    idx, _ = __import__("_dstrain_helpers").global_batch(0, mb)
    assert s.last_step_tokens == gas * idx.numel()  # integer token ids: every element is a token
    assert s.tokens == 3 * s.last_step_tokens and s.tokens_per_second > 0
    mine = labels(engine)  # {"rank": "0", "engine": ...}
    assert registry.get_sample_value("dstrain_loss", mine) == pytest.approx(losses[-1], rel=1e-6)
    assert registry.get_sample_value("dstrain_lr", {**mine, "group": "0"}) == 1e-2
    assert registry.get_sample_value("dstrain_grad_norm", mine) == s.last_grad_norm > 0
    assert registry.get_sample_value("dstrain_tokens_total", mine) == s.tokens
    assert registry.get_sample_value("dstrain_tokens_per_second", mine) > 0
    engine.close()
    assert torch.isnan(torch.tensor(s.mfu))  # no profiler: no MFU
