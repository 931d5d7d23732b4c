"""The registry of live objects whose ``statistics()`` the metrics layer exports.

The storage engine (handles, pools, checkpointers) registers itself here with :func:`track`
and never imports the metrics layer or prometheus-client: ``dsio.metrics`` reads this registry
at scrape time. Objects are held weakly; an object that is untracked (or collected) has its last
snapshot folded into process-wide "retired" totals, so counters stay monotonic across object
lifetimes.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "REGISTRY",
    "Describe",
    "HasStatistics",
    "NamesItsKind",
    "PerBackend",
    "Registry",
    "Sample",
    "track",
    "tracked",
    "untrack",
]


@runtime_checkable
class HasStatistics(Protocol):
    """What `track` exports: an object whose ``statistics()`` returns a snapshot (a frozen dataclass)."""

    def statistics(self) -> Any: ...


@runtime_checkable
class NamesItsKind(Protocol):
    """A tracked object that names its own kind (``<namespace>_<kind>_<field>``) instead of the one
    derived from its class name (see `track`)."""

    metrics_kind: str


@runtime_checkable
class PerBackend(Protocol):
    """A snapshot of an object bound to one kernel backend (a handle's): retired snapshots are merged
    per backend, so that the exported series keep their ``backend`` label."""

    backend: str


@dataclass(frozen=True, slots=True)
class Sample:
    """One exported value of a source (see ``track(describe=...)``)."""

    name: str
    """Full metric name without ``_total`` (e.g. ``dstrain_steps``)."""
    kind: Literal["counter", "gauge"]
    value: float
    doc: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


Describe = Callable[[Any], Iterable[Sample]]
"""Turns one ``statistics()`` snapshot into samples (runs on the exporter's thread)."""


def _merge(a: Any, b: Any) -> Any:
    """Field-wise sum of two snapshots of one type (numbers add, tuples add element-wise,
    mappings add by key, nested dataclasses merge, anything else keeps ``a``'s value)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a + b
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_merge(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return {k: _merge(a.get(k, 0), b.get(k, 0)) for k in {**a, **b}}
    if dataclasses.is_dataclass(a) and type(a) is type(b) and not isinstance(a, type):
        return dataclasses.replace(
            a,
            **{
                f.name: _merge(getattr(a, f.name), getattr(b, f.name))
                for f in dataclasses.fields(a)
                if f.init
            },
        )
    return a


class Registry:
    """Live objects by key, weakly; the last snapshot of each; merged totals of retired ones.

    Weak-reference callbacks only append to a deque (they may run during any allocation, even
    while the lock is held); the dictionaries are brought up to date under the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._live: dict[int, tuple[weakref.ref[Any], str]] = {}
        self._describe: dict[int, Describe] = {}  # key -> how a source's snapshot becomes samples
        self._key_of: dict[int, int] = {}  # id(obj) -> key
        self._oid_of: dict[int, int] = {}  # key -> id(obj)
        self._last: dict[int, Any] = {}  # key -> last snapshot seen
        self._dead: collections.deque[int] = collections.deque()
        self._retired: dict[tuple[str, str, type], Any] = {}  # (kind, backend, type) -> merged

    def _reap(self) -> None:
        while self._dead:
            key = self._dead.popleft()
            entry = self._live.pop(key, None)
            described = self._describe.pop(key, None) is not None
            oid = self._oid_of.pop(key, None)
            if oid is not None and self._key_of.get(oid) == key:
                del self._key_of[oid]
            snap = self._last.pop(key, None)
            if entry is not None and snap is not None and not described:
                self._retire(entry[1], snap)

    def _retire(self, kind: str, snap: Any) -> None:
        k = (kind, str(snap.backend) if isinstance(snap, PerBackend) else "", type(snap))
        prev = self._retired.get(k)
        self._retired[k] = snap if prev is None else _merge(prev, snap)

    def add(self, obj: Any, kind: str, describe: Describe | None = None) -> None:
        with self._lock:
            self._reap()
            key = self._key_of.get(id(obj))
            if key is not None and key in self._live and self._live[key][0]() is obj:
                return  # already tracked
            key = next(self._ids)
            if describe is not None:
                self._describe[key] = describe
            dead = self._dead

            def _gone(_ref: weakref.ref[Any], key: int = key) -> None:
                dead.append(key)

            self._live[key] = (weakref.ref(obj, _gone), kind)
            self._key_of[id(obj)] = key
            self._oid_of[key] = id(obj)

    def remove(self, obj: Any) -> None:
        snap = _snapshot(obj)
        with self._lock:
            self._reap()
            key = self._key_of.get(id(obj))
            if key is None or key not in self._live or self._live[key][0]() is not obj:
                return
            kind = self._live.pop(key)[1]
            del self._key_of[id(obj)]
            del self._oid_of[key]
            last = self._last.pop(key, None)
            if self._describe.pop(key, None) is not None:
                return  # sources export live values only
            if snap is not None or last is not None:
                self._retire(kind, snap if snap is not None else last)

    def snapshots(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]], list[Sample]]:
        """(live snapshots by kind, merged retired snapshots by kind, samples of sources), read now."""
        samples: list[Sample] = []
        with self._lock:
            self._reap()
            entries = [(key, ref(), kind) for key, (ref, kind) in self._live.items()]
            describes = dict(self._describe)
            retired: dict[str, list[Any]] = {}
            for (kind, _be, _t), snap in self._retired.items():
                retired.setdefault(kind, []).append(snap)
        live: dict[str, list[Any]] = {}
        for key, obj, kind in entries:
            if obj is None:
                continue
            # statistics() runs on the exporter's thread while the owner's thread mutates the
            # object; a snapshot that fails (e.g. a deque mutated mid-iteration) is retried, then
            # replaced by the last good one, so totals never dip (a dip reads as a counter reset).
            snap = _snapshot(obj)
            if snap is None:
                snap = _snapshot(obj)
            with self._lock:
                if snap is None:
                    snap = self._last.get(key)
                elif key in self._live:
                    self._last[key] = snap
            if snap is None:
                continue
            describe = describes.get(key)
            if describe is None:
                live.setdefault(kind, []).append(snap)
                continue
            try:
                samples.extend(describe(snap))
            except Exception:  # a broken source must not break the scrape
                continue
        del entries  # drop the strong references before returning
        return live, retired, samples

    def count(self) -> dict[str, int]:
        with self._lock:
            self._reap()
            out: dict[str, int] = {}
            for ref, kind in self._live.values():
                if ref() is not None:
                    out[kind] = out.get(kind, 0) + 1
            return out


def _snapshot(obj: Any) -> Any:
    try:
        return obj.statistics()
    except Exception:  # a half-constructed or broken object must not break the scrape
        return None


REGISTRY = Registry()
"""The process-wide registry that ``dsio.metrics``' collector reads."""


def _kind_of(obj: Any) -> str:
    if isinstance(obj, NamesItsKind) and isinstance(obj.metrics_kind, str) and obj.metrics_kind:
        return obj.metrics_kind
    name = type(obj).__name__
    known = {"AsyncIOHandle": "handle", "PinnedPool": "pool", "Checkpointer": "checkpoint"}
    if name in known:
        return known[name]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def track(
    obj: HasStatistics,
    *,
    kind: str | None = None,
    namespace: str = "dsio",
    describe: Describe | None = None,
) -> None:
    """Export ``obj.statistics()`` at every scrape while ``obj`` lives (held weakly; idempotent).

    ``kind`` defaults to the object's own ``metrics_kind`` (`NamesItsKind`), else from the class:
    ``AsyncIOHandle`` -> ``handle`` (its pool is included), ``PinnedPool`` -> ``pool``,
    ``Checkpointer`` -> ``checkpoint``, others their snake-case name.
    Kinds other than handle and pool are exported field by field as ``<namespace>_<kind>_<field>``
    (e.g. ``namespace="dstrain", kind="swapper"`` -> ``dstrain_swapper_...``).
    ``describe`` makes ``obj`` a *source*: at each scrape its snapshot is turned into
    :class:`Sample` values by ``describe(snapshot)`` (names, labels and counter/gauge chosen by the
    owner: dstrain's engine metrics are exported this way) instead of field by field.
    Sources export live values only: nothing is folded into totals when they go.
    Costs one weak reference; nothing runs per I/O operation.
    """
    if not (isinstance(obj, HasStatistics) and callable(obj.statistics)):
        raise TypeError(f"{type(obj).__name__} has no statistics() method to export")
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", namespace):
        raise ValueError(f"namespace must be a Prometheus name prefix like 'dstrain', got {namespace!r}")
    k = kind or _kind_of(obj)
    REGISTRY.add(obj, k if namespace == "dsio" else f"{namespace}:{k}", describe)


def untrack(obj: Any) -> None:
    """Stop exporting ``obj``, folding its final snapshot into the process totals (idempotent)."""
    REGISTRY.remove(obj)


def tracked() -> dict[str, int]:
    """Live tracked objects by kind."""
    return REGISTRY.count()
