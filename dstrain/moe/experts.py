"""The experts one rank holds: ``num_local`` copies of the user's expert module, as their own parameters."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["Experts", "is_moe_param", "mark_expert_params"]


def mark_expert_params(params: Iterable[nn.Parameter], group_name: str) -> None:
    """Tag expert parameters the way DeepSpeed does (``allreduce = False``, ``group_name``), so
    `is_moe_param` and DeepSpeed's own ``split_params_into_different_moe_groups_for_optimizer`` find them."""
    for p in params:
        p.allreduce = False  # type: ignore[attr-defined]
        p.group_name = group_name  # type: ignore[attr-defined]


def is_moe_param(param: Tensor) -> bool:
    """True for a parameter of an MoE layer's experts (reduced over the expert-data-parallel group)."""
    return hasattr(param, "allreduce") and not param.allreduce


class Experts(nn.Module):
    """``num_local`` deep copies of ``expert`` (DeepSpeed: ``deepspeed_experts``, same names in state_dict).

    Local expert ``i`` on expert-parallel rank ``r`` is global expert ``r * num_local + i``.
    """

    def __init__(self, expert: nn.Module, num_local: int, group_name: str) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local)])
        self.num_local_experts = num_local
        mark_expert_params(self.deepspeed_experts.parameters(), group_name)

    def forward(self, x: Tensor) -> Tensor:
        """(ep, num_local, C, M) buffers -> the same shape; expert ``i`` sees ``x[:, i]`` from every rank."""
        outs = []
        for i, expert in enumerate(self.deepspeed_experts):
            y = expert(x[:, i])  # (ep, C, M)
            if isinstance(y, tuple):
                y = y[0]  # (output, bias) experts: the bias is ignored, as in DeepSpeed
            outs.append(y)
        return torch.stack(outs, dim=1)
