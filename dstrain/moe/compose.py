"""How the MoE room plugs into `dstrain.initialize` and the engine's checkpoints.

- `applies`: the model holds expert parameters (its MoE layers', or any marked DeepSpeed's way); then
  initialize binds the layers' groups and splits the param groups (the topology's ``ep`` comes from
  `expert_parallel_size`, 1 without MoE layers, and the expert-layout part is recorded for every model:
  a dense model's empty layout is what refuses an MoE checkpoint).
- `expert_parallel_size`: the topology's ``ep`` from the model's MoE layers (one size for all of them).
- `bind_expert_groups`: give every MoE layer the topology's expert-parallel group.
- `split_expert_groups`: expert parameters in param groups of their own (``"moe": True``), whether or not
  the caller split them with `split_params_into_different_moe_groups_for_optimizer`.
- `expert_routes`: those groups reduce over the expert-data-parallel group (ZeRO 1-2 partitions their
  optimizer state over it too); the ZeRO strategy scales them by 1/dp like every other gradient, since an
  expert has seen the tokens of all dp ranks through the all-to-all. Their squared gradient norms add up
  over the expert-parallel group (each ep rank holds different experts).
- `expert_layout` / `check_expert_layout`: what a checkpoint records about the experts, and the clear
  error when it is loaded into a model whose experts are laid out differently (another ``ep_size``);
  `ExpertLayoutPart` is that record as a checkpoint part (``dstrain.checkpoint.state.Part``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from dstrain.moe.errors import ExpertLayoutError, MoEConfigError
from dstrain.moe.experts import is_moe_param
from dstrain.moe.layer import moe_layers

if TYPE_CHECKING:
    from dstrain.config import DSConfig

__all__ = [
    "ExpertLayoutPart",
    "applies",
    "bind_expert_groups",
    "check_expert_layout",
    "expert_layout",
    "expert_parallel_size",
    "expert_routes",
    "split_expert_groups",
]


def applies(config: DSConfig | None, model: nn.Module) -> bool:
    """The model holds expert parameters (`is_moe_param`): an MoE layer's, or any parameter tagged the
    way DeepSpeed tags them. The config has no MoE section: the layers carry their settings."""
    return any(is_moe_param(p) for p in model.parameters())


def expert_parallel_size(model: nn.Module) -> int:
    """The ``ep_size`` shared by every MoE layer of ``model`` (1 without MoE layers)."""
    sizes = {layer.ep_size for layer in moe_layers(model)}
    if len(sizes) > 1:
        raise MoEConfigError(
            "ep_size",
            f"the MoE layers use different ep_size values {sorted(sizes)}: dstrain needs one per model",
        )
    return sizes.pop() if sizes else 1


def bind_expert_groups(model: nn.Module, topology: Any) -> None:
    """Bind ``topology.ep`` (a `Comm`) as the expert-parallel group of every MoE layer."""
    for layer in moe_layers(model):
        layer.set_expert_group(topology.ep)


def split_expert_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group split into its dense parameters and its expert parameters (same options, the
    expert part marked ``"moe": True``); groups already of one kind are kept as they are."""
    out: list[dict[str, Any]] = []
    for g in groups:
        experts = [p for p in g["params"] if is_moe_param(p)]
        dense = [p for p in g["params"] if not is_moe_param(p)]
        if g.get("moe") and dense:
            raise MoEConfigError("model_parameters", "a param group marked 'moe' holds non-expert parameters")
        if experts and dense:
            out.append(dict(g, params=dense))
            out.append(dict(g, params=experts, moe=True))
        elif experts:
            out.append(dict(g, moe=True))
        else:
            out.append(g)
    return out


def is_expert_group(group: dict[str, Any]) -> bool:
    return bool(group.get("moe")) and all(is_moe_param(p) for p in group["params"])


def expert_routes(groups: list[dict[str, Any]], routes: list[Any], topology: Any) -> list[Any]:
    """``routes`` with every expert group's route moved to the expert-data-parallel group."""
    from dstrain.zero.reduce import Route  # the seam this room plugs into

    return [
        Route(r.reducer, topology.edp, expert_comm=topology.ep) if is_expert_group(g) else r
        for g, r in zip(groups, routes, strict=True)
    ]


def expert_layout(model: nn.Module) -> list[dict[str, int]]:
    """Per MoE layer (in module order): experts, ep_size and this rank's ep_rank."""
    return [
        {"num_experts": m.num_experts, "ep_size": m.ep_size, "ep_rank": m.ep_rank} for m in moe_layers(model)
    ]


def check_expert_layout(saved: list[dict[str, int]] | None, model: nn.Module, where: str) -> None:
    """Raise `ExpertLayoutError` unless ``model``'s experts are laid out as in the checkpoint ``where``."""
    mine = expert_layout(model)
    if saved is None:
        saved = []
    if saved != mine:
        raise ExpertLayoutError(
            f"{where} holds experts laid out as {saved} (per MoE layer: experts, ep_size, ep_rank of this rank) "
            f"but this model has {mine}; resuming needs the same num_experts, ep_size and world size "
            "(dstrain does not reshard experts across a different ep_size)"
        )


class ExpertLayoutPart:
    """The experts' layout as a checkpoint part (key ``"moe"``): saved with every checkpoint, checked
    on load (`check_expert_layout`) before the other parts are applied."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> list[dict[str, int]]:
        return expert_layout(self.model)

    def load_state_dict(self, state: list[dict[str, int]] | None) -> None:
        check_expert_layout(state, self.model, "the checkpoint")

    def pins_shape(self) -> bool:
        """Experts are laid out over the expert-parallel group: not resharded to another world size."""
        return bool(expert_layout(self.model))
