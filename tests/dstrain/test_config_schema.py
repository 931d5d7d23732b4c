"""The config schema: keys of unbuilt features accepted when off (logged) and refused when asked for;
keys without effect logged with why; "auto" resolved or named; HJSON; DeepSpeed's defaults and
checks; README's reference table generated from the schema."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _dstrain_helpers import DIM, base_config, make_model

import dstrain
from dstrain._parse import forget_notes
from dstrain.config import DSConfig, read_config_file
from dstrain.config_auto import resolve_auto
from dstrain.config_reference import NO_EFFECT, REFUSED, WHEN_OFF, rows, write_readme
from dstrain.errors import ConfigError, NotImplementedConfigError

ROOT = Path(__file__).resolve().parents[2]


def load(extra: dict[str, Any], world: int = 1) -> DSConfig:
    return DSConfig.load({"train_batch_size": 8, **extra}, world_size=world)


@pytest.fixture
def notes(caplog: Any) -> Any:
    """The "accepted, no effect" lines logged during the test (each logged once per process otherwise)."""
    forget_notes()
    caplog.set_level(logging.INFO, logger="dstrain")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "accepted, no effect" in r.getMessage()]

    return lines


OFF = [
    {"fp16": {"auto_cast": False}},
    {"bf16": {"enabled": True, "immediate_grad_update": False}},
    {"activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True}},
    {"flops_profiler": {"enabled": True, "recompute_fwd_factor": 0.0}},
    {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "zero_quantized_weights": False}},
    {"checkpoint": {"load_universal": False, "use_node_local_storage": False}},
    {"gradient_allreduce_op": "mean"},
    {"communication_data_type": None},
    {"elasticity": {"enabled": False, "max_train_batch_size": 64}},
    {"zero_force_ds_cpu_optimizer": True},
]


@pytest.mark.parametrize("extra", OFF, ids=[json.dumps(e)[:60] for e in OFF])
def test_unbuilt_keys_off_or_at_default_are_accepted_and_logged(extra: dict[str, Any], notes: Any) -> None:
    load(extra)
    assert notes(), "nothing logged"


ON = [
    ({"fp16": {"auto_cast": True}}, "fp16.auto_cast"),
    (
        {"activation_checkpointing": {"partition_activations": True}},
        "activation_checkpointing.partition_activations",
    ),
    ({"flops_profiler": {"recompute_fwd_factor": 0.5}}, "flops_profiler.recompute_fwd_factor"),
    ({"zero_optimization": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ({"communication_data_type": "fp32"}, "communication_data_type"),
    ({"zero_force_ds_cpu_optimizer": False}, "zero_force_ds_cpu_optimizer"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
]


@pytest.mark.parametrize(("extra", "field"), ON, ids=[f for _, f in ON])
def test_unbuilt_keys_that_ask_for_the_feature_are_refused(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(NotImplementedConfigError) as e:
        load(extra)
    assert e.value.field == field


# the twelve keys the audit found accepted without effect: each is honoured or says why at INFO
IGNORED = [
    {"zero_optimization": {"stage": 2, "allgather_bucket_size": 1000}},
    {"zero_optimization": {"stage": 2, "contiguous_gradients": False}},
    {"zero_optimization": {"stage": 2, "reduce_scatter": False}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pipeline_read": True}}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pipeline_write": True}}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "fast_init": True}}},
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 10}}},
    {"pipeline": {"partition": "uniform"}},
    {"pipeline": {"seed_layers": True}},
    {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}},
    {"pipeline": {"use_reentrant": True}},
    {"optimizer": {"type": "Adam", "params": {"torch_adam": True}}},
]


@pytest.mark.parametrize("extra", IGNORED, ids=[json.dumps(e)[:70] for e in IGNORED])
def test_keys_without_effect_say_why(extra: dict[str, Any], notes: Any) -> None:
    load(extra)
    (key,) = [
        k
        for k in _leaves(extra)
        if k
        not in (
            "zero_optimization.stage",
            "zero_optimization.offload_optimizer.device",
            "zero_optimization.offload_param.device",
            "optimizer.type",
        )
    ][:1]
    assert any(key in line for line in notes()), (key, notes())


def _leaves(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else k
        out.extend(_leaves(v, path) if isinstance(v, dict) else [path])
    return out


def test_pin_memory_without_a_gpu_says_so(caplog: Any, tmp_path: Any) -> None:
    cfg = base_config(2, world=1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    with caplog.at_level(logging.INFO, logger="dstrain"):
        engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    engine.close()
    if (
        not torch.cuda.is_available()
    ):  # with CUDA the state is page-locked (tests/dstrain/offload/test_offload_device.py)
        assert any("pin_memory" in r.getMessage() and "not pinned" in r.getMessage() for r in caplog.records)


def test_fp16_scales_must_be_finite_and_unused_dynamic_fields_are_not_checked() -> None:
    for bad in (math.inf, math.nan):
        with pytest.raises(ConfigError) as e:
            load({"fp16": {"enabled": True, "loss_scale": bad}})
        assert e.value.field == "fp16.loss_scale"
        with pytest.raises(ConfigError) as e:
            load({"fp16": {"enabled": True, "min_loss_scale": bad}})
        assert e.value.field == "fp16.min_loss_scale"
    # a static scale, or fp16 off: the dynamic scaler's fields are not used, so not validated (DeepSpeed)
    assert load({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 0}}).fp16.loss_scale == 128
    assert not load({"fp16": {"enabled": False, "loss_scale_window": 0}}).fp16.enabled
    with pytest.raises(ConfigError):
        load({"fp16": {"enabled": True, "hysteresis": 0}})


def test_overlap_comm_defaults_as_deepspeed() -> None:
    assert load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert (
        load({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm
        is False
    )


def test_dataloader_drop_last_is_honoured() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10).float())
    for drop, batches in ((False, 3), (True, 2)):
        cfg = base_config(0, world=1, dataloader_drop_last=drop)
        engine, _, loader, _ = dstrain.initialize(model=make_model(), config=cfg, training_data=data)
        assert len(loader) == batches  # 10 samples, micro batch 4
        engine.close()


def test_hjson_config_file(tmp_path: Any) -> None:
    path = tmp_path / "ds.hjson"
    path.write_text(
        "{\n  # HJSON: comments, unquoted keys, no commas\n  train_batch_size: 8\n"
        '  zero_optimization: { stage: 2 }\n  "fp16": {"enabled": false,},\n}\n'
    )
    cfg = DSConfig.load(path)
    assert cfg.train_batch_size == 8 and cfg.zero_optimization.stage == 2
    path.write_text("{ not: [ closed")
    with pytest.raises(ConfigError):
        read_config_file(path)


def test_auto_batch_sizes_resolve_from_the_other_two() -> None:
    cfg = DSConfig.load(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
        world_size=2,
    )
    assert cfg.train_batch_size == 12
    cfg = DSConfig.load({"train_batch_size": 12, "train_micro_batch_size_per_gpu": "auto"}, world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 6 and cfg.gradient_accumulation_steps == 1


def test_auto_that_cannot_be_derived_is_named_all_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        DSConfig.load(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_clipping": "auto",
                "fp16": {"enabled": "auto"},
                "zero_optimization": {"reduce_bucket_size": "auto"},
            }
        )
    for path in ("gradient_clipping", "fp16.enabled", "zero_optimization.reduce_bucket_size"):
        assert path in str(e.value)
    with pytest.raises(ConfigError) as e:
        DSConfig.load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    assert "train_batch_size" in str(e.value) and "train_micro_batch_size_per_gpu" in str(e.value)


def test_auto_from_the_model_and_a_client_optimizer() -> None:
    model = make_model()
    model.config = SimpleNamespace(hidden_size=DIM)
    client = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    out = resolve_auto(raw, model=model, optimizer=client)
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.05}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4}
    z = out["zero_optimization"]
    assert (
        z["reduce_bucket_size"],
        z["stage3_prefetch_bucket_size"],
        z["stage3_param_persistence_threshold"],
    ) == (
        DIM * DIM,
        int(0.9 * DIM * DIM),
        10 * DIM,
    )
    # through initialize: the model without a config cannot give a hidden size, and says so
    del raw["optimizer"], raw["scheduler"]
    with pytest.raises(ConfigError, match="hidden_size"):
        dstrain.initialize(
            model=make_model(), config=raw, optimizer=torch.optim.SGD(make_model().parameters(), 0.1)
        )
    engine, _, _, _ = dstrain.initialize(model=model, config=raw, optimizer=client)
    assert engine.config.zero_optimization.reduce_bucket_size == DIM * DIM
    engine.close()


def test_reference_table_covers_every_deepspeed_key() -> None:
    table = {r.key: r for r in rows()}
    ds = json.loads((ROOT / "tests/dstrain/fixtures/deepspeed_keys.json").read_text())["keys"]

    def covered(key: str) -> bool:
        parts = key.split(".")
        if key in table:
            return True
        # a key inside a section dstrain has not built is covered by that section's row
        return any(
            table.get(".".join(parts[:i])) is not None
            and table[".".join(parts[:i])].status in (WHEN_OFF, NO_EFFECT, REFUSED)
            for i in range(1, len(parts))
        )

    missing = [k for k in ds if not covered(k)]
    assert not missing, f"DeepSpeed keys without a row in dstrain's schema: {missing}"


def test_readme_reference_table_is_generated_from_the_schema() -> None:
    assert write_readme(ROOT / "README.md", check=True), (
        "README's config reference drifted from the schema: run python -m dstrain.config_reference --write README.md"
    )
