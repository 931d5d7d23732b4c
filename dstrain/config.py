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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsio.config import DEEPSPEED_AIO_DEFAULTS, IOConfig
from dstrain._parse import (
    Section,
    Unbuilt,
    build,
    check_bool,
    check_float,
    check_int,
    note_no_effect,
    reject_unknown,
)
from dstrain.checkpointing.config import ActivationCheckpointingConfig
from dstrain.config_auto import auto_paths, resolve_auto
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
from dstrain.profiling.config import FlopsProfilerConfig

__all__ = [
    "SECTIONS",
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "DSConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "read_config_file",
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
class DSConfig(Section, Mapping[str, Any]):
    """A whole training config. Build it with `DSConfig.load`; direct construction validates too.

    It is also a read-only mapping of the resolved JSON (`to_dict`), as DeepSpeed's ``engine.config``
    is a dict: ``engine.config["train_micro_batch_size_per_gpu"]``, ``engine.config.get("zero_optimization")``.
    """

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
    flops_profiler: FlopsProfilerConfig | None = None
    """`dstrain.profiling`: count one step's FLOPs, print the profile, MFU in `Engine.statistics`."""
    seed: int | None = None
    """If set, `initialize` seeds torch's RNG with it (same on every rank) before building anything."""
    dist_timeout: float | None = None
    """Seconds a collective of any process group dstrain creates (topology, pipeline, checkpoints) waits
    for the other ranks before it fails (a dstrain key; DeepSpeed takes ``timeout`` on
    ``init_distributed`` only, as dstrain does too). None: that of ``init_distributed``, else torch's."""

    _ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    zero_allow_untested_optimizer: bool = False
    """Accepted for DeepSpeed configs: dstrain steps any client optimizer it can rebuild over the master
    tensors (and refuses by name the ones it cannot), so there is nothing to allow."""
    dataloader_drop_last: bool = False
    """The loader `initialize` builds from ``training_data`` drops the last incomplete micro-batch."""

    _NO_EFFECT: ClassVar[dict[str, str]] = {
        "zero_allow_untested_optimizer": "dstrain steps any client optimizer it can rebuild, and refuses the rest by name",
    }
    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "amp": Unbuilt(
            why="NVIDIA Apex AMP (use bf16 or fp16)", default={"enabled": False}, switch="enabled"
        ),
        "autotuning": Unbuilt(why="DeepSpeed's autotuner", default={"enabled": False}, switch="enabled"),
        "communication_data_type": Unbuilt(
            why="a gradient all-reduce dtype other than the gradients'", default=None
        ),
        "compression_training": Unbuilt(why="XTC / ZeroQuant compression training", default={}),
        "comet": Unbuilt(why="the Comet monitor", default={"enabled": False}, switch="enabled"),
        "curriculum_learning": Unbuilt(
            why="legacy curriculum learning", default={"enabled": False}, switch="enabled"
        ),
        "data_efficiency": Unbuilt(
            why="curriculum / random-LTD data efficiency", default={"enabled": False}, switch="enabled"
        ),
        "data_types": Unbuilt(why="gradient accumulation dtype", default={"grad_accum_dtype": None}),
        "dump_state": Unbuilt(why="printing the engine's state", default=False),
        "elasticity": Unbuilt(
            why="elastic batch / GPU-count planning", default={"enabled": False}, switch="enabled"
        ),
        "gradient_allreduce_op": Unbuilt(
            why="summing gradients over ranks instead of averaging them", default="mean"
        ),
        "gradient_predivide_factor": Unbuilt(why="dividing gradients before the all-reduce", default=1),
        "memory_breakdown": Unbuilt(why="memory usage prints", default=False),
        "prescale_gradients": Unbuilt(why="scaling gradients before the all-reduce", default=False),
        "sparse_attention": Unbuilt(why="block-sparse attention kernels", default=None),
        "sparse_gradients": Unbuilt(why="sparse embedding gradients", default=False),
        "torch_autocast": Unbuilt(
            why="torch.autocast instead of casting the model", default={"enabled": False}, switch="enabled"
        ),
        "zero_force_ds_cpu_optimizer": Unbuilt(
            why="dstrain's offloaded optimizer is always its own CPU Adam (DeepSpeed's true)", default=True
        ),
        "compile": Unbuilt(why="DeepSpeed's torch.compile integration", default={"deepcompile": False}),
        "hybrid_engine": Unbuilt(why="the RLHF hybrid engine", default={"enabled": False}, switch="enabled"),
        "nebula": Unbuilt(
            why="the Nebula checkpoint service (dsio saves asynchronously)",
            default={"enabled": False},
            switch="enabled",
        ),
        "progressive_layer_drop": Unbuilt(
            why="progressive layer drop", default={"enabled": False}, switch="enabled"
        ),
        "eigenvalue": Unbuilt(why="eigenvalue-based schedules", default={"enabled": False}, switch="enabled"),
        "quantize_training": Unbuilt(
            why="MoQ quantization-aware training", default={"enabled": False}, switch="enabled"
        ),
        "weight_quantization": Unbuilt(why="post-training weight quantization", default=None),
        "tensor_parallel": Unbuilt(
            why="tensor parallelism (AutoTP)", default={"autotp_size": 0}, also=({"autotp_size": 1},)
        ),
        "sequence_parallel_size": Unbuilt(why="Ulysses sequence parallelism", default=1),
        "seq_parallel_communication_data_type": Unbuilt(
            why="sequence-parallel communication dtype", default="fp32"
        ),
        "expert_parallel": Unbuilt(
            why="DeepSpeed's expert-parallel section (dstrain's MoE layers take ep_size)", default=None
        ),
        "use_data_before_expert_parallelism": Unbuilt(why="expert-parallel data order", default=False),
        "timers": Unbuilt(why="DeepSpeed's throughput timer (dstrain: engine.statistics())", any_value=True),
        "datastates_ckpt": Unbuilt(why="DataStates checkpointing", default=False),
        "disable_allgather": Unbuilt(why="skipping the post-step all-gather", default=False),
        "disable_python_gc": Unbuilt(why="disabling Python's GC during training", default=False, also=(0,)),
        "graph_harvesting": Unbuilt(why="CUDA graph harvesting", default=False),
        "managed_gradient_accumulation": Unbuilt(
            why="DeepSpeed-managed accumulation (dstrain's always is)", default=True
        ),
        "vocabulary_size": Unbuilt(why="a vocabulary size for DeepSpeed's inference kernels", any_value=True),
        "log_level": Unbuilt(
            why="DeepSpeed's logger level (dstrain logs through logging.getLogger('dstrain'))", any_value=True
        ),
    }

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
        check_bool("", "zero_allow_untested_optimizer", self.zero_allow_untested_optimizer)
        check_bool("", "dataloader_drop_last", self.dataloader_drop_last)
        if self.seed is not None:
            check_int("", "seed", self.seed, min_value=0)
        if self.dist_timeout is not None:
            check_float("", "dist_timeout", self.dist_timeout, min_value=0.0)
            if self.dist_timeout <= 0:
                raise ConfigError(
                    "dist_timeout", f"must be a positive number of seconds, got {self.dist_timeout}"
                )

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as JSON values under DeepSpeed's keys (every "auto" filled)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "world_size":
                continue
            value = getattr(self, f.name)
            if f.name == "aio":
                gds = {"use_gds": True} if value.gpu_backend == "cufile" else {}
                value = {k: getattr(value, k) for k in DEEPSPEED_AIO_DEFAULTS if k != "use_gds"} | gds
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    @property
    def precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @classmethod
    def load(cls, config: Mapping[str, Any] | str | os.PathLike[str], *, world_size: int = 1) -> DSConfig:
        """Parse a DeepSpeed config dict or JSON file, resolving batch sizes against ``world_size``."""
        data = read_config_file(config) if isinstance(config, str | os.PathLike) else config
        if auto_paths(data):  # what needs no model or optimizer (batch sizes); names the rest
            data = resolve_auto(data)
        known = [f.name for f in dataclasses.fields(cls) if f.name != "world_size"]
        data = reject_unknown(data, known + list(cls._ALIASES), cls._UNBUILT, "")
        for key, why in cls._NO_EFFECT.items():
            if key in data:
                note_no_effect(key, data[key], why)
        data = {cls._ALIASES.get(k, k): v for k, v in data.items()}
        check_int("", "world_size", world_size, min_value=1)
        tbs, mbs, gas = _resolve_batch(data, world_size)
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in _BATCH_KEYS}
        if kwargs.get("aio") is not None:
            kwargs["aio"] = _parse_aio(kwargs["aio"])
        zero = kwargs.get("zero_optimization")
        if isinstance(zero, Mapping) and "overlap_comm" not in zero:  # DeepSpeed: true at stage 3 only
            kwargs["zero_optimization"] = {**zero, "overlap_comm": zero.get("stage") == 3}
        for name, section in SECTIONS.items():
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = build(section, kwargs[name], name)
        return cls(
            world_size=world_size,
            train_batch_size=tbs,
            train_micro_batch_size_per_gpu=mbs,
            gradient_accumulation_steps=gas,
            **kwargs,
        )


SECTIONS: dict[str, type[Section]] = {
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
    "flops_profiler": FlopsProfilerConfig,
}
"""The top-level sections `DSConfig.load` builds with `dstrain._parse.build`, by key: a room's section
is one line here (and a field of `DSConfig`); `dstrain.config_reference` walks them into README's table."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file as a dict: JSON, or HJSON (comments, unquoted keys, trailing commas) as DeepSpeed
    reads every config file."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        try:
            import hjson
        except ImportError:
            raise ConfigError(
                "<config>", f"{os.fspath(path)} is not valid JSON ({e}); pip install hjson for HJSON"
            ) from e
        try:
            data = hjson.loads(text)
        except hjson.HjsonDecodeError as e2:
            raise ConfigError("<config>", f"{os.fspath(path)} is neither JSON ({e}) nor HJSON ({e2})") from e2
    if not isinstance(data, Mapping):
        raise ConfigError("<config>", f"{os.fspath(path)} holds a {type(data).__name__}, not a JSON object")
    return dict(data)


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
