"""Building the torch optimizer that steps the fp32 master tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dstrain.config_sections import OptimizerConfig

__all__ = ["build_optimizer"]

ClientOptimizer = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def build_optimizer(
    param_groups: list[dict[str, Any]],
    config: OptimizerConfig | None,
    client: ClientOptimizer | None = None,
) -> torch.optim.Optimizer:
    """An optimizer over ``param_groups`` (the ZeRO strategy's master tensors).

    From ``config`` (DeepSpeed semantics: ``Adam`` is AdamW unless ``adam_w_mode`` is false, weight
    decay defaults to 0), or from a client optimizer: an instance is rebuilt with its class and defaults
    on the master tensors (its state must be empty), a callable is called with the groups.
    """
    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            if client.state:
                raise ValueError("pass a fresh optimizer: its state cannot follow the parameters into ZeRO")
            return type(client)(param_groups, **client.defaults)
        return client(param_groups)
    if config is None:
        raise ValueError('no optimizer: set "optimizer" in the config or pass optimizer= to initialize')
    params = dict(config.params)
    params.pop("torch_adam", None)
    params.setdefault("weight_decay", 0.0)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    name = config.name
    if name == "Adam":
        cls = torch.optim.AdamW if params.pop("adam_w_mode", True) else torch.optim.Adam
        return cls(param_groups, **params)
    if name == "AdamW":
        return torch.optim.AdamW(param_groups, **params)
    return torch.optim.SGD(param_groups, **params)
