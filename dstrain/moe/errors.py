"""Exceptions raised by dstrain's mixture-of-experts room, each documented with when it is raised."""

from __future__ import annotations

from dstrain.errors import DstrainError

__all__ = ["ExchangeMismatchError", "ExpertGroupError", "ExpertLayoutError", "MoEConfigError", "MoEError"]


class MoEError(DstrainError):
    """Base class of every exception the MoE layer raises on purpose."""


class MoEConfigError(MoEError, ValueError):
    """An MoE constructor argument is invalid (``field`` names it), e.g. ``num_experts`` not divisible
    by ``ep_size``, ``k`` larger than ``num_experts`` or an unknown ``noisy_gate_policy``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ExpertGroupError(MoEError):
    """The layer has no usable expert-parallel group: ``ep_size > 1`` and no group was bound (neither by
    `dstrain.initialize` nor by `MoE.set_expert_group`), or the bound group's size is not ``ep_size``."""


class ExchangeMismatchError(MoEError):
    """The ranks of one expert group disagree on the shape of an all-to-all exchange (capacity, hidden
    size, dtype, number of experts or token dropping), so the exchange cannot run.

    Raised on every rank of the group at the same point (each rank sees every rank's values), before any
    all-to-all is issued: never a hang. ``values`` maps each group rank to what it proposed.
    """

    def __init__(self, message: str, values: dict[int, dict[str, int]]) -> None:
        super().__init__(message)
        self.values = values


class ExpertLayoutError(MoEError):
    """`Engine.load_checkpoint` was given a checkpoint whose experts are laid out differently (another
    ``num_experts``, ``ep_size`` or expert-parallel rank) from this model's; raised before anything is
    loaded, on every rank whose layout differs."""
