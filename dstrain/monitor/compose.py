"""How `dstrain.initialize` plugs the monitors in: one `Monitor` over the enabled writers, on rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstrain.monitor.monitor import Monitor
from dstrain.monitor.writers import CSVWriter, TensorBoardWriter, WandbWriter, Writer, require_wandb

if TYPE_CHECKING:
    from dstrain.config import DSConfig

__all__ = ["applies", "build"]


def applies(config: DSConfig, model: Any = None) -> bool:
    """A monitor section (``tensorboard``, ``csv_monitor``, ``wandb``) is enabled."""
    return any(s is not None and s.enabled for s in (config.tensorboard, config.csv_monitor, config.wandb))


def build(config: DSConfig, rank: int) -> Monitor | None:
    """The monitor of the enabled sections, where `applies`: on rank 0 (None on the other ranks, as in
    DeepSpeed). A writer whose package is missing raises `ConfigError` naming its ``enabled`` key on
    every rank."""
    writers: list[Writer] = []
    tb, csv_, wb = config.tensorboard, config.csv_monitor, config.wandb
    if wb is not None and wb.enabled:
        require_wandb()  # refused on every rank, not only where it would write
    if rank != 0:
        return None
    if tb is not None and tb.enabled:
        writers.append(TensorBoardWriter(tb))
    if csv_ is not None and csv_.enabled:
        writers.append(CSVWriter(csv_))
    if wb is not None and wb.enabled:
        writers.append(WandbWriter(wb))
    return Monitor(writers) if writers else None
