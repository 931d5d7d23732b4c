"""Building the torch optimizer that steps the fp32 master tensors.

Two sources: the config's ``"optimizer"`` section, or a client optimizer passed to `initialize`
(``optimizer=``). A client *instance* keeps what the user gave it: its param groups with every
per-group option (lr, weight decay, betas, ...) become ZeRO's groups (`client_param_groups`), and
the optimizer is rebuilt with its class and its constructor's arguments over the master tensors
(`rebuild_client`). A client *callable* is called with ZeRO's groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dstrain.config_sections import OptimizerConfig
from dstrain.errors import ConfigError, UnsupportedOptimizerError

if TYPE_CHECKING:
    from dstrain.zero.base import ZeroStrategy

__all__ = [
    "ClientOptimizer",
    "build_optimizer",
    "client_param_groups",
    "group_options",
    "rebuild_client",
    "repoint_client",
    "stepped_groups",
]

ClientOptimizer = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


_NEEDS_CLOSURE = (torch.optim.LBFGS,)  # step(closure) re-evaluates the loss: not a ZeRO step


def _stepped(state: dict[str, Any]) -> bool:
    """Whether a parameter's optimizer state comes from a step (Adagrad's constructor sets up a zero
    ``step`` and its accumulator; state without a ``step`` count, like SGD's momentum, is from a step)."""
    step = state.get("step")
    return step is None or float(step) != 0.0


def group_options(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's options (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}


def client_param_groups(client: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The client's param groups, each with all its options, as `initialize`'s model_parameters.

    Refuses, naming the reason, what cannot follow the parameters into ZeRO's master tensors.
    """
    name = type(client).__name__
    if isinstance(client, _NEEDS_CLOSURE):
        raise UnsupportedOptimizerError(
            f"optimizer={name}: its step re-evaluates the loss through a closure; dstrain steps "
            "once per accumulation boundary without one"
        )
    if any(_stepped(state) for state in client.state.values()):
        raise UnsupportedOptimizerError(
            f"optimizer={name} already holds state: pass a fresh optimizer (its state cannot follow the "
            "parameters into ZeRO's master tensors)"
        )
    return [dict(g, params=list(g["params"])) for g in client.param_groups]


def _constructor_arguments(client: torch.optim.Optimizer) -> dict[str, Any]:
    """The client's ``defaults`` that its class's constructor takes.

    torch keeps some derived options in ``defaults`` that the constructor does not accept (AdamW's
    ``decoupled_weight_decay`` in torch >= 2.6, implied by the class); the groups carry them anyway.
    """
    cls = type(client)
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(client.defaults)
    return {k: v for k, v in client.defaults.items() if k in parameters}


def rebuild_client(
    client: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """``type(client)`` over ``param_groups`` (ZeRO's master groups, which carry the client groups'
    options), built with the client's constructor arguments."""
    try:
        return type(client)(param_groups, **_constructor_arguments(client))
    except (TypeError, ValueError) as e:
        raise UnsupportedOptimizerError(
            f"optimizer={type(client).__name__} cannot be rebuilt over the master tensors from its "
            f"defaults ({e}); pass a callable optimizer=lambda groups: ... instead"
        ) from e


def repoint_client(
    client: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """The client optimizer itself, moved onto ``param_groups`` as DeepSpeed's ZeRO does: its groups and
    state are those of `rebuild_client`'s optimizer (so a class that sets up state in its constructor,
    like Adagrad, has it for the master tensors), and an LR scheduler the user bound to it keeps
    driving it."""
    made = rebuild_client(client, param_groups)
    client.param_groups = made.param_groups
    client.state = made.state
    client.defaults = made.defaults
    return client


def stepped_groups(
    zero: ZeroStrategy, config: OptimizerConfig | None, client: ClientOptimizer | None = None
) -> list[dict[str, Any]]:
    """The param groups the config's optimizer steps: ZeRO's, except LAMB over ZeRO stage 0's flat
    masters, which steps per-parameter views of them (its trust ratio is per parameter:
    `dstrain.optim.lamb.per_parameter_groups`)."""
    groups = zero.param_groups()
    if client is None and config is not None and config.name == "Lamb":
        from dstrain.zero.dp import DataParallelZero

        if isinstance(zero, DataParallelZero) and zero.stage == 0:
            from dstrain.optim.lamb import per_parameter_groups

            return per_parameter_groups(zero.groups)
    return groups


def build_optimizer(
    param_groups: list[dict[str, Any]],
    config: OptimizerConfig | None,
    client: ClientOptimizer | None = None,
) -> torch.optim.Optimizer:
    """An optimizer over ``param_groups`` (the ZeRO strategy's master tensors).

    From ``config`` (DeepSpeed semantics: ``Adam`` is AdamW unless ``adam_w_mode`` is false, weight
    decay defaults to 0; torch's fused kernel unless ``fused``/``foreach`` say otherwise), or from a
    client optimizer: an instance is rebuilt with its class and constructor arguments over the master
    groups and takes their place in the client object (`repoint_client`; the groups already carry its
    per-group options), a callable is called
    with the groups.
    """
    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            return repoint_client(client, param_groups)
        return client(param_groups)
    if config is None:
        raise ValueError('no optimizer: set "optimizer" in the config or pass optimizer= to initialize')
    params = dict(config.params)
    params.pop("torch_adam", None)
    params.setdefault("weight_decay", 0.0)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    name = config.name
    if name == "SGD":
        return torch.optim.SGD(param_groups, **params)
    if name == "Lamb":
        from dstrain.optim.lamb import Lamb

        if params.pop("max_grad_norm", 0.0):
            raise ConfigError("optimizer.params.max_grad_norm", "use the top-level gradient_clipping")
        return Lamb(param_groups, **params)
    cls = torch.optim.AdamW if name == "AdamW" or params.pop("adam_w_mode", True) else torch.optim.Adam
    params.pop("adam_w_mode", None)
    if "fused" not in params and "foreach" not in params:
        # torch's fused kernel steps each tensor in one pass: 5.5x faster than the default loop for a
        # 55M-element partition on one CPU thread here (0.063 s vs 0.347 s), same update rule
        try:
            return cls(param_groups, fused=True, **params)
        except (RuntimeError, ValueError, TypeError):  # dtype/device the fused kernel does not take
            pass
    return cls(param_groups, **params)
