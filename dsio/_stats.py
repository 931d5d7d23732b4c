"""Frozen statistics snapshots of the engine and handles (read by dsio.metrics at scrape time)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .pool import PoolStatistics

__all__ = [
    "IOEngineStatistics",
    "HandleStatistics",
    "OpStatistics",
    "LATENCY_BUCKET_BOUNDS_S",
    "SIZE_BUCKET_BOUNDS_BYTES",
]

#: Upper bound (seconds) of each latency bucket the engine keeps: bucket i counts requests that
#: took less than 2**i microseconds; the last bucket counts everything slower.
LATENCY_BUCKET_BOUNDS_S: tuple[float, ...] = tuple((2**i) * 1e-6 for i in range(31)) + (float("inf"),)
#: Upper bound (bytes) of each request-size bucket: bucket i counts requests of at most 4096 << i bytes.
SIZE_BUCKET_BOUNDS_BYTES: tuple[float, ...] = tuple(float(4096 << i) for i in range(23)) + (float("inf"),)


@dataclass(frozen=True, slots=True)
class OpStatistics:
    ops: int
    """Requests finished (successful or not)."""
    bytes: int
    errors: int
    latency_seconds_total: float
    latency_buckets: tuple[int, ...]
    """Non-cumulative counts per bucket of ``LATENCY_BUCKET_BOUNDS_S``."""
    size_buckets: tuple[int, ...] = ()
    """Non-cumulative counts of request sizes per bucket of ``SIZE_BUCKET_BOUNDS_BYTES``."""
    errors_by_errno: Mapping[int, int] = field(default_factory=dict)
    """Failed requests by errno (0: errno >= 134); short transfers are counted in ``errors`` only."""
    piece_latency_buckets: tuple[int, ...] = ()
    """Non-cumulative counts per bucket of ``LATENCY_BUCKET_BOUNDS_S`` of each block_size piece's time
    in the kernel (submission to completion): what the device gives one piece at the engine's depth."""

    @classmethod
    def from_native(cls, d: dict) -> OpStatistics:
        return cls(
            d["ops"],
            d["bytes"],
            d["errors"],
            d["latency_ns"] / 1e9,
            tuple(d["latency_hist"]),
            tuple(d.get("size_hist", ())),
            dict(d.get("errno_counts", {})),
            tuple(d.get("piece_latency_hist", ())),
        )


@dataclass(frozen=True, slots=True)
class IOEngineStatistics:
    backend: str
    read: OpStatistics
    write: OpStatistics
    fsync: OpStatistics
    in_flight: int
    """Requests submitted and not yet finished."""
    submitted: int
    completed: int
    pieces: int
    """block_size pieces handed to the kernel."""
    short: int
    """Requests that ended short (end of file, or a write the kernel would not finish)."""
    submit_syscalls: int
    wait_syscalls: int
    prefault_ranges: int = 0
    """Read destinations queued for prefaulting (large reads)."""
    prefaulted_bytes: int = 0
    """Read-destination bytes the prefault thread populated ahead of the I/O (fresh memory)."""
    prefault_skipped_bytes: int = 0
    """Read-destination bytes the prefault thread found already resident (touched or locked memory)."""
    prefault_seconds_total: float = 0.0
    """Time the prefault thread spent populating."""
    staged_copy_bytes: int = 0
    """Bytes the engine's workers copied between pool buffers and caller memory (staged I/O)."""
    staged_copy_seconds_total: float = 0.0
    """Worker time spent on those copies (off the event-loop thread, GIL-free), and on the
    checksums computed with them or on their own (``checksummed_bytes``)."""
    checksummed_bytes: int = 0
    """Read bytes the engine's copier checksummed as they arrived (reads given `dsio._sums.ReadSums`)."""

    @classmethod
    def from_native(cls, backend: str, d: dict) -> IOEngineStatistics:
        return cls(
            backend=backend,
            read=OpStatistics.from_native(d["read"]),
            write=OpStatistics.from_native(d["write"]),
            fsync=OpStatistics.from_native(d["fsync"]),
            in_flight=d["submitted"] - d["completed"],
            submitted=d["submitted"],
            completed=d["completed"],
            pieces=d["pieces"],
            short=d["short"],
            submit_syscalls=d["submit_syscalls"],
            wait_syscalls=d["wait_syscalls"],
            prefault_ranges=d.get("prefault", {}).get("ranges", 0),
            prefaulted_bytes=d.get("prefault", {}).get("populated_bytes", 0),
            prefault_skipped_bytes=d.get("prefault", {}).get("resident_bytes", 0),
            prefault_seconds_total=d.get("prefault", {}).get("busy_ns", 0) / 1e9,
            staged_copy_bytes=d.get("copy", {}).get("bytes", 0),
            staged_copy_seconds_total=d.get("copy", {}).get("busy_ns", 0) / 1e9,
            checksummed_bytes=d.get("copy", {}).get("summed_bytes", 0),
        )


@dataclass(frozen=True, slots=True)
class HandleStatistics:
    backend: str
    reads: int
    """pread calls finished (successful or not)."""
    writes: int
    read_bytes: int
    """Bytes of successful preads."""
    written_bytes: int
    errors: int
    """Calls that raised an I/O error."""
    in_flight: int
    """Calls started and not yet finished."""
    direct_bytes: int
    """Bytes moved by O_DIRECT straight from or into caller memory."""
    staged_bytes: int
    """Bytes staged through the pinned pool (caller memory not 4096-aligned)."""
    buffered_bytes: int
    """Bytes through the page cache (unaligned heads and tails, or no O_DIRECT here)."""
    engine: IOEngineStatistics
    pool: PoolStatistics
