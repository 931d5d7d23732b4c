"""The ``"flops_profiler"`` section of a DeepSpeed config, parsed by the room that honours it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from dstrain._parse import Section, Unbuilt, build, check_bool, check_float, check_int
from dstrain.errors import ConfigError

__all__ = ["FlopsProfilerConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FlopsProfilerConfig(Section):
    """``"flops_profiler"``: count one training step's FLOPs, print the per-module profile, keep MFU."""

    enabled: bool = False
    profile_step: int = 1
    """The optimizer step (1-based) whose forward, backward and update are counted."""
    module_depth: int = -1
    """Depth of the module tree printed (-1: all)."""
    top_modules: int = 1
    """Modules listed per depth in the aggregated view, by FLOPs."""
    detailed: bool = True
    """Print the per-module tree (else only the totals and the aggregated view)."""
    output_file: str | None = None
    """Write the profile to this file instead of the log."""
    peak_tflops: float | None = None
    """dstrain: the peak TFLOP/s MFU is measured against; None: measured by a matmul probe on the
    model's device and dtype at the profile step."""

    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "recompute_fwd_factor": Unbuilt(
            why="adds estimated recompute FLOPs; dstrain counts what ran, recomputes included", default=0
        ),
    }

    def __post_init__(self) -> None:
        p = "flops_profiler"
        check_bool(p, "enabled", self.enabled)
        check_int(p, "profile_step", self.profile_step, min_value=1)
        check_int(p, "module_depth", self.module_depth, min_value=-1)
        check_int(p, "top_modules", self.top_modules, min_value=1)
        check_bool(p, "detailed", self.detailed)
        if self.output_file is not None and not isinstance(self.output_file, str):
            raise ConfigError(f"{p}.output_file", f"expected a path or null, got {self.output_file!r}")
        if self.peak_tflops is not None:
            check_float(p, "peak_tflops", self.peak_tflops, min_value=0.0, strict_min=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FlopsProfilerConfig:
        return build(cls, data or {}, "flops_profiler")
