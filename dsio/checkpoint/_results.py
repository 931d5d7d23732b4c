"""What a ``Checkpointer`` reports: the result of one committed save and its counters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CheckpointStatistics", "SaveResult", "snapshot"]


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What ``await task`` returns for a committed save."""

    step: int
    path: str
    """The committed step directory."""
    bytes: int
    """Bytes this rank wrote."""
    blocked_seconds: float
    """Time ``save()`` held the caller: waiting for the previous save, then staging."""
    write_seconds: float
    """From the end of staging to the durable commit."""


@dataclass(frozen=True, slots=True)
class CheckpointStatistics:
    """Counters of one ``Checkpointer`` (this rank). Throughput counts this rank's bytes."""

    saves: int
    """Saves committed."""
    failed_saves: int
    loads: int
    in_flight: bool
    """A save is being written right now."""
    last_step: int | None
    """Step of the last committed save."""
    last_wait_seconds: float
    """How long the last ``save()`` waited for the save before it (one save in flight at a time)."""
    last_staging_seconds: float
    """How long the last ``save()`` copied tensors into pinned memory."""
    last_blocked_seconds: float
    """What the last ``save()`` blocked training for: wait + staging."""
    last_write_seconds: float
    """From the end of staging to the durable commit of the last save."""
    last_bytes: int
    last_throughput_bytes_per_s: float
    """last_bytes / (staging + write) of the last committed save."""
    blocked_seconds_total: float
    staging_seconds_total: float
    write_seconds_total: float
    bytes_written_total: int
    load_seconds_total: float
    bytes_read_total: int
    staging_buffer_bytes: int
    """Size of the pinned staging region kept between saves."""
    last_stream_buffer_bytes: int = 0
    """Window memory of the last save when it streamed lazy sources (0 when it was staged whole)."""


def snapshot(
    saves: int,
    failed: int,
    loads: int,
    in_flight: bool,
    last: Mapping[str, Any],
    tot: Mapping[str, Any],
    staging_bytes: int,
) -> CheckpointStatistics:
    """A Checkpointer's counters (``last``: the last save's, ``tot``: the totals) as a snapshot."""
    return CheckpointStatistics(
        saves=saves,
        failed_saves=failed,
        loads=loads,
        in_flight=in_flight,
        last_step=last["step"],
        last_wait_seconds=last["wait"],
        last_staging_seconds=last["stage"],
        last_blocked_seconds=last["blocked"],
        last_write_seconds=last["write"],
        last_bytes=last["bytes"],
        last_throughput_bytes_per_s=last["tput"],
        blocked_seconds_total=tot["blocked"],
        staging_seconds_total=tot["stage"],
        write_seconds_total=tot["write"],
        bytes_written_total=tot["bytes"],
        load_seconds_total=tot["load"],
        bytes_read_total=tot["read"],
        staging_buffer_bytes=staging_bytes,
        last_stream_buffer_bytes=last.get("stream", 0),
    )
