"""ZeRO stages over torch.distributed: `DataParallelZero` (stages 0-2) and `Stage3Zero` (stage 3)."""

from dstrain.zero.base import ZeroStatistics, ZeroStrategy
from dstrain.zero.dp import DataParallelZero
from dstrain.zero.stage3 import Stage3Zero

__all__ = ["DataParallelZero", "Stage3Zero", "ZeroStatistics", "ZeroStrategy"]
