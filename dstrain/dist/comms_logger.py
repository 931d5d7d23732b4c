"""DeepSpeed's communication logger (the ``comms_logger`` section): every collective's size, latency and bandwidth.

`configure` makes a `CommsLogger` active for the process (``initialize`` does it from the config);
every `dstrain.dist.Comm` then reports each collective it issues: its kind, its message size, its
latency (issue to completion: a blocking call's duration, or until ``wait()`` returns for an
asynchronous one) and the bandwidths nccl-tests define (``algbw = bytes / latency``; ``busbw`` scales it
by the traffic a ring puts on each link: 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for broadcast). The compressed all-reduce of 1-bit / 0-1 Adam reports
as ``compressed_all_reduce`` with the bytes it put on the wire. `log_summary` prints DeepSpeed's table:
per kind and message size, count, total and mean latency, mean algbw and busbw.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dstrain._parse import Section, build, check_bool
from dstrain.errors import ConfigError

__all__ = [
    "OPS",
    "CommsLogger",
    "CommsLoggerConfig",
    "OpSummary",
    "active",
    "configure",
    "log_summary",
    "reset",
]

log = logging.getLogger("dstrain.comms")

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "compressed_all_reduce")
"""Collective kinds dstrain reports (``prof_ops`` names; DeepSpeed's ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` / ``all_to_all_single`` are accepted as aliases)."""

_ALIASES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "inference_all_reduce": "all_reduce",
}

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CommsLoggerConfig(Section):
    """``"comms_logger"``: DeepSpeed's keys and defaults."""

    enabled: bool = False
    """Record every collective (see the module docstring)."""
    verbose: bool = False
    """Also log each collective as it completes (logger ``dstrain.comms``, INFO)."""
    prof_all: bool = True
    """Record every kind; ``false`` records only those in ``prof_ops``."""
    prof_ops: list[str] = field(default_factory=list)
    """Kinds recorded when ``prof_all`` is false (names in `OPS`, DeepSpeed's aliases accepted)."""
    debug: bool = False
    """Key each record by its caller too (``all_reduce | reduce_gradients``), as DeepSpeed's debug does."""

    def __post_init__(self) -> None:
        p = "comms_logger"
        for name in ("enabled", "verbose", "prof_all", "debug"):
            check_bool(p, name, getattr(self, name))
        if not isinstance(self.prof_ops, list | tuple) or not all(isinstance(o, str) for o in self.prof_ops):
            raise ConfigError(f"{p}.prof_ops", f"expected a list of collective names, got {self.prof_ops!r}")
        ops = [_ALIASES.get(o, o) for o in self.prof_ops]
        for o, given in zip(ops, self.prof_ops, strict=True):
            if o not in OPS:
                raise ConfigError(f"{p}.prof_ops", f"unknown collective {given!r}; known: {', '.join(OPS)}")
        object.__setattr__(self, "prof_ops", ops)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CommsLoggerConfig:
        return build(cls, data or {}, "comms_logger")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpSummary:
    """One (kind, message size) line of the summary."""

    op: str
    """The kind (with ``| caller`` under ``debug``)."""
    message_bytes: int
    count: int
    total_seconds: float
    algbw_gbps: float
    """Mean algorithmic bandwidth, GB/s (1e9 bytes)."""
    busbw_gbps: float
    """Mean bus bandwidth, GB/s."""

    @property
    def mean_seconds(self) -> float:
        return self.total_seconds / self.count if self.count else 0.0


class CommsLogger:
    """Records collectives (see the module docstring); one is active per process."""

    def __init__(self, config: CommsLoggerConfig) -> None:
        self.config = config
        self._records: dict[tuple[str, int], list[float]] = {}  # -> [count, seconds, algbw sum, busbw sum]

    def wants(self, op: str) -> bool:
        c = self.config
        return c.enabled and (c.prof_all or op in c.prof_ops)

    def record(self, op: str, nbytes: int, seconds: float, world: int) -> None:
        """One collective of ``nbytes`` (the data it moves: a buffer's size; an all-gather's output)
        that took ``seconds`` over ``world`` ranks."""
        seconds = max(seconds, 1e-9)
        algbw = nbytes / seconds / 1e9
        busbw = algbw * _BUS_FACTOR.get(op, lambda n: 1.0)(world)
        name = f"{op} | {_caller()}" if self.config.debug else op
        rec = self._records.setdefault((name, nbytes), [0, 0.0, 0.0, 0.0])
        rec[0] += 1
        rec[1] += seconds
        rec[2] += algbw
        rec[3] += busbw
        if self.config.verbose:
            log.info(
                "comm op: %s | time (ms): %.3f | msg size: %s | algbw (GB/s): %.3f | busbw (GB/s): %.3f",
                name,
                seconds * 1e3,
                _size(nbytes),
                algbw,
                busbw,
            )

    def summary(self) -> list[OpSummary]:
        """Every (kind, size) recorded, sorted by kind then size."""
        return [
            OpSummary(
                op=name,
                message_bytes=size,
                count=int(r[0]),
                total_seconds=r[1],
                algbw_gbps=r[2] / r[0],
                busbw_gbps=r[3] / r[0],
            )
            for (name, size), r in sorted(self._records.items())
        ]

    def log_summary(self) -> str:
        """DeepSpeed's ``log_summary`` table, logged (INFO) and returned."""
        header = (
            f"{'Comm. Op':<28}{'Message Size':<16}{'Count':<10}{'Total Latency(ms)':<20}"
            f"{'Avg Latency(ms)':<18}{'algbw_avg (GB/s)':<18}{'busbw_avg (GB/s)':<18}"
        )
        lines = [header]
        last = None
        for s in self.summary():
            if s.op != last:
                lines.append(s.op)
                last = s.op
            lines.append(
                f"{'':<28}{_size(s.message_bytes):<16}{s.count:<10}{s.total_seconds * 1e3:<20.2f}"
                f"{s.mean_seconds * 1e3:<18.2f}{s.algbw_gbps:<18.3f}{s.busbw_gbps:<18.3f}"
            )
        text = "\n".join(lines)
        log.info("communication summary\n%s", text)
        return text

    def reset(self) -> None:
        self._records.clear()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _caller() -> str:
    """The first function outside dstrain/dist that led to the collective."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.endswith(("dist/comm.py", "dist/comms_logger.py")):
        f = f.f_back  # type: ignore[assignment]
    return f.f_code.co_name if f is not None else "?"


_ACTIVE: CommsLogger | None = None


def configure(config: CommsLoggerConfig | Mapping[str, Any] | None) -> CommsLogger | None:
    """Make a logger for ``config`` active (None, or ``enabled: false``: none)."""
    global _ACTIVE
    if config is not None and not isinstance(config, CommsLoggerConfig):
        config = CommsLoggerConfig.from_dict(config)
    _ACTIVE = CommsLogger(config) if config is not None and config.enabled else None
    return _ACTIVE


def active(op: str) -> CommsLogger | None:
    """The active logger when it records ``op``, else None (the collectives' one check)."""
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.wants(op) else None


def log_summary() -> str:
    """DeepSpeed's ``deepspeed.comm.log_summary()``: the active logger's table ("" without one)."""
    return _ACTIVE.log_summary() if _ACTIVE is not None else ""


def reset() -> None:
    """Stop logging and forget the records."""
    global _ACTIVE
    _ACTIVE = None
