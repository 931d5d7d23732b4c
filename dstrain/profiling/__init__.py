"""The flops profiler (DeepSpeed's ``flops_profiler`` section and ``get_model_profile``), over
``torch.utils.flop_counter``; model FLOPs utilisation against a given or measured peak."""

from dstrain.profiling.config import FlopsProfilerConfig
from dstrain.profiling.profiler import (
    FlopsProfiler,
    ModuleProfile,
    get_model_profile,
    number_to_string,
    peak_flops,
)

__all__ = [
    "FlopsProfiler",
    "FlopsProfilerConfig",
    "ModuleProfile",
    "get_model_profile",
    "number_to_string",
    "peak_flops",
]
