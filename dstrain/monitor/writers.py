"""Where monitor events go: TensorBoard event files, CSV files, Weights & Biases.

Each writer takes ``(name, value, step)`` events (DeepSpeed's ``write_events``) and owns its files.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable
from typing import Any, Protocol

from dstrain.errors import ConfigError
from dstrain.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig

__all__ = ["CSVWriter", "Event", "TensorBoardWriter", "WandbWriter", "Writer", "require_wandb"]

Event = tuple[str, float, int]
"""(name, value, step): DeepSpeed's event tuple (step: the global sample count)."""


class Writer(Protocol):
    def write_events(self, events: Iterable[Event]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """``SummaryWriter(output_path/job_name)`` scalars; flushed after every batch of events."""

    def __init__(self, config: TensorBoardConfig) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch imports the tensorboard package lazily
            raise ConfigError(
                "tensorboard.enabled",
                "needs the tensorboard package (pip install 'dsio[tensorboard]' or pip install tensorboard)",
            ) from e
        self.log_dir = os.path.join(config.output_path or "runs", config.job_name)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class CSVWriter:
    """DeepSpeed's csv_monitor layout: ``<dir>/<name with / as _>.csv``, header ``step,<last part of name>``."""

    def __init__(self, config: CSVConfig) -> None:
        self.log_dir = os.path.join(config.output_path or "csv_monitor", config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.log_dir, name.replace("/", "_") + ".csv")

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            path = self.path(name)
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", name.split("/")[-1]])
                w.writerow([step, value])

    def close(self) -> None:
        pass


def require_wandb() -> Any:
    """The ``wandb`` module, or `ConfigError` naming ``wandb.enabled`` when it is not installed."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            "wandb.enabled", "needs the wandb package, which is not installed (pip install wandb)"
        ) from e
    return wandb


class WandbWriter:
    """``wandb.init(project, group, entity=team)``, then ``wandb.log({name: value}, step=step)``."""

    def __init__(self, config: WandbConfig) -> None:
        wandb = require_wandb()
        self._wandb: Any = wandb
        self._run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        self._run.finish()
