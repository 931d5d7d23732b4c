"""The ``"pipeline"`` section of a DeepSpeed config, parsed strictly (DeepSpeed merges unknown keys silently)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from dstrain._parse import Section, build, check_bool, check_float, check_int
from dstrain.errors import ConfigError

__all__ = ["PipelineConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig(Section):
    """``"pipeline"``: settings of pipeline-parallel training (the model must be a `PipelineModule`)."""

    stages: int | str = "auto"
    """Pipeline stages: ``"auto"`` takes the module's ``num_stages``; an int must equal it."""
    partition: str = "best"
    """Accepted for DeepSpeed configs; the module's ``partition_method`` decides the split."""
    seed_layers: bool = False
    """Accepted for DeepSpeed configs; the module's ``seed_layers`` decides (layers are built before the config
    is read)."""
    activation_checkpoint_interval: int = 0
    """Recompute every run of this many layers in backward; 0 keeps the module's own setting (DeepSpeed lets
    the config override the module, and so does dstrain when this is non-zero)."""
    pipe_partitioned: bool = True
    """DeepSpeed's tensor-parallel activation partitioning; without tensor parallelism it has no effect."""
    grad_partitioned: bool = True
    """DeepSpeed's tensor-parallel gradient partitioning; without tensor parallelism it has no effect."""
    use_reentrant: bool = False
    """Accepted for DeepSpeed configs; activation checkpointing is always non-reentrant here."""
    p2p_timeout: float = 300.0
    """dstrain: seconds a stage waits for a neighbour's message before raising `P2PTimeoutError`."""
    transport: str = "auto"
    """dstrain: how p2p messages travel. ``"auto"``: by the backend (gloo: host tensors, tagged; NCCL:
    ``"nccl"``). ``"nccl"``: CUDA tensors natively over an NCCL group per direction, ordered, receives posted
    just in time (posting them ahead deadlocked on 2x H200 against CUDA's lazy kernel loading; see
    `Transport.post_ahead`); the NCCL default since its GPU tests passed there and it measured faster than
    ``"staged"`` (bench/results/pipe-nccl-2026-11-30-h200x2-native.md). ``"staged"``: tagged host tensors over
    a gloo group of the pipeline ranks, CUDA payloads copied through host memory. ``"ordered"``: NCCL's
    discipline on gloo (untagged, a group per direction), to test it without GPUs."""

    _NO_EFFECT: ClassVar[dict[str, str]] = {
        "partition": "the PipelineModule's partition_method decides the split (DeepSpeed's engine reads it there too)",
        "seed_layers": "the PipelineModule's seed_layers decides (layers are built before the config is read)",
        "pipe_partitioned": "partitions activations over tensor-parallel ranks; dstrain has no tensor parallelism",
        "grad_partitioned": "partitions gradients over tensor-parallel ranks; dstrain has no tensor parallelism",
        "use_reentrant": "dstrain's activation checkpointing is always non-reentrant",
    }

    def __post_init__(self) -> None:
        if self.stages != "auto":
            check_int("pipeline", "stages", self.stages, min_value=1)
        if not isinstance(self.partition, str):
            raise ConfigError("pipeline.partition", f"expected a str, got {type(self.partition).__name__}")
        check_bool("pipeline", "seed_layers", self.seed_layers)
        check_int(
            "pipeline", "activation_checkpoint_interval", self.activation_checkpoint_interval, min_value=0
        )
        check_bool("pipeline", "pipe_partitioned", self.pipe_partitioned)
        check_bool("pipeline", "grad_partitioned", self.grad_partitioned)
        check_bool("pipeline", "use_reentrant", self.use_reentrant)
        check_float("pipeline", "p2p_timeout", self.p2p_timeout, min_value=0.0, strict_min=True)
        if self.transport not in ("auto", "staged", "nccl", "ordered"):
            raise ConfigError(
                "pipeline.transport",
                f"expected 'auto', 'staged', 'nccl' or 'ordered', got {self.transport!r}",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PipelineConfig:
        """Parse the JSON object; unknown keys raise `ConfigError` with a did-you-mean."""
        return build(cls, data or {}, "pipeline")
