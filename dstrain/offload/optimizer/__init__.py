"""The optimizer side of offload: `OffloadAdam` and what it is made of.

- `adam`: `OffloadAdam`, the stepper that reads ahead, steps and writes behind per sub-group;
- `sub_groups`: `SubGroup` and the sub-group plan; `state_reads`: `StateReads`, the reads ahead;
- `swapped_state`: torch's Adam state-dict format over the offloaded state (checkpoints);
- `early_step`: `EarlyStep`, stepping sub-groups during the boundary backward;
- `step_thread`: `StepThread`, those steps run on a thread of their own, beside backward;
- `device_stager`: `DeviceStager`, state to the master's device and back; `statistics`.
"""

from dstrain.offload.optimizer.adam import OffloadAdam
from dstrain.offload.optimizer.statistics import OffloadOptimizerStatistics
from dstrain.offload.optimizer.sub_groups import CUT, plan_sub_groups

__all__ = ["CUT", "OffloadAdam", "OffloadOptimizerStatistics", "plan_sub_groups"]
