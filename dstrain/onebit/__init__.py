"""1-bit Adam: error-feedback 1-bit compressed momentum averaging (a maintained home after DeepSpeed
removed it in 0.17), on torch.distributed collectives: gloo and NCCL, CPU and CUDA tensors."""

from dstrain.onebit.adam import OneBitAdam
from dstrain.onebit.compressed import CompressedAllReduce, CompressedStatistics

__all__ = ["CompressedAllReduce", "CompressedStatistics", "OneBitAdam"]
