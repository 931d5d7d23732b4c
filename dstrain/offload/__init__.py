"""ZeRO-Infinity offload: optimizer state and (stage 3) parameters on CPU or NVMe through dsio.

- `config`: DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections and the pinned budget.
- `swapper`: slots of one swap file <-> a bounded pinned pool, through one dsio handle on dsio's
  shared loop thread.
- `optimizer`: `OffloadAdam`, the stepper that reads ahead, steps and writes behind per sub-group.
"""

from dstrain.offload.config import OffloadOptimizerConfig, OffloadParamConfig, parse_offload
from dstrain.offload.optimizer import OffloadAdam, OffloadOptimizerStatistics
from dstrain.offload.swapper import Swapper, SwapperStatistics

__all__ = [
    "OffloadAdam",
    "OffloadOptimizerConfig",
    "OffloadOptimizerStatistics",
    "OffloadParamConfig",
    "Swapper",
    "SwapperStatistics",
    "parse_offload",
]
