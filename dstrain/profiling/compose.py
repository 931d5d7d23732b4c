"""How `dstrain.initialize` plugs the flops profiler in: a `StepProfiler` observer when enabled."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from dstrain.profiling.config import FlopsProfilerConfig
from dstrain.profiling.profiler import FlopsProfiler, peak_flops

if TYPE_CHECKING:
    from dstrain.config import DSConfig
    from dstrain.engine import Engine

__all__ = ["StepProfiler", "applies", "build"]

log = logging.getLogger("dstrain.profiling")


class StepProfiler:
    """Counts optimizer step ``profile_step`` (its forwards, backwards and update), then sets the engine's
    ``model_flops_per_step`` and ``peak_flops`` (so `Engine.statistics` has MFU from then on) and prints
    the profile (rank 0; to ``output_file`` when given). A `dstrain.engine.StepObserver`."""

    def __init__(self, config: FlopsProfilerConfig, model: nn.Module, rank: int) -> None:
        self.config = config
        self.profiler = FlopsProfiler(model)
        self.model = model
        self.rank = rank
        self.text = ""
        """The printed profile (after the profile step)."""
        if config.profile_step == 1:
            self.profiler.start_profile()

    def after_step(self, engine: Engine) -> None:
        c = self.config
        if engine.global_steps == c.profile_step - 1:
            self.profiler.start_profile()
        elif engine.global_steps == c.profile_step and self.profiler.started:
            self.profiler.stop_profile()
            flops = int(self.profiler.get_total_flops())
            p = next(iter(self.model.parameters()), None)
            if c.peak_tflops is not None:
                peak = c.peak_tflops * 1e12
            elif p is not None:
                peak = peak_flops(p.device, p.dtype)
            else:
                peak = peak_flops()
            engine.model_flops_per_step = float(flops)
            engine.peak_flops = peak
            self.text = self.profiler.print_model_profile(
                profile_step=c.profile_step,
                module_depth=c.module_depth,
                top_modules=c.top_modules,
                detailed=c.detailed,
                output_file=c.output_file if self.rank == 0 else None,
                peak_flops_per_s=peak,
                step_seconds=self.profiler.get_total_duration(),  # type: ignore[arg-type]
            )
            if self.rank == 0 and not c.output_file:
                log.info("flops profile\n%s", self.text)

    def close(self) -> None:
        self.profiler.stop_profile()


def applies(config: DSConfig, model: Any = None) -> bool:
    """The ``flops_profiler`` section is enabled."""
    return config.flops_profiler is not None and config.flops_profiler.enabled


def build(config: DSConfig, model: nn.Module, rank: int) -> StepProfiler:
    """The step profiler of the enabled ``flops_profiler`` section (where `applies`)."""
    c = config.flops_profiler
    if c is None or not c.enabled:
        raise ValueError("flops_profiler is not enabled (see applies)")
    return StepProfiler(c, model, rank)
