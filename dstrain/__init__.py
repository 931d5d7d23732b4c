"""dstrain: DeepSpeed-style training on torch.distributed — JSON config, mixed precision, ZeRO 1-3.

Move a DeepSpeed script over by replacing ``import deepspeed`` with ``import dstrain``.
"""

from dstrain.checkpoint import CheckpointStore, DsioStore, TorchSaveStore
from dstrain.config import (
    AioConfig,
    BF16Config,
    CheckpointConfig,
    DSConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from dstrain.dist.comm import CommStatistics
from dstrain.engine import Engine, EngineStatistics
from dstrain.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointRankError,
    ConfigError,
    DstrainError,
    NotImplementedConfigError,
    ReshapeError,
)
from dstrain.initialize import init_distributed, initialize
from dstrain.precision import LossScaler, LossScalerStatistics
from dstrain.scheduler import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from dstrain.zero import ZeroStatistics

__all__ = [
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointRankError",
    "CheckpointStore",
    "CommStatistics",
    "ConfigError",
    "DSConfig",
    "DsioStore",
    "DstrainError",
    "Engine",
    "EngineStatistics",
    "FP16Config",
    "LRRangeTest",
    "LossScaler",
    "LossScalerStatistics",
    "NotImplementedConfigError",
    "OneCycle",
    "OptimizerConfig",
    "ReshapeError",
    "SchedulerConfig",
    "TorchSaveStore",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroStatistics",
    "init_distributed",
    "initialize",
]
