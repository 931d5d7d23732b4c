"""The sections of a DeepSpeed config (`fp16`, `zero_optimization`, `optimizer`, ...) as frozen dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dstrain._parse import check_bool, check_choice, check_float, check_int, reject_unknown
from dstrain.errors import ConfigError, NotImplementedConfigError

__all__ = [
    "BF16Config",
    "CheckpointConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config:
    """``"fp16"``: half-precision compute, fp32 master weights, loss scaling."""

    enabled: bool = False
    """Train in fp16."""
    loss_scale: float = 0.0
    """0 selects dynamic loss scaling; a positive value is a fixed scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """After this many overflow-free steps the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered (each overflow still skips its step)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step (not only on scale growth)."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""

    _UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ("auto_cast", "fp16_master_weights_and_grads")

    def __post_init__(self) -> None:
        check_bool("fp16", "enabled", self.enabled)
        check_float("fp16", "loss_scale", self.loss_scale, min_value=0.0)
        check_int("fp16", "initial_scale_power", self.initial_scale_power, min_value=0)
        check_int("fp16", "loss_scale_window", self.loss_scale_window, min_value=1)
        check_int("fp16", "hysteresis", self.hysteresis, min_value=1)
        check_bool("fp16", "consecutive_hysteresis", self.consecutive_hysteresis)
        check_float("fp16", "min_loss_scale", self.min_loss_scale, min_value=0.0, strict_min=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class BF16Config:
    """``"bf16"`` (alias ``"bfloat16"``): bfloat16 compute with fp32 master weights."""

    enabled: bool = False
    """Train in bf16."""

    _UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ("immediate_grad_update", "check_grad_overflow")

    def __post_init__(self) -> None:
        check_bool("bf16", "enabled", self.enabled)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """``"zero_optimization"``: which ZeRO stage and how it communicates."""

    stage: int = 0
    """0: data parallel; 1: optimizer states partitioned; 2: + gradients; 3: + parameters."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient-reduction bucket."""
    allgather_bucket_size: int = 500_000_000
    """Accepted for compatibility: dstrain gathers parameters in place into their flat buffer after the
    step, so it needs no staging bucket of this size."""
    overlap_comm: bool = False
    """Stage 2/3: launch gradient reductions asynchronously during backward."""
    contiguous_gradients: bool = True
    """Accepted for compatibility: dstrain's gradients are always contiguous (flat buffers / buckets)."""
    reduce_scatter: bool = True
    """Stage 1: reduce gradients with reduce-scatter (True) or all-reduce (False)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of parameters prefetched ahead of the module that needs them."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: modules whose parameters have fewer elements than this stay gathered."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Stage 3: gathered (non-persistent) elements allowed before prefetching stops."""
    sub_group_size: int = 1_000_000_000
    """Elements the optimizer steps as one piece (at most 8M without offload); with optimizer offload,
    the unit of swapping (shrunk to fit ``offload_pinned_bytes``, logged)."""
    offload_param: Any = None
    """ZeRO-Infinity parameter offload (`dstrain.offload.OffloadParamConfig`, from a JSON object or null).
    Parsed and validated; any device but ``"none"`` raises `NotImplementedConfigError` (not built yet)."""
    offload_optimizer: Any = None
    """ZeRO-Infinity optimizer offload, stages 1-3 (`dstrain.offload.OffloadOptimizerConfig`, from a
    JSON object or null): ``"cpu"`` or ``"nvme"`` (never silently downgraded)."""
    offload_pinned_bytes: int = 1 << 30
    """dstrain extension: pinned host memory per rank for every offload swap buffer (dsio's staging
    included); buffer counts and sizes derive from it, DeepSpeed's buffer_count/buffer_size are hints."""

    _UNIMPLEMENTED: ClassVar[tuple[str, ...]] = (
        "cpu_offload",
        "elastic_checkpoint",
        "ignore_unused_parameters",
        "legacy_stage1",
        "load_from_fp32_weights",
        "memory_efficient_linear",
        "mics_shard_size",
        "round_robin_gradients",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_max_reuse_distance",
        "stage3_module_granularity_threshold",
        "zero_hpz_partition_size",
        "zero_quantized_gradients",
        "zero_quantized_weights",
    )

    def __post_init__(self) -> None:
        p = "zero_optimization"
        check_choice(p, "stage", self.stage, (0, 1, 2, 3))
        for name in (
            "reduce_bucket_size",
            "allgather_bucket_size",
            "sub_group_size",
        ):
            check_int(p, name, getattr(self, name), min_value=1)
        for name in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
        ):
            check_int(p, name, getattr(self, name), min_value=0)
        for name in ("overlap_comm", "contiguous_gradients", "reduce_scatter"):
            check_bool(p, name, getattr(self, name))
        from dstrain.offload.config import check_budget, check_stage, parse_offload

        object.__setattr__(self, "offload_param", parse_offload(self.offload_param, "param"))
        object.__setattr__(self, "offload_optimizer", parse_offload(self.offload_optimizer, "optimizer"))
        check_budget(self.offload_pinned_bytes)
        check_stage(self.stage, self.offload_optimizer, self.offload_param)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """``"checkpoint"``: checkpoint options."""

    tag_validation: str = "Warn"
    """Ignore, Warn or Fail when ranks save with different tags."""

    _UNIMPLEMENTED: ClassVar[tuple[str, ...]] = ("load_universal", "use_node_local_storage", "parallel_write")

    def __post_init__(self) -> None:
        check_choice("checkpoint", "tag_validation", self.tag_validation, ("Ignore", "Warn", "Fail"))


_OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "adam": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "adam_w_mode",
        "torch_adam",
        "fused",
        "foreach",
    ),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "fused", "foreach"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    # dstrain/onebit: DeepSpeed's names; cuda_aware / comm_backend_name only mattered to its transport
    "onebitadam": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "freeze_step",
        "cuda_aware",
        "comm_backend_name",
        "max_grad_norm",
        "bias_correction",
        "deepspeed_compat",
        "fused",
    ),
    "zerooneadam": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        "cuda_aware",
        "comm_backend_name",
        "max_grad_norm",
        "amsgrad",
        "eps_inside_sqrt",
        "bias_correction",
        "deepspeed_compat",
        "fused",
    ),
}
_OPTIMIZER_NAMES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
}
_OPTIMIZER_UNIMPLEMENTED = (
    "OneBitLamb",
    "Lamb",
    "Lion",
    "Adagrad",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "Muon",
)


def _check_params(prefix: str, params: object, known: tuple[str, ...], numeric_min: dict[str, float]) -> None:
    if not isinstance(params, Mapping):
        raise ConfigError(f"{prefix}.params", f"expected an object, got {params!r}")
    reject_unknown(params, known, (), f"{prefix}.params")
    for name, low in numeric_min.items():
        if name in params:
            check_float(f"{prefix}.params", name, params[name], min_value=low)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """``"optimizer"``: ``{"type": "Adam" | "AdamW" | "SGD", "params": {...}}``.

    As in DeepSpeed, ``Adam`` decouples weight decay (AdamW) unless ``"adam_w_mode": false``.
    ``fused`` / ``foreach`` pass through to torch (as DeepSpeed does with ``torch_adam``); when neither
    is given dstrain uses torch's fused Adam(W) kernel where it supports the tensors.
    """

    type: str
    """Optimizer name, case-insensitive."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimizer."""

    def __post_init__(self) -> None:
        if not isinstance(self.type, str):
            raise ConfigError("optimizer.type", f"expected a string, got {self.type!r}")
        key = self.type.lower()
        if key in {n.lower() for n in _OPTIMIZER_UNIMPLEMENTED}:
            raise NotImplementedConfigError("optimizer.type", f"{self.type} is not implemented yet")
        if key not in _OPTIMIZER_PARAMS:
            check_choice("optimizer", "type", self.type, list(_OPTIMIZER_NAMES.values()))
        numeric = {"lr": 0.0, "eps": 0.0, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0}
        _check_params("optimizer", self.params, _OPTIMIZER_PARAMS[key], numeric)
        betas = self.params.get("betas")
        if betas is not None and (
            not isinstance(betas, list | tuple)
            or len(betas) != 2
            or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ConfigError("optimizer.params.betas", f"expected two numbers in [0, 1), got {betas!r}")
        for flag in (
            "amsgrad",
            "adam_w_mode",
            "torch_adam",
            "nesterov",
            "fused",
            "foreach",
            "cuda_aware",
            "bias_correction",
            "deepspeed_compat",
        ):
            if flag in self.params:
                check_bool("optimizer.params", flag, self.params[flag])
        if "freeze_step" in self.params:
            check_int("optimizer.params", "freeze_step", self.params["freeze_step"], min_value=1)
        for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if name in self.params:
                check_int("optimizer.params", name, self.params[name], min_value=1)

    @property
    def name(self) -> str:
        """Canonical name: ``Adam``, ``AdamW`` or ``SGD``."""
        return _OPTIMIZER_NAMES[self.type.lower()]


_SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": (
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
        "last_batch_iteration",
    ),
    "WarmupCosineLR": (
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """``"scheduler"``: ``{"type": "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR", "params": {...}}``."""

    type: str
    """Schedule name."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the schedule."""

    def __post_init__(self) -> None:
        if self.type in ("OneCycle", "LRRangeTest"):
            raise NotImplementedConfigError("scheduler.type", f"{self.type} is not implemented yet")
        check_choice("scheduler", "type", self.type, list(_SCHEDULER_PARAMS))
        numeric = {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.0,
            "warmup_num_steps": 0.0,
            "total_num_steps": 1.0,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.0,
        }
        _check_params("scheduler", self.params, _SCHEDULER_PARAMS[self.type], numeric)
        if "warmup_type" in self.params:
            check_choice("scheduler.params", "warmup_type", self.params["warmup_type"], ("log", "linear"))
        if self.type == "WarmupDecayLR" and "total_num_steps" not in self.params:
            raise ConfigError("scheduler.params.total_num_steps", "is required by WarmupDecayLR")
        if self.type == "WarmupCosineLR" and "total_num_steps" not in self.params:
            raise ConfigError("scheduler.params.total_num_steps", "is required by WarmupCosineLR")
        steps = self.params.get("total_num_steps")
        warm = self.params.get("warmup_num_steps", 0)
        if steps is not None and warm > steps:
            raise ConfigError(
                "scheduler.params.warmup_num_steps", f"{warm} exceeds total_num_steps ({steps})"
            )
