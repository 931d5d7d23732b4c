"""1-bit Adam and 0/1 Adam: error-feedback 1-bit compressed communication (a maintained home after
DeepSpeed removed them in 0.17), on torch.distributed collectives: gloo and NCCL, CPU and CUDA tensors."""

from dstrain.onebit.adam import OneBitAdam
from dstrain.onebit.compressed import CompressedAllReduce, CompressedStatistics
from dstrain.onebit.lamb import OneBitLamb
from dstrain.onebit.zeroone import ZeroOneAdam

__all__ = ["CompressedAllReduce", "CompressedStatistics", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
