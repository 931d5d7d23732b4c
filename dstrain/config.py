"""DeepSpeed's JSON config as frozen dataclasses.

`DSConfig.load(dict_or_path, world_size=...)` accepts the JSON a DeepSpeed user already has. Unlike
DeepSpeed, an unknown key is a `ConfigError` with a did-you-mean, and a key DeepSpeed accepts that
dstrain does not implement yet raises `NotImplementedConfigError` instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsio.config import DEEPSPEED_AIO_DEFAULTS, IOConfig
from dstrain._parse import build, check_bool, check_float, check_int, reject_unknown
from dstrain.checkpointing.config import ActivationCheckpointingConfig
from dstrain.config_sections import (
    BF16Config,
    CheckpointConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from dstrain.dist.comms_logger import CommsLoggerConfig
from dstrain.errors import ConfigError
from dstrain.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
from dstrain.pipe.config import PipelineConfig

__all__ = [
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "DSConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]

AioConfig = IOConfig
"""The ``"aio"`` section is dsio's `IOConfig`, parsed by its one owner, ``IOConfig.from_deepspeed``
(DeepSpeed's keys and defaults, validated as a dsio handle accepts them)."""


def _parse_aio(block: Any) -> IOConfig:
    """``IOConfig.from_deepspeed(block)``, its errors as dstrain's `ConfigError` naming ``aio.<key>``."""
    import dsio

    try:
        return IOConfig.from_deepspeed(block)
    except dsio.ConfigError as e:
        message = str(e)
        known = [*DEEPSPEED_AIO_DEFAULTS, "thread_count", *(f.name for f in dataclasses.fields(IOConfig))]
        if e.field is not None and e.field not in known:  # an unknown key: suggest the closest ones
            close = difflib.get_close_matches(e.field, known, n=3, cutoff=0.6)
            if close:
                message += f"; did you mean {' or '.join(repr(c) for c in close)}?"
        raise ConfigError(f"aio.{e.field}" if e.field else "aio", message) from e


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True, kw_only=True, slots=True)
class DSConfig:
    """A whole training config. Build it with `DSConfig.load`; direct construction validates too."""

    world_size: int = 1
    """Data-parallel world size the batch sizes were resolved against."""
    train_batch_size: int
    """Samples per optimizer step over all ranks = micro batch x accumulation steps x world size."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-steps per optimizer step; the loss is scaled by 1/this in `Engine.backward`."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build; None means the caller passes one to `initialize`."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule, stepped once per optimizer step; None for a constant LR."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 compute with fp32 master weights and (dynamic) loss scaling."""
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 compute with fp32 master weights."""
    gradient_clipping: float = 0.0
    """Clip gradients to this global L2 norm (over all partitions); 0 disables clipping."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and its communication settings."""
    aio: IOConfig = field(default_factory=lambda: IOConfig.from_deepspeed(None))
    """Async I/O settings of the dsio handles that ZeRO-Infinity offload swaps through."""
    steps_per_print: int = 10
    """Log loss scale / LR every this many optimizer steps (rank 0, logging.INFO)."""
    wall_clock_breakdown: bool = False
    """Log the forward/backward/step time split every `steps_per_print` steps."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint options."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline-parallel settings (the model must be a `dstrain.pipe.PipelineModule`); parsed strictly."""
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    """`dstrain.checkpointing` settings (parsed by that room); `initialize` configures it when present."""
    comms_logger: CommsLoggerConfig | None = None
    """`dstrain.dist.comms_logger` settings (parsed by that module); `initialize` configures it when present."""
    tensorboard: TensorBoardConfig | None = None
    """`dstrain.monitor` TensorBoard scalars (DeepSpeed's event names), rank 0."""
    csv_monitor: CSVConfig | None = None
    """`dstrain.monitor` CSV files, rank 0."""
    wandb: WandbConfig | None = None
    """`dstrain.monitor` Weights & Biases (needs the ``wandb`` package), rank 0."""
    seed: int | None = None
    """If set, `initialize` seeds torch's RNG with it (same on every rank) before building anything."""

    _ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    _UNIMPLEMENTED: ClassVar[tuple[str, ...]] = (
        "amp",
        "autotuning",
        "communication_data_type",
        "compression_training",
        "data_efficiency",
        "data_types",
        "dump_state",
        "elasticity",
        "flops_profiler",
        "gradient_predivide_factor",
        "memory_breakdown",
        "prescale_gradients",
        "sparse_attention",
        "sparse_gradients",
        "torch_autocast",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
    )

    def __post_init__(self) -> None:
        check_int("", "world_size", self.world_size, min_value=1)
        for key in _BATCH_KEYS:
            check_int("", key, getattr(self, key), min_value=1)
        expected = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.world_size
        if self.train_batch_size != expected:
            raise ConfigError(
                "train_batch_size",
                f"{self.train_batch_size} != train_micro_batch_size_per_gpu "
                f"({self.train_micro_batch_size_per_gpu}) x gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) x world size ({self.world_size}) = {expected}",
            )
        for name, cls in (
            ("fp16", FP16Config),
            ("bf16", BF16Config),
            ("zero_optimization", ZeroConfig),
            ("aio", IOConfig),
            ("checkpoint", CheckpointConfig),
            ("pipeline", PipelineConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"expected {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError("optimizer", "expected OptimizerConfig or None")
        if self.activation_checkpointing is not None and not isinstance(
            self.activation_checkpointing, ActivationCheckpointingConfig
        ):
            raise ConfigError("activation_checkpointing", "expected ActivationCheckpointingConfig or None")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError("scheduler", "expected SchedulerConfig or None")
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("bf16.enabled", "fp16 and bf16 cannot both be enabled")
        check_float("", "gradient_clipping", self.gradient_clipping, min_value=0.0)
        check_int("", "steps_per_print", self.steps_per_print, min_value=1)
        check_bool("", "wall_clock_breakdown", self.wall_clock_breakdown)
        if self.seed is not None:
            check_int("", "seed", self.seed, min_value=0)

    @property
    def precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @classmethod
    def load(cls, config: Mapping[str, Any] | str | os.PathLike[str], *, world_size: int = 1) -> DSConfig:
        """Parse a DeepSpeed config dict or JSON file, resolving batch sizes against ``world_size``."""
        if isinstance(config, str | os.PathLike):
            try:
                with open(config) as f:
                    data = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError("<config>", f"{os.fspath(config)} is not valid JSON: {e}") from e
        else:
            data = config
        known = [f.name for f in dataclasses.fields(cls) if f.name != "world_size"]
        reject_unknown(data, known + list(cls._ALIASES), cls._UNIMPLEMENTED, "")
        data = {cls._ALIASES.get(k, k): v for k, v in data.items()}
        check_int("", "world_size", world_size, min_value=1)
        tbs, mbs, gas = _resolve_batch(data, world_size)
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in _BATCH_KEYS}
        sections = {
            "fp16": FP16Config,
            "bf16": BF16Config,
            "zero_optimization": ZeroConfig,
            "checkpoint": CheckpointConfig,
            "pipeline": PipelineConfig,
            "optimizer": OptimizerConfig,
            "scheduler": SchedulerConfig,
            "activation_checkpointing": ActivationCheckpointingConfig,
            "comms_logger": CommsLoggerConfig,
            "tensorboard": TensorBoardConfig,
            "csv_monitor": CSVConfig,
            "wandb": WandbConfig,
        }
        if kwargs.get("aio") is not None:
            kwargs["aio"] = _parse_aio(kwargs["aio"])
        for name, section in sections.items():
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = build(section, kwargs[name], name)
        return cls(
            world_size=world_size,
            train_batch_size=tbs,
            train_micro_batch_size_per_gpu=mbs,
            gradient_accumulation_steps=gas,
            **kwargs,
        )


def _resolve_batch(data: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """Any two of (train batch, micro batch, accumulation steps) determine the third, as in DeepSpeed."""
    tbs = data.get("train_batch_size")
    mbs = data.get("train_micro_batch_size_per_gpu")
    gas = data.get("gradient_accumulation_steps")
    for key, value in zip(_BATCH_KEYS, (tbs, mbs, gas), strict=True):
        if value is not None:
            check_int("", key, value, min_value=1)
    if tbs is not None and mbs is not None and gas is not None:
        return int(tbs), int(mbs), int(gas)  # __post_init__ checks they agree
    if tbs is not None and mbs is not None:
        if tbs % (mbs * world_size):
            raise ConfigError(
                "train_batch_size",
                f"{tbs} is not divisible by train_micro_batch_size_per_gpu ({mbs}) x world size ({world_size})",
            )
        return int(tbs), int(mbs), tbs // (mbs * world_size)
    if tbs is not None:
        gas = 1 if gas is None else gas
        if tbs % (gas * world_size):
            raise ConfigError(
                "train_batch_size",
                f"{tbs} is not divisible by gradient_accumulation_steps ({gas}) x world size ({world_size})",
            )
        return int(tbs), tbs // (gas * world_size), int(gas)
    if mbs is not None:
        gas = 1 if gas is None else gas
        return mbs * gas * world_size, int(mbs), int(gas)
    raise ConfigError("train_batch_size", "set at least train_batch_size or train_micro_batch_size_per_gpu")
