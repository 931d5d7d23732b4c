"""The ``tensorboard``, ``csv_monitor`` and ``wandb`` sections of a DeepSpeed config (DeepSpeed's keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dstrain._parse import Section, build, check_bool
from dstrain.errors import ConfigError

__all__ = ["CSVConfig", "TensorBoardConfig", "WandbConfig"]


def _check_str(prefix: str, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ConfigError(f"{prefix}.{name}", f"expected a string, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorBoardConfig(Section):
    """``"tensorboard"``: scalars through ``torch.utils.tensorboard`` (the ``tensorboard`` package)."""

    enabled: bool = False
    output_path: str = ""
    """Event files go to ``output_path/job_name`` (``runs/job_name`` when empty)."""
    job_name: str = "DeepSpeedJobName"

    def __post_init__(self) -> None:
        check_bool("tensorboard", "enabled", self.enabled)
        _check_str("tensorboard", "output_path", self.output_path)
        _check_str("tensorboard", "job_name", self.job_name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> TensorBoardConfig:
        return build(cls, data or {}, "tensorboard")


@dataclass(frozen=True, kw_only=True, slots=True)
class CSVConfig(Section):
    """``"csv_monitor"``: one CSV file per event (``step,<name>`` rows), written by dstrain."""

    enabled: bool = False
    output_path: str = ""
    """Files go to ``output_path/job_name/`` (``csv_monitor/job_name/`` when empty)."""
    job_name: str = "DeepSpeedJobName"

    def __post_init__(self) -> None:
        check_bool("csv_monitor", "enabled", self.enabled)
        _check_str("csv_monitor", "output_path", self.output_path)
        _check_str("csv_monitor", "job_name", self.job_name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CSVConfig:
        return build(cls, data or {}, "csv_monitor")


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig(Section):
    """``"wandb"``: the same events to Weights & Biases (needs the ``wandb`` package)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    """The W&B entity."""
    project: str = "deepspeed"

    def __post_init__(self) -> None:
        check_bool("wandb", "enabled", self.enabled)
        _check_str("wandb", "group", self.group, optional=True)
        _check_str("wandb", "team", self.team, optional=True)
        _check_str("wandb", "project", self.project)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> WandbConfig:
        return build(cls, data or {}, "wandb")
