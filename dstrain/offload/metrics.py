"""``dstrain_offload_*`` metrics: an offloading stepper registered as a source of dsio's one metrics
mechanism (`dsio.metrics.track`); read from `statistics()` snapshots at scrape time only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dsio.metrics import Sample, track, untrack
from dstrain.offload.optimizer.statistics import OffloadOptimizerStatistics

__all__ = ["register_offload", "samples", "unregister_offload"]


def samples(s: Any, rank: int, kind: str = "optimizer") -> Iterator[Sample]:
    """Samples of one `OffloadOptimizerStatistics` (``kind="optimizer"``), `ParamStoreStatistics`
    (``kind="param"``) or `GradStoreStatistics` (``kind="grad"``) snapshot."""
    base = {"rank": str(rank), "kind": kind}

    def counter(name: str, doc: str, value: float, **labels: str) -> Sample:
        return Sample(name, "counter", float(value), doc, {**base, **labels})

    def gauge(name: str, doc: str, value: float) -> Sample:
        return Sample(name, "gauge", float(value), doc, base)

    sw = s.swapper
    if sw is not None:
        for direction, nbytes, ops in (
            ("read", sw.read_bytes, sw.reads),
            ("write", sw.written_bytes, sw.writes),
        ):
            yield counter("dstrain_offload_swap_bytes", "Bytes swapped", nbytes, direction=direction)
            yield counter("dstrain_offload_swap_ops", "Swap transfers", ops, direction=direction)
        yield gauge(
            "dstrain_offload_pinned_bytes_in_use",
            "Pinned swap memory lent out now",
            sw.buffers_in_use * sw.buffer_bytes,
        )
    yield gauge("dstrain_offload_pinned_bytes", "Pinned memory allocated for swapping", s.pinned_bytes)
    yield gauge("dstrain_offload_pinned_budget_bytes", "offload_pinned_bytes", s.pinned_budget)
    yield counter(
        "dstrain_offload_stall_seconds", "Training-thread waits for late swapped-in state", s.stall_seconds
    )
    doc = "Sub-groups (optimizer) or shards (param) found swapped in when needed"
    yield counter("dstrain_offload_prefetch", doc, s.prefetch_hits, result="hit")
    yield counter("dstrain_offload_prefetch", doc, s.prefetch_misses, result="miss")
    if isinstance(s, OffloadOptimizerStatistics):  # the optimizer's own counters
        yield counter(
            "dstrain_offload_stepped_in_backward",
            "Sub-groups stepped during the boundary backward (dstrain.offload.optimizer.early_step)",
            s.stepped_in_backward,
        )
        yield counter("dstrain_offload_step_seconds", "Time in the offloaded optimizer step", s.step_seconds)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def register_offload(stepper: Any, kind: str = "optimizer") -> None:
    """Export ``stepper.statistics()`` (or a parameter store's, ``kind="param"``) as
    ``dstrain_offload_*`` while it lives (held weakly)."""
    rank = _rank()
    track(stepper, kind="offload", namespace="dstrain", describe=lambda snap: samples(snap, rank, kind))


def unregister_offload(stepper: Any) -> None:
    untrack(stepper)
