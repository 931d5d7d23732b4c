"""Monitors: DeepSpeed's ``tensorboard``, ``csv_monitor`` and ``wandb`` sections, written after each step.

The Prometheus side of the same training series (loss, lr, grad norm, loss scale, tokens/s, MFU) is
``dstrain.metrics`` (read from `Engine.statistics` at scrape time).
"""

from dstrain.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
from dstrain.monitor.monitor import Monitor
from dstrain.monitor.writers import CSVWriter, TensorBoardWriter, WandbWriter

__all__ = [
    "CSVConfig",
    "CSVWriter",
    "Monitor",
    "TensorBoardConfig",
    "TensorBoardWriter",
    "WandbConfig",
    "WandbWriter",
]
