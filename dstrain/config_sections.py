"""The sections of a DeepSpeed config (`fp16`, `zero_optimization`, `optimizer`, ...) as frozen dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dstrain._parse import (
    Section,
    Unbuilt,
    check_bool,
    check_choice,
    check_float,
    check_int,
    note_no_effect,
    reject_unknown,
)
from dstrain.errors import ConfigError, NotImplementedConfigError

__all__ = [
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "UNBUILT_OPTIMIZER_TYPES",
    "BF16Config",
    "CheckpointConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config(Section):
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

    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "auto_cast": Unbuilt(
            why="casts the forward's inputs to fp16 (dstrain's engine casts them always)", default=False
        ),
        "fp16_master_weights_and_grads": Unbuilt(
            why="fp16 master weights and gradients (ZeRO-2 + CPU offload); dstrain's masters are fp32",
            default=False,
        ),
    }

    def __post_init__(self) -> None:
        check_bool("fp16", "enabled", self.enabled)
        check_float("fp16", "loss_scale", self.loss_scale, min_value=0.0)
        if not self.enabled or self.loss_scale > 0:
            return  # the dynamic scaler's fields are unused (DeepSpeed does not check them either)
        check_int("fp16", "initial_scale_power", self.initial_scale_power, min_value=0)
        check_int("fp16", "loss_scale_window", self.loss_scale_window, min_value=1)
        check_int("fp16", "hysteresis", self.hysteresis, min_value=1)
        check_bool("fp16", "consecutive_hysteresis", self.consecutive_hysteresis)
        check_float("fp16", "min_loss_scale", self.min_loss_scale, min_value=0.0, strict_min=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class BF16Config(Section):
    """``"bf16"`` (alias ``"bfloat16"``): bfloat16 compute with fp32 master weights."""

    enabled: bool = False
    """Train in bf16."""

    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "immediate_grad_update": Unbuilt(
            why="accumulates bf16 gradients into fp32 in the backward hook", default=False
        ),
        "check_grad_overflow": Unbuilt(
            why="skips bf16 steps whose gradients overflow; dstrain checks overflow only for fp16",
            default=True,
            also=(False,),
        ),
        "bf16_master_weights_and_grads": Unbuilt(why="bf16 master weights and gradients", default=False),
        "bf16_optimizer_states": Unbuilt(why="bf16 optimizer states", default=False),
    }

    def __post_init__(self) -> None:
        check_bool("bf16", "enabled", self.enabled)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig(Section):
    """``"zero_optimization"``: which ZeRO stage and how it communicates."""

    stage: int = 0
    """0: data parallel; 1: optimizer states partitioned; 2: + gradients; 3: + parameters."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient-reduction bucket."""
    allgather_bucket_size: int = 500_000_000
    """Accepted for compatibility: dstrain gathers parameters in place into their flat buffer after the
    step, so it needs no staging bucket of this size."""
    overlap_comm: bool = False
    """Stage 2/3: launch gradient reductions asynchronously during backward. Absent from a JSON config:
    true at stage 3, false below (DeepSpeed's defaults; `DSConfig.load` fills it)."""
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
    stage3_max_reuse_distance: int = 1_000_000_000
    """Accepted for DeepSpeed configs: dstrain releases a gathered unit when its module is done (a reuse
    distance of 0) and re-gathers it, prefetched, when it is needed again."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: `Engine.save_16bit_model` (the HF Trainer's ``save_model``) gathers the weights, a unit at
    a time, and writes them on rank 0; False: it saves nothing and returns False, as DeepSpeed does
    (stages 0-2 always save). ``stage3_gather_fp16_weights_on_model_save`` is its older name."""
    allgather_partitions: bool = True
    """Accepted for DeepSpeed configs (stages 1-2): dstrain all-gathers the updated partitions after the
    step (DeepSpeed's ``true``); ``false`` asks for broadcasts instead, which only changes speed."""
    sub_group_size: int = 1_000_000_000
    """Elements the optimizer steps as one piece (at most 8M without offload); with optimizer offload,
    the unit of swapping (shrunk to fit ``offload_pinned_bytes``, logged)."""
    offload_param: Any = None
    """ZeRO-Infinity parameter offload (`dstrain.offload.OffloadParamConfig`, from a JSON object or null).
    ``"cpu"`` or ``"nvme"`` at stage 3."""
    offload_optimizer: Any = None
    """ZeRO-Infinity optimizer offload, stages 1-3 (`dstrain.offload.OffloadOptimizerConfig`, from a
    JSON object or null): ``"cpu"`` or ``"nvme"`` (never silently downgraded)."""
    offload_pinned_bytes: int = 1 << 30
    """dstrain extension: pinned host memory per rank for every offload swap buffer (dsio's staging
    included); buffer counts and sizes derive from it, DeepSpeed's buffer_count/buffer_size are hints."""

    _ALIASES: ClassVar[dict[str, str]] = {  # DeepSpeed's pydantic field names of the stage3_* keys
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    _NO_EFFECT: ClassVar[dict[str, str]] = {
        "allgather_bucket_size": "dstrain gathers parameters in place into their flat buffer, without a staging bucket",
        "contiguous_gradients": "dstrain's gradients are always contiguous (flat buffers and buckets)",
        "stage3_max_reuse_distance": "dstrain releases a gathered unit when its module is done and prefetches it again",
        "max_reuse_distance": "dstrain releases a gathered unit when its module is done and prefetches it again",
        "allgather_partitions": "dstrain always all-gathers the updated partitions (DeepSpeed's true)",
    }
    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "cpu_offload": Unbuilt(
            why="the old ZeRO-Offload switch; use offload_optimizer", default=None, also=(False,)
        ),
        "cpu_offload_param": Unbuilt(
            why="the old parameter offload switch; use offload_param", default=None, also=(False,)
        ),
        "cpu_offload_use_pin_memory": Unbuilt(
            why="the old pin switch; use offload_*.pin_memory", default=None, also=(False,)
        ),
        "elastic_checkpoint": Unbuilt(why="loading ZeRO-1/2 checkpoints at another DP size", default=False),
        "ignore_unused_parameters": Unbuilt(
            why="tolerating parameters without gradients (dstrain always does: they keep a zero gradient)",
            default=True,
            also=(False,),
        ),
        "legacy_stage1": Unbuilt(why="DeepSpeed's old stage-1 implementation", default=False),
        "load_from_fp32_weights": Unbuilt(
            why="rebuilding 16-bit weights from the fp32 master on load (dstrain always does)", default=True
        ),
        "memory_efficient_linear": Unbuilt(
            why="DeepSpeed's ZeRO-3 linear layer that saves no weight for backward",
            default=True,
            also=(False,),
        ),
        "mics_shard_size": Unbuilt(why="MiCS hierarchical shard groups", default=-1),
        "mics_hierarchical_params_gather": Unbuilt(why="MiCS hierarchical gathers", default=False),
        "round_robin_gradients": Unbuilt(
            why="DeepSpeed's stage 1-2 CPU-offload gradient copy order (speed only); dstrain copies its own way",
            any_value=True,
        ),
        "stage3_module_granularity_threshold": Unbuilt(why="leaf-module fetch granularity", default=0),
        "module_granularity_threshold": Unbuilt(why="leaf-module fetch granularity", default=0),
        "zero_hpz_partition_size": Unbuilt(why="ZeRO++ hierarchical partitioning (hpZ)", default=1),
        "zero_quantized_gradients": Unbuilt(why="ZeRO++ quantized gradients (qgZ)", default=False),
        "zero_quantized_weights": Unbuilt(why="ZeRO++ quantized weights (qwZ)", default=False),
        "zero_quantized_nontrainable_weights": Unbuilt(why="ZeRO++ quantized frozen weights", default=False),
        "allgather_sequential": Unbuilt(why="sequential stage-3 all-gathers", default=False),
        "stage3_allgather_sequential": Unbuilt(why="sequential stage-3 all-gathers", default=False),
        "use_all_reduce_for_fetch_params": Unbuilt(
            why="all-reduce instead of all-gather for fetches", default=False
        ),
        "stage3_use_all_reduce_for_fetch_params": Unbuilt(
            why="all-reduce instead of all-gather for fetches", default=False
        ),
        "model_persistence_threshold": Unbuilt(
            why="a cap on persistent parameters", default=9223372036854775807
        ),
        "stage3_model_persistence_threshold": Unbuilt(
            why="a cap on persistent parameters", default=9223372036854775807
        ),
        "use_multi_rank_bucket_allreduce": Unbuilt(
            why="DeepSpeed's bucket all-reduce across ranks (dstrain buckets by reduce_bucket_size)",
            default=True,
            also=(False,),
        ),
        "compute_grad_norm": Unbuilt(
            why="DeepSpeed computes the norm always; dstrain when clipping or fp16 need it", default=True
        ),
        "enable_sanity_checks": Unbuilt(why="DeepSpeed's stage-3 debug checks", default=False),
        "log_trace_cache_warnings": Unbuilt(
            why="stage-3 trace cache warnings (dstrain has no trace cache)", default=False
        ),
        "override_module_apply": Unbuilt(why="zero.Init's module.apply override", default=True),
        "parameter_alignment": Unbuilt(why="parameter alignment padding", default=False),
        "pipeline_loading_checkpoint": Unbuilt(why="pipelined checkpoint loads", default=False),
        "save_muon_momentum_buffer_in_memory": Unbuilt(why="Muon (not built)", default=False),
        "leaf_module": Unbuilt(why="stage-3 leaf modules (MoE blocks fetched whole)", default={}),
        "zenflow": Unbuilt(why="ZenFlow asynchronous offload updates", default=None),
        "grad_hooks": Unbuilt(why="DeepSpeed's gradient hooks switch (dstrain always hooks)", default=True),
    }

    def __post_init__(self) -> None:
        p = "zero_optimization"
        check_choice(p, "stage", self.stage, (0, 1, 2, 3))
        if self.sub_group_size == 0 and not isinstance(self.sub_group_size, bool):
            # axolotl's templates: DeepSpeed then makes each parameter a sub-group of its own; dstrain
            # cuts sub-groups by size (a speed/memory choice, never the numbers): the default size
            note_no_effect(
                f"{p}.sub_group_size", 0, "dstrain sizes sub-groups itself: 0 means its default, 1e9"
            )
            object.__setattr__(self, "sub_group_size", 1_000_000_000)
        for name in ("allgather_bucket_size", "sub_group_size"):
            check_int(p, name, getattr(self, name), min_value=1)
        for name in (
            "reduce_bucket_size",  # 0: each gradient reduced on its own (DeepSpeed accepts it too)
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
        ):
            check_int(p, name, getattr(self, name), min_value=0)
        for name in (
            "overlap_comm",
            "contiguous_gradients",
            "reduce_scatter",
            "allgather_partitions",
            "stage3_gather_16bit_weights_on_model_save",
        ):
            check_bool(p, name, getattr(self, name))
        check_int(p, "stage3_max_reuse_distance", self.stage3_max_reuse_distance, min_value=0)
        for name in (  # JSON's 5e8 is a float: the sizes are element counts
            "reduce_bucket_size",
            "allgather_bucket_size",
            "sub_group_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ):
            object.__setattr__(self, name, int(getattr(self, name)))
        check_bool(
            p, "stage3_gather_16bit_weights_on_model_save", self.stage3_gather_16bit_weights_on_model_save
        )
        if self.stage == 3 and self.reduce_bucket_size != 500_000_000:
            note_no_effect(
                f"{p}.reduce_bucket_size",
                self.reduce_bucket_size,
                "stage 3 reduces each unit's gradients as its backward finishes, not in buckets",
            )
        if not self.reduce_scatter and self.stage >= 2:
            note_no_effect(
                f"{p}.reduce_scatter",
                False,
                f"stage {self.stage} partitions gradients: it always reduce-scatters",
            )
        from dstrain.offload.config import check_budget, check_stage, parse_offload

        object.__setattr__(self, "offload_param", parse_offload(self.offload_param, "param"))
        object.__setattr__(self, "offload_optimizer", parse_offload(self.offload_optimizer, "optimizer"))
        check_budget(self.offload_pinned_bytes)
        check_stage(self.stage, self.offload_optimizer, self.offload_param)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig(Section):
    """``"checkpoint"``: checkpoint options."""

    tag_validation: str = "Warn"
    """Ignore, Warn or Fail when ranks save with different tags."""
    use_node_local_storage: bool = False
    """Each host writes its ranks' files into its own ``save_dir`` (storage not shared between hosts;
    ``dstrain.checkpoint.node_local``): the commit is agreed over the process group and each host's
    first local rank commits its directory. False: ``save_dir`` must be one directory every rank sees
    (checked at the first save into it; refused otherwise, naming this key)."""

    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "load_universal": Unbuilt(why="loading DeepSpeed universal checkpoints", default=False),
        "parallel_write": Unbuilt(why="pipeline-stage parallel writes", default={"pipeline_stage": False}),
    }

    def __post_init__(self) -> None:
        check_choice("checkpoint", "tag_validation", self.tag_validation, ("Ignore", "Warn", "Fail"))
        check_bool("checkpoint", "use_node_local_storage", self.use_node_local_storage)


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
_OPTIMIZER_PARAMS["lamb"] = (  # dstrain/optim/lamb.py: DeepSpeed's FusedLamb keys
    "lr",
    "bias_correction",
    "betas",
    "eps",
    "eps_inside_sqrt",
    "weight_decay",
    "max_coeff",
    "min_coeff",
    "max_grad_norm",
)
_OPTIMIZER_PARAMS["onebitlamb"] = (  # dstrain/onebit/lamb.py: DeepSpeed 0.16.5's OnebitLamb keys
    "lr",
    "freeze_step",
    "bias_correction",
    "betas",
    "eps",
    "eps_inside_sqrt",
    "weight_decay",
    "max_grad_norm",
    "max_coeff",
    "min_coeff",
    "amsgrad",
    "cuda_aware",
    "comm_backend_name",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
)
_OPTIMIZER_NAMES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "lamb": "Lamb",
    "onebitlamb": "OneBitLamb",
}
_TORCH_ADAM = "dstrain always steps with torch's Adam(W) kernels (fused where they apply)"
_OPTIMIZER_UNIMPLEMENTED = (
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
            # a schedule's lr may be a list, one per param group (DeepSpeed's per-group values)
            values = (
                params[name] if prefix == "scheduler" and isinstance(params[name], list) else [params[name]]
            )
            for value in values:
                check_float(f"{prefix}.params", name, value, min_value=low)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig(Section):
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
        if "torch_adam" in self.params:
            note_no_effect("optimizer.params.torch_adam", self.params["torch_adam"], _TORCH_ADAM)
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
            "eps_inside_sqrt",
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
    "OneCycle": (
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
        "last_batch_iteration",
    ),
    "LRRangeTest": (
        "lr_range_test_min_lr",
        "lr_range_test_step_size",
        "lr_range_test_step_rate",
        "lr_range_test_staircase",
        "last_batch_iteration",
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig(Section):
    """``"scheduler"``: ``{"type": "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "OneCycle" | "LRRangeTest",
    "params": {...}}`` with DeepSpeed's parameter names (`dstrain.scheduler`)."""

    type: str
    """Schedule name."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the schedule."""

    def __post_init__(self) -> None:
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
        if self.type == "OneCycle":
            for name in ("cycle_min_lr", "cycle_max_lr"):
                if name not in self.params:
                    raise ConfigError(f"scheduler.params.{name}", "is required by OneCycle")
        for flag in ("cycle_momentum", "lr_range_test_staircase"):
            if flag in self.params:
                check_bool("scheduler.params", flag, self.params[flag])
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


OPTIMIZER_TYPES: tuple[str, ...] = tuple(sorted(set(_OPTIMIZER_NAMES.values())))
"""The ``optimizer.type`` names dstrain builds."""
UNBUILT_OPTIMIZER_TYPES: tuple[str, ...] = _OPTIMIZER_UNIMPLEMENTED
"""DeepSpeed optimizer types dstrain refuses (not built)."""
SCHEDULER_TYPES: tuple[str, ...] = tuple(_SCHEDULER_PARAMS)
"""The ``scheduler.type`` names dstrain builds."""
