"""``dstrain_offload_*`` metrics: each offload part (an offloading stepper, stage 3's parameter and
gradient stores) registered as a source of dsio's one metrics mechanism (`dsio.metrics.track`); read
from `statistics()` snapshots at scrape time only.

A part an engine owns is that engine's: `initialize` hands it over once the engine is built (`own`),
and from then on its series carry the engine's labels (``rank`` and ``engine``,
`dstrain.metrics.labels`) beside ``kind``, and are exported exactly while the engine's own
``dstrain_*`` series are (from ``dstrain.metrics.register(engine)`` until ``engine.close()``). Two
engines' offload counters are so never added into one series (dsio's collector sums samples with
equal labels), and a closed engine's series go whole instead of dipping a shared sum. A part built
by hand (an `OffloadAdam` used as a torch optimizer) has no engine: it is exported from construction
until ``close()`` with ``engine=":N"``, ``N`` the smallest number no other open hand-built part of
its kind holds (``:`` is in no engine's name), so two of them are never added into one series either
(every ``dstrain_offload_*`` series has the three labels).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dsio.metrics import Sample, track, untrack
from dstrain.metrics import labels as engine_labels
from dstrain.offload.optimizer.statistics import OffloadOptimizerStatistics

if TYPE_CHECKING:
    from dstrain.engine import Engine

__all__ = ["own", "register_offload", "samples", "unregister_offload"]


def samples(s: Any, rank: int, kind: str = "optimizer", engine: str = "") -> Iterator[Sample]:
    """Samples of one `OffloadOptimizerStatistics` (``kind="optimizer"``), `ParamStoreStatistics`
    (``kind="param"``) or `GradStoreStatistics` (``kind="grad"``) snapshot; ``engine``: the owning
    engine's name (its ``engine`` label), ``""`` for a part no engine owns."""
    base = {"rank": str(rank), "engine": engine, "kind": kind}

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


class _Series:
    """How one tracked offload part's snapshot becomes samples: its kind, and its engine once owned
    (until then its ``engine`` label is ``hand``: ``":N"``)."""

    __slots__ = ("hand", "kind", "owner", "rank")

    def __init__(self, kind: str, rank: int, hand: str) -> None:
        self.kind = kind
        self.rank = rank
        self.hand = hand
        self.owner: weakref.ref[Engine] | None = None  # set once, by `own` (the scrape thread reads it)

    def describe(self, snap: Any) -> Iterator[Sample]:
        if self.owner is None:  # built by hand: no engine
            return samples(snap, self.rank, self.kind, engine=self.hand)
        engine = self.owner()
        try:
            mine = engine_labels(engine) if engine is not None else None
        except KeyError:  # the engine is not registered (dstrain.metrics.register), or is closed
            mine = None
        if mine is None:
            return iter(())
        return samples(snap, int(mine["rank"]), self.kind, engine=mine["engine"])


_series: weakref.WeakKeyDictionary[Any, _Series] = weakref.WeakKeyDictionary()  # tracked part -> its series
_series_lock = threading.Lock()  # parts are built on any thread


def _hand_label(kind: str) -> str:
    """``":N"``: the smallest ``N`` no registered part of ``kind`` that no engine owns holds (the
    lock held; a part garbage-collected or unregistered frees its number)."""
    held = {s.hand for s in list(_series.values()) if s.kind == kind and s.owner is None}
    return next(f":{i}" for i in range(len(held) + 1) if f":{i}" not in held)


def register_offload(stepper: Any, kind: str = "optimizer") -> None:
    """Export ``stepper.statistics()`` (or a parameter store's, ``kind="param"``; a gradient
    store's, ``kind="grad"``) as ``dstrain_offload_*`` while it lives (held weakly) and until
    `unregister_offload`; labelled ``engine=":N"`` (the module's docstring) until `own` gives it an
    engine. Idempotent."""
    rank = _rank()
    with _series_lock:
        if stepper in _series:
            return
        series = _Series(kind, rank, _hand_label(kind))
        _series[stepper] = series
    track(stepper, kind="offload", namespace="dstrain", describe=series.describe)


def own(part: Any, engine: Engine) -> None:
    """Make ``engine`` the owner of the registered offload ``part``: from the next scrape its series
    carry ``engine``'s labels (``rank``, ``engine``: `dstrain.metrics.labels`) and are exported only
    while ``engine`` is registered and open. Called by `initialize` (the offload room's
    `dstrain.offload.compose.own_parts`). Raises ValueError for a part not registered (or already
    unregistered), or owned by another engine."""
    with _series_lock:
        series = _series.get(part)
    if series is None:
        raise ValueError(f"{type(part).__name__} is not a registered offload part (register_offload)")
    held = series.owner() if series.owner is not None else None
    if held is not None and held is not engine:
        raise ValueError(f"this {type(part).__name__} belongs to another engine")
    series.owner = weakref.ref(engine)


def unregister_offload(stepper: Any) -> None:
    """Stop exporting ``stepper``'s series (its ``close()`` calls this; idempotent)."""
    with _series_lock:
        _series.pop(stepper, None)
    untrack(stepper)
