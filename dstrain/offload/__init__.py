"""ZeRO-Infinity offload: optimizer state and (stage 3) parameters on CPU or NVMe through dsio.

Three sub-rooms and the files that plug them in:

- `swap/`: the mechanism: slots of one swap file <-> a bounded pinned pool, through one dsio handle
  on dsio's shared loop thread (`Swapper`, `SlotTable`, `Lease`);
- `optimizer/`: `OffloadAdam`, the stepper that reads ahead, steps and writes behind per sub-group
  (sub-groups, state reads, early stepping, checkpoint state);
- `param/`: stage-3 parameter shards, the fp32 master and gradients in files (`OffloadedShards`);
- `config`: DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections and the pinned budget;
- `compose`: what `initialize` calls to build the sub-rooms; `metrics`: the Prometheus series.
"""

from dstrain.offload.config import OffloadOptimizerConfig, OffloadParamConfig, parse_offload
from dstrain.offload.optimizer import OffloadAdam, OffloadOptimizerStatistics
from dstrain.offload.swap import Swapper, SwapperStatistics

__all__ = [
    "OffloadAdam",
    "OffloadOptimizerConfig",
    "OffloadOptimizerStatistics",
    "OffloadParamConfig",
    "Swapper",
    "SwapperStatistics",
    "parse_offload",
]
