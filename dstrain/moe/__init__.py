"""Mixture of experts with DeepSpeed's API: gating (top-1/2/k, capacity, aux loss), expert parallelism
over all-to-all on the expert group, experts in their own parameter groups."""

from dstrain.moe.dispatch import ExchangeStatistics
from dstrain.moe.errors import (
    ExchangeMismatchError,
    ExpertGroupError,
    ExpertLayoutError,
    MoEConfigError,
    MoEError,
)
from dstrain.moe.experts import is_moe_param
from dstrain.moe.gate import GateOutput, TopKGate
from dstrain.moe.layer import (
    MoE,
    MoEStatistics,
    moe_layers,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = [
    "ExchangeMismatchError",
    "ExchangeStatistics",
    "ExpertGroupError",
    "ExpertLayoutError",
    "GateOutput",
    "MoE",
    "MoEConfigError",
    "MoEError",
    "MoEStatistics",
    "TopKGate",
    "is_moe_param",
    "moe_layers",
    "split_params_into_different_moe_groups_for_optimizer",
]
