"""The ``"activation_checkpointing"`` section of a DeepSpeed config, parsed by the room that honours it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from dstrain._parse import Section, Unbuilt, build, check_bool, check_int
from dstrain.errors import ConfigError

__all__ = ["ActivationCheckpointingConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig(Section):
    """``"activation_checkpointing"``: how `dstrain.checkpointing.checkpoint` keeps what it saves.

    A checkpointed function keeps only its inputs during forward and recomputes its inside in
    backward. Where those inputs wait for backward: on their own device (default), in host memory
    (``cpu_checkpointing``; pinned where CUDA is), or (dstrain) in a file on NVMe through dsio
    (``nvme_path``), written during forward and read back ahead of backward in reverse order, so at
    most ``nvme_window`` checkpoints' inputs are in (pinned) host memory at once.
    """

    number_checkpoints: int | None = None
    """DeepSpeed: the size of the contiguous buffer (used only with ``contiguous_memory_optimization``,
    as in DeepSpeed); validated, otherwise without effect. ``partition_activations`` and
    ``contiguous_memory_optimization`` are accepted when false and refused when true
    (`NotImplementedConfigError`: dstrain has no tensor parallelism)."""
    cpu_checkpointing: bool = False
    """Keep checkpointed inputs in host memory until backward (pinned when CUDA is available)."""
    synchronize_checkpoint_boundary: bool = False
    """``torch.cuda.synchronize()`` before and after each checkpointed forward and recompute (CUDA only;
    nothing to synchronize on CPU)."""
    profile: bool = False
    """Time each checkpointed forward and recompute (synchronizing CUDA around them) into
    `ActivationStatistics` and log the totals at `dstrain.checkpointing.reset`."""
    nvme_path: str | None = None
    """dstrain: keep checkpointed inputs in a swap file under this (existing) directory, written through
    dsio during forward and read back ahead of backward; overrides ``cpu_checkpointing``."""
    nvme_window: int = 2
    """dstrain: pinned host buffers of the NVMe path (one checkpoint's inputs each): bounds the host
    memory to ``nvme_window x nvme_buffer_bytes`` and how far backward reads ahead (window - 1)."""
    nvme_buffer_bytes: int | None = None
    """dstrain: bytes of one NVMe buffer (the largest checkpoint's inputs must fit); None: the first
    checkpoint's input bytes, rounded up to 4 KiB pages."""

    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "partition_activations": Unbuilt(
            why="shards checkpointed inputs over tensor-parallel ranks; dstrain has no tensor parallelism",
            default=False,
        ),
        "contiguous_memory_optimization": Unbuilt(
            why="copies partitioned inputs into one buffer; DeepSpeed allows it with partition_activations only",
            default=False,
        ),
    }
    _NO_EFFECT: ClassVar[dict[str, str]] = {
        "number_checkpoints": "sizes DeepSpeed's contiguous buffer, used only with contiguous_memory_optimization",
    }

    def __post_init__(self) -> None:
        p = "activation_checkpointing"
        for name in ("cpu_checkpointing", "synchronize_checkpoint_boundary", "profile"):
            check_bool(p, name, getattr(self, name))
        if self.number_checkpoints is not None:
            check_int(p, "number_checkpoints", self.number_checkpoints, min_value=1)
        if self.nvme_path is not None and not isinstance(self.nvme_path, str):
            raise ConfigError(f"{p}.nvme_path", f"expected a directory path or null, got {self.nvme_path!r}")
        check_int(p, "nvme_window", self.nvme_window, min_value=1)
        if self.nvme_buffer_bytes is not None:
            check_int(p, "nvme_buffer_bytes", self.nvme_buffer_bytes, min_value=1)

    @property
    def placement(self) -> str:
        """Where checkpointed inputs wait for backward: ``"device"``, ``"host"`` or ``"nvme"``."""
        return "nvme" if self.nvme_path is not None else "host" if self.cpu_checkpointing else "device"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ActivationCheckpointingConfig:
        """Parse the JSON object; unknown keys raise `ConfigError` with a did-you-mean."""
        return build(cls, data or {}, "activation_checkpointing")
