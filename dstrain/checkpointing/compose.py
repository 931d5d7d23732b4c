"""How `dstrain.initialize` plugs activation checkpointing in: configure it from the config's section."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstrain.checkpointing.function import ActivationCheckpointer, configure

if TYPE_CHECKING:
    from dstrain.config import DSConfig

__all__ = ["applies", "build"]


def applies(config: DSConfig, model: Any = None) -> bool:
    """The config has an ``activation_checkpointing`` section."""
    return config.activation_checkpointing is not None


def build(config: DSConfig) -> ActivationCheckpointer:
    """`configure` with the section (its NVMe path swaps through the config's ``aio`` settings)."""
    return configure(deepspeed_config=config.activation_checkpointing, io_config=config.aio)
