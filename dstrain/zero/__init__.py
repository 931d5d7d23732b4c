"""ZeRO stages over torch.distributed: `DataParallelZero` (stages 0-2) and `Stage3Zero` (stage 3);
``zero.Init`` / `GatheredParameters` / `register_external_parameter` (DeepSpeed's names) build
models partitioned from the start (`dstrain.zero.init`)."""

from dstrain.zero.base import ZeroStatistics, ZeroStrategy
from dstrain.zero.dp import DataParallelZero
from dstrain.zero.init import GatheredParameters, Init, InitStatistics, register_external_parameter
from dstrain.zero.stage3 import Stage3Zero

__all__ = [
    "DataParallelZero",
    "GatheredParameters",
    "Init",
    "InitStatistics",
    "Stage3Zero",
    "ZeroStatistics",
    "ZeroStrategy",
    "register_external_parameter",
]
