"""DeepSpeed JSON config: batch resolution, every validation error, did-you-mean, unimplemented keys."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dstrain import ConfigError, DSConfig, NotImplementedConfigError
from dstrain.config import FP16Config, ZeroConfig


def load(extra: dict[str, Any], world: int = 1) -> DSConfig:
    return DSConfig.load({"train_batch_size": 8, **extra}, world_size=world)


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_batch_size": 16}, 2, (16, 8, 1)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (16, 2, 4)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (12, 3, 2)),
        ({"train_micro_batch_size_per_gpu": 3}, 1, (3, 3, 1)),
        (
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
            2,
            (12, 3, 2),
        ),
    ],
)
def test_any_two_batch_keys_determine_the_third(
    given: dict[str, int], world: int, expected: tuple[int, int, int]
) -> None:
    cfg = DSConfig.load(given, world_size=world)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


@pytest.mark.parametrize(
    ("given", "world", "field"),
    [
        (
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 3},
            2,
            "train_batch_size",
        ),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 2, "train_batch_size"),
        ({"train_batch_size": 7}, 2, "train_batch_size"),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 3}, 1, "train_batch_size"),
        ({}, 1, "train_batch_size"),
        ({"train_batch_size": 0}, 1, "train_batch_size"),
        ({"train_batch_size": "8"}, 1, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": -1}, 1, "train_micro_batch_size_per_gpu"),
        (
            {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0},
            1,
            "gradient_accumulation_steps",
        ),
    ],
)
def test_batch_errors_name_the_key(given: dict[str, Any], world: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        DSConfig.load(given, world_size=world)
    assert info.value.field == field


BAD: list[tuple[dict[str, Any], str]] = [
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "initial_scale_power": -2}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": 1}}, "fp16.consecutive_hysteresis"),
    ({"bf16": {"enabled": 1}}, "bf16.enabled"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"allgather_bucket_size": 1.5}}, "zero_optimization.allgather_bucket_size"),
    ({"zero_optimization": {"overlap_comm": "true"}}, "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"contiguous_gradients": None}}, "zero_optimization.contiguous_gradients"),
    ({"zero_optimization": {"reduce_scatter": 0}}, "zero_optimization.reduce_scatter"),
    (
        {"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
        "zero_optimization.stage3_prefetch_bucket_size",
    ),
    (
        {"zero_optimization": {"stage3_param_persistence_threshold": -1}},
        "zero_optimization.stage3_param_persistence_threshold",
    ),
    (
        {"zero_optimization": {"stage3_max_live_parameters": "x"}},
        "zero_optimization.stage3_max_live_parameters",
    ),
    ({"zero_optimization": {"sub_group_size": -1}}, "zero_optimization.sub_group_size"),
    ({"zero_optimization": {"offload_param": "cpu"}}, "zero_optimization.offload_param"),
    ({"zero_optimization": []}, "zero_optimization"),
    ({"optimizer": {"type": "Adamm"}}, "optimizer.type"),
    ({"optimizer": {"type": 3}}, "optimizer.type"),
    ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": -0.1}}}, "optimizer.params.weight_decay"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": "no"}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "AdamW", "params": {"fused": 1}}}, "optimizer.params.fused"),
    ({"optimizer": {"type": "Adam", "params": []}}, "optimizer.params"),
    ({"optimizer": {"params": {}}}, "optimizer.type"),
    ({"scheduler": {"type": "Cosine"}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}, "scheduler.params.warmup_type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -1}}}, "scheduler.params.warmup_max_lr"),
    (
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}},
        "scheduler.params.warmup_num_steps",
    ),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_clipping": "1"}, "gradient_clipping"),
    ({"steps_per_print": 0}, "steps_per_print"),
    ({"wall_clock_breakdown": "no"}, "wall_clock_breakdown"),
    ({"seed": -3}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"aio": {"block_size": 100}}, "aio.block_size"),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth"),
    ({"aio": {"single_submit": 1}}, "aio.single_submit"),
    # DeepSpeed accepts 512; a dsio handle needs a power of two >= 4096: refused when parsed, not later
    ({"aio": {"block_size": 512}}, "aio.block_size"),
    ({"aio": {"block_size": 12288}}, "aio.block_size"),
    ({"checkpoint": {"tag_validation": "Maybe"}}, "checkpoint.tag_validation"),
]


@pytest.mark.parametrize(("extra", "field"), BAD, ids=[f for _, f in BAD])
def test_invalid_values_raise_config_error_naming_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(extra)
    assert info.value.field == field
    assert not isinstance(info.value, NotImplementedConfigError)


TYPOS = [
    ({"zero_optimisation": {}}, "zero_optimisation", "zero_optimization"),
    ({"zero_optimization": {"stag": 1}}, "zero_optimization.stag", "stage"),
    ({"fp16": {"enable": True}}, "fp16.enable", "enabled"),
    ({"gradient_clippping": 1.0}, "gradient_clippping", "gradient_clipping"),
    ({"optimizer": {"type": "Adam", "parms": {}}}, "optimizer.parms", "params"),
    (
        {"optimizer": {"type": "Adam", "params": {"learning_rate": 1e-3, "lr": 1}}},
        "optimizer.params.learning_rate",
        None,
    ),
    (
        {"optimizer": {"type": "Adam", "params": {"weight_decy": 0.1}}},
        "optimizer.params.weight_decy",
        "weight_decay",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}},
        "scheduler.params.warmup_num_step",
        "warmup_num_steps",
    ),
    ({"aio": {"queue_dept": 3}}, "aio.queue_dept", "queue_depth"),
]


@pytest.mark.parametrize(("extra", "field", "suggestion"), TYPOS, ids=[t[1] for t in TYPOS])
def test_unknown_keys_are_errors_with_did_you_mean(
    extra: dict[str, Any], field: str, suggestion: str | None
) -> None:
    with pytest.raises(ConfigError) as info:
        load(extra)
    assert info.value.field == field
    if suggestion is not None:
        assert f"did you mean '{suggestion}'" in str(info.value)


UNIMPLEMENTED = [
    ({"elasticity": {"enabled": True}}, "elasticity"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"communication_data_type": "fp32"}, "communication_data_type"),
    ({"fp16": {"auto_cast": True}}, "fp16.auto_cast"),
    (
        {"zero_optimization": {"zero_quantized_weights": True}},
        "zero_optimization.zero_quantized_weights",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer.device",
    ),
    ({"optimizer": {"type": "Lion"}}, "optimizer.type"),
    ({"optimizer": {"type": "muon"}}, "optimizer.type"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
]


@pytest.mark.parametrize(("extra", "field"), UNIMPLEMENTED, ids=[f for _, f in UNIMPLEMENTED])
def test_recognised_but_unimplemented_keys_raise_saying_so(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(NotImplementedConfigError) as info:
        load(extra)
    assert info.value.field == field


def test_full_deepspeed_config_from_json_file(tmp_path: Any) -> None:
    ds = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
        "bfloat16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9,
            "sub_group_size": 1e9,
            "offload_param": {"device": "none"},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2},
        "steps_per_print": 5,
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "Fail"},
        "seed": 42,
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    cfg = DSConfig.load(path, world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 8
    assert cfg.precision == "bf16" and cfg.bf16.enabled
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.reduce_bucket_size == 5e7
    assert cfg.aio.intra_op_parallelism == 2
    # the "aio" block is dsio's IOConfig, parsed by its one owner
    import dsio

    assert cfg.aio == dsio.IOConfig.from_deepspeed(ds["aio"])
    assert cfg.optimizer is not None and cfg.optimizer.name == "AdamW"
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.seed == 42


def test_invalid_json_file_is_a_config_error(tmp_path: Any) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError):
        DSConfig.load(path)


def test_config_dataclasses_are_frozen_and_validate_on_direct_construction() -> None:
    cfg = load({})
    with pytest.raises(AttributeError):
        cfg.gradient_clipping = 2.0  # type: ignore[misc]
    with pytest.raises(ConfigError) as info:
        ZeroConfig(stage=5)
    assert info.value.field == "zero_optimization.stage"
    with pytest.raises(ConfigError):
        FP16Config(enabled=True, hysteresis=0)
    with pytest.raises(ConfigError) as info:
        DSConfig(train_batch_size=8, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1)
    assert info.value.field == "train_batch_size"
    with pytest.raises(TypeError):
        ZeroConfig(2)  # type: ignore[misc]  # keyword-only


def test_defaults_match_deepspeed() -> None:
    cfg = load({"fp16": {"enabled": True}})
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000
    assert cfg.fp16.hysteresis == 2 and cfg.fp16.min_loss_scale == 1.0 and cfg.fp16.loss_scale == 0.0
    assert cfg.zero_optimization.stage == 0 and cfg.gradient_clipping == 0.0
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 100_000
