"""Every process group dstrain creates, made in one place so that each gets the collective timeout.

``dstrain.init_distributed(timeout=...)`` sets the default group's timeout (DeepSpeed's argument);
the config's ``dist_timeout`` (seconds) sets that of every group `new_group` makes afterwards: the
topology's (dp, pp, ep, edp), the pipeline's direction groups, the checkpoints' gloo group. Without
either, torch's default.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["collective_timeout", "current_timeout", "new_group", "set_timeout"]

_timeout: datetime.timedelta | None = None


def collective_timeout(value: datetime.timedelta | float) -> datetime.timedelta:
    """``value`` (a ``timedelta`` or seconds) as a positive ``timedelta``."""
    t = value if isinstance(value, datetime.timedelta) else datetime.timedelta(seconds=float(value))
    if t.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value!r}")
    return t


def set_timeout(value: datetime.timedelta | float | None) -> None:
    """The timeout of the groups made from now on (None: torch's default)."""
    global _timeout
    _timeout = None if value is None else collective_timeout(value)


def current_timeout() -> datetime.timedelta | None:
    return _timeout


def new_group(ranks: Sequence[int] | None = None, *, backend: str | None = None) -> Any:
    """``torch.distributed.new_group`` (collective over the world) with the collective timeout."""
    kwargs: dict[str, Any] = {"backend": backend}
    if _timeout is not None:
        kwargs["timeout"] = _timeout
    return dist.new_group(list(ranks) if ranks is not None else None, **kwargs)
