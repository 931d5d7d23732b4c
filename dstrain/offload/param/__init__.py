"""The parameter side of offload (stage 3, ``offload_param``): shards, master and gradients in files.

- `shards`: `OffloadedShards`, the `ShardStore` Stage3Zero is built with;
- `swapped_master`: `SwappedMaster`, the fp32 master in files, for `OffloadAdam`;
- `master_file`: `MasterFile` (bf16/fp16 shards: the fp32 master's own file) and `ShardStream`;
- `grads`: `OffloadedGrads`, gradient shards on NVMe when the budget cannot hold them;
- `read_ahead`: `TraceReadAhead`, shard reads along the last pass's gather order.
"""

from dstrain.offload.param.grads import OffloadedGrads
from dstrain.offload.param.shards import OffloadedShards, ParamStoreStatistics

__all__ = ["OffloadedGrads", "OffloadedShards", "ParamStoreStatistics"]
