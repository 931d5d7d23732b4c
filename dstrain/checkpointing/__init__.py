"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``), and activation offload.

    import dstrain.checkpointing as ckpt
    y = ckpt.checkpoint(block, x)          # block's inside is recomputed in backward

The config's ``activation_checkpointing`` section (`ActivationCheckpointingConfig`) decides where the
checkpointed inputs wait for backward: on their device, in host memory (``cpu_checkpointing``), or on
NVMe through dsio (``nvme_path``, a dstrain extension).
"""

from dstrain.checkpointing.config import ActivationCheckpointingConfig
from dstrain.checkpointing.function import (
    ActivationCheckpointer,
    ActivationStatistics,
    checkpoint,
    configure,
    is_configured,
    reset,
    statistics,
)
from dstrain.checkpointing.rng import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)

__all__ = [
    "ActivationCheckpointer",
    "ActivationCheckpointingConfig",
    "ActivationStatistics",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "reset",
    "statistics",
]
