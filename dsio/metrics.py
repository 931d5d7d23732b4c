"""Prometheus metrics read from ``statistics()`` snapshots at scrape time.

The I/O hot path never touches prometheus-client: live objects are kept in a weak registry
(:func:`track`) and the collector asks each for its frozen ``statistics()`` snapshot when
Prometheus scrapes. ``AsyncIOHandle`` tracks itself; standalone pools, checkpointers and
anything else with a ``statistics()`` dataclass can be tracked with ``track(obj)``.

    dsio.metrics.serve(port=9400)                 # exporter on 127.0.0.1:9400/metrics
    dsio.metrics.register(my_registry)            # or into a caller's own CollectorRegistry

Counters stay monotonic across object lifetimes: an object that is untracked (or closed and
then collected) has its last snapshot folded into process-wide "retired" totals. Activity of an
object that is garbage-collected without ``untrack`` since the previous scrape is lost; call
:func:`untrack` from ``close()`` to make totals exact.

Families (prefix ``dsio_``; units in names; counters end in ``_total``):

- ``dsio_requests_total{op,backend}``, ``dsio_bytes_total{op,backend}``,
  ``dsio_request_errors_total{op,backend,errno}``: engine requests (op: read, write, fsync).
  ``errno`` is ``"unreported"`` until the engine keeps per-errno counts.
- ``dsio_request_latency_seconds{op,backend}`` (histogram, buckets kept by the engine: powers of
  two of microseconds; the engine's bucket i counts latencies < 2**i us, exported as ``le``),
  ``dsio_request_size_bytes{op,backend}`` (histogram; only ``+Inf`` until the engine keeps size
  buckets).
- ``dsio_requests_in_flight{backend}``, ``dsio_calls_in_flight{backend}``, ``dsio_calls_total{op,backend}``,
  ``dsio_call_errors_total{backend}``, ``dsio_transfer_bytes_total{path}`` (direct, staged, buffered),
  ``dsio_kernel_pieces_total``, ``dsio_short_requests_total``, ``dsio_syscalls_total{kind}``.
- ``dsio_pool_buffers``, ``dsio_pool_buffers_in_use``, ``dsio_pool_waiters``, ``dsio_pool_bytes``,
  ``dsio_pool_acquisitions_total``, ``dsio_pool_waits_total``, ``dsio_pool_wait_seconds_total``.
- ``dsio_<kind>_<field>`` for other tracked objects (``kind`` from the class name, e.g.
  ``Checkpointer`` -> ``checkpoint``): numeric fields of the snapshot; ``*_total`` and bare event
  counts (``saves``) as counters, levels (``in_flight``, ``last_*``, ``*_bytes``) as gauges:
  ``dsio_checkpoint_saves_total``, ``dsio_checkpoint_blocked_seconds_total``,
  ``dsio_checkpoint_bytes_written_total``, ``dsio_checkpoint_last_write_seconds``... dstrain uses
  ``track(obj, kind=..., namespace="dstrain")`` for ``dstrain_<kind>_<field>``.
- ``dsio_tracked_objects{kind}``, ``dsio_backend_available{backend}``, ``dsio_info{version}``.
"""

from __future__ import annotations

import collections
import dataclasses
import errno as _errno
import itertools
import math
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from ._stats import LATENCY_BUCKET_BOUNDS_S

__all__ = [
    "DEFAULT_PORT",
    "DsioCollector",
    "MetricsServer",
    "register",
    "serve",
    "track",
    "tracked",
    "untrack",
]

DEFAULT_PORT = 9400
_OPS = ("read", "write", "fsync")
#: Snapshot fields of "other" kinds that are levels, not running totals (exported as gauges).
_GAUGE_NAMES = frozenset(
    {"in_flight", "in_use", "waiters", "pending", "queued", "retained", "active", "buffers", "capacity"}
)
_GAUGE_PREFIXES = ("last_", "current_", "max_", "min_", "num_", "n_")
_GAUGE_SUFFIXES = ("_in_flight", "_in_use", "_pending", "_queued", "_inflight", "_capacity")
_UNIT_SUFFIXES = ("_bytes", "_seconds", "_per_s", "_ratio")


class _HasStatistics(Protocol):
    def statistics(self) -> Any: ...


# -- the weak registry ------------------------------------------------------------------------
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


class _Registry:
    """Live objects by key, weakly; the last snapshot of each; merged totals of retired ones.

    Weak-reference callbacks only append to a deque (they may run during any allocation, even
    while the lock is held); the dictionaries are brought up to date under the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._live: dict[int, tuple[weakref.ref[Any], str]] = {}
        self._key_of: dict[int, int] = {}  # id(obj) -> key
        self._oid_of: dict[int, int] = {}  # key -> id(obj)
        self._last: dict[int, Any] = {}  # key -> last snapshot seen
        self._dead: collections.deque[int] = collections.deque()
        self._retired: dict[tuple[str, str, type], Any] = {}  # (kind, backend, type) -> merged

    def _reap(self) -> None:
        while self._dead:
            key = self._dead.popleft()
            entry = self._live.pop(key, None)
            oid = self._oid_of.pop(key, None)
            if oid is not None and self._key_of.get(oid) == key:
                del self._key_of[oid]
            snap = self._last.pop(key, None)
            if entry is not None and snap is not None:
                self._retire(entry[1], snap)

    def _retire(self, kind: str, snap: Any) -> None:
        k = (kind, str(getattr(snap, "backend", "")), type(snap))
        prev = self._retired.get(k)
        self._retired[k] = snap if prev is None else _merge(prev, snap)

    def add(self, obj: Any, kind: str) -> None:
        with self._lock:
            self._reap()
            key = self._key_of.get(id(obj))
            if key is not None and key in self._live and self._live[key][0]() is obj:
                return  # already tracked
            key = next(self._ids)
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
            if snap is not None or last is not None:
                self._retire(kind, snap if snap is not None else last)

    def snapshots(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """(live snapshots by kind, merged retired snapshots by kind), read now."""
        with self._lock:
            self._reap()
            entries = [(key, ref(), kind) for key, (ref, kind) in self._live.items()]
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
            if snap is not None:
                live.setdefault(kind, []).append(snap)
        del entries  # drop the strong references before returning
        return live, retired

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


_REG = _Registry()


def _kind_of(obj: Any) -> str:
    kind = getattr(obj, "metrics_kind", None)
    if isinstance(kind, str) and kind:
        return kind
    name = type(obj).__name__
    known = {"AsyncIOHandle": "handle", "PinnedPool": "pool", "Checkpointer": "checkpoint"}
    if name in known:
        return known[name]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def track(obj: _HasStatistics, *, kind: str | None = None, namespace: str = "dsio") -> None:
    """Export ``obj.statistics()`` at every scrape while ``obj`` lives (held weakly; idempotent).

    ``kind`` defaults from the class: ``AsyncIOHandle`` -> ``handle`` (its pool is included),
    ``PinnedPool`` -> ``pool``, ``Checkpointer`` -> ``checkpoint``, others their snake-case name.
    Kinds other than handle and pool are exported field by field as ``<namespace>_<kind>_<field>``
    (e.g. ``namespace="dstrain", kind="swapper"`` -> ``dstrain_swapper_...``).
    Costs one weak reference; nothing runs per I/O operation.
    """
    if not callable(getattr(obj, "statistics", None)):
        raise TypeError(f"{type(obj).__name__} has no statistics() method to export")
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", namespace):
        raise ValueError(f"namespace must be a Prometheus name prefix like 'dstrain', got {namespace!r}")
    k = kind or _kind_of(obj)
    _REG.add(obj, k if namespace == "dsio" else f"{namespace}:{k}")


def untrack(obj: Any) -> None:
    """Stop exporting ``obj``, folding its final snapshot into the process totals (idempotent)."""
    _REG.remove(obj)


def tracked() -> dict[str, int]:
    """Live tracked objects by kind."""
    return _REG.count()


# -- the collector -------------------------------------------------------------------------------
def _add(acc: dict[tuple[str, ...], float], key: tuple[str, ...], v: float) -> None:
    acc[key] = acc.get(key, 0.0) + v


def _errno_name(code: object) -> str:
    """``5`` -> ``"EIO"``; ``0`` is the engine's slot for errno values past its table: ``"other"``."""
    if isinstance(code, int):
        return "other" if code == 0 else _errno.errorcode.get(code, str(code))
    return str(code)


class DsioCollector:
    """A prometheus-client collector over the tracked objects. Register it into any registry."""

    def __init__(self, registry: _Registry | None = None) -> None:
        self._reg = registry or _REG
        self._backends: list[tuple[str, bool]] | None = None

    def describe(self) -> list[Any]:
        return []  # families vary with what is tracked; skip prometheus-client's collect() probe

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        live, retired = self._reg.snapshots()
        handles = live.get("handle", [])
        all_handles = handles + retired.get("handle", [])

        def counter(name: str, doc: str, labels: Iterable[str], acc: Mapping[tuple[str, ...], float]) -> Any:
            fam = CounterMetricFamily(name, doc, labels=list(labels))
            for key, v in sorted(acc.items()):
                fam.add_metric(list(key), v)
            return fam

        def gauge(name: str, doc: str, labels: Iterable[str], acc: Mapping[tuple[str, ...], float]) -> Any:
            fam = GaugeMetricFamily(name, doc, labels=list(labels))
            for key, v in sorted(acc.items()):
                fam.add_metric(list(key), v)
            return fam

        # Engine requests, by op and backend (monotonic: live + retired).
        reqs: dict[tuple[str, ...], float] = {}
        nbytes: dict[tuple[str, ...], float] = {}
        errs: dict[tuple[str, ...], float] = {}
        lat: dict[tuple[str, str], tuple[list[float], float, float]] = {}
        size: dict[tuple[str, str], tuple[list[float] | None, float, float]] = {}
        calls: dict[tuple[str, ...], float] = {}
        call_errs: dict[tuple[str, ...], float] = {}
        paths: dict[tuple[str, ...], float] = {}
        pieces: dict[tuple[str, ...], float] = {}
        short: dict[tuple[str, ...], float] = {}
        syscalls: dict[tuple[str, ...], float] = {}
        for st in all_handles:
            eng, be = st.engine, st.engine.backend
            for op in _OPS:
                o = getattr(eng, op)
                _add(reqs, (op, be), o.ops)
                _add(nbytes, (op, be), o.bytes)
                by_errno = getattr(o, "errors_by_errno", None)
                if isinstance(by_errno, Mapping):
                    for code, n in by_errno.items():
                        _add(errs, (op, be, _errno_name(code)), n)
                    rest = o.errors - sum(by_errno.values())
                    if rest > 0:
                        _add(errs, (op, be, "short"), rest)
                    _add(errs, (op, be, "unreported"), 0)  # keep the series alive
                else:
                    _add(errs, (op, be, "unreported"), o.errors)
                buckets, s, c = lat.get((op, be), ([0.0] * len(o.latency_buckets), 0.0, 0.0))
                for i, n in enumerate(o.latency_buckets):
                    buckets[i] += n
                lat[(op, be)] = (buckets, s + o.latency_seconds_total, c + o.ops)
                sb = getattr(o, "size_buckets", None)
                prev, s2, c2 = size.get((op, be), (None, 0.0, 0.0))
                if sb is not None:
                    prev = [a + b for a, b in zip(prev or [0.0] * len(sb), sb)]
                size[(op, be)] = (prev, s2 + o.bytes, c2 + o.ops)
            _add(calls, ("read", st.backend), st.reads)
            _add(calls, ("write", st.backend), st.writes)
            _add(call_errs, (st.backend,), st.errors)
            for p in ("direct", "staged", "buffered"):
                _add(paths, (p,), getattr(st, f"{p}_bytes"))
            _add(pieces, (be,), eng.pieces)
            _add(short, (be,), eng.short)
            _add(syscalls, ("submit", be), eng.submit_syscalls)
            _add(syscalls, ("wait", be), eng.wait_syscalls)

        yield counter(
            "dsio_requests", "Engine requests finished (successful or not).", ("op", "backend"), reqs
        )
        yield counter("dsio_bytes", "Bytes moved by engine requests.", ("op", "backend"), nbytes)
        yield counter(
            "dsio_request_errors",
            "Engine requests that failed or ended short, by errno name.",
            ("op", "backend", "errno"),
            errs,
        )
        hist = HistogramMetricFamily(
            "dsio_request_latency_seconds",
            "Engine request latency, submit to completion (buckets kept by the engine).",
            labels=["op", "backend"],
        )
        bounds = [("+Inf" if math.isinf(b) else format(b, ".12g")) for b in LATENCY_BUCKET_BOUNDS_S]
        for (op, be), (buckets, s, _c) in sorted(lat.items()):
            cum = list(itertools.accumulate(buckets))
            hist.add_metric([op, be], list(zip(bounds, cum)), s)
        yield hist
        size_hist = HistogramMetricFamily(
            "dsio_request_size_bytes", "Engine request size (bytes).", labels=["op", "backend"]
        )
        size_bounds = _size_bounds()
        for (op, be), (sb_acc, s, c) in sorted(size.items()):
            if sb_acc is not None and size_bounds and len(size_bounds) == len(sb_acc):
                pairs = list(zip(size_bounds, itertools.accumulate(sb_acc)))
            else:
                pairs = [("+Inf", c)]
            size_hist.add_metric([op, be], pairs, s)
        yield size_hist
        yield counter("dsio_calls", "pread/pwrite calls on handles, finished.", ("op", "backend"), calls)
        yield counter("dsio_call_errors", "Handle calls that raised an I/O error.", ("backend",), call_errs)
        yield counter(
            "dsio_transfer_bytes",
            "Handle bytes by path: direct (O_DIRECT from caller memory), staged (through the pinned pool), "
            "buffered (page cache).",
            ("path",),
            paths,
        )
        yield counter("dsio_kernel_pieces", "block_size pieces handed to the kernel.", ("backend",), pieces)
        yield counter("dsio_short_requests", "Requests that ended short.", ("backend",), short)
        yield counter(
            "dsio_syscalls", "Submit and wait syscalls made by the engine.", ("kind", "backend"), syscalls
        )

        # Levels: live objects only.
        in_flight: dict[tuple[str, ...], float] = {}
        calls_in_flight: dict[tuple[str, ...], float] = {}
        for st in handles:
            _add(in_flight, (st.engine.backend,), st.engine.in_flight)
            _add(calls_in_flight, (st.backend,), st.in_flight)
        yield gauge(
            "dsio_requests_in_flight", "Engine requests submitted, not finished.", ("backend",), in_flight
        )
        yield gauge(
            "dsio_calls_in_flight", "Handle calls started, not finished.", ("backend",), calls_in_flight
        )

        yield from self._pools(live, retired, counter, gauge)
        for kind in sorted(set(live) | set(retired)):
            if kind not in ("handle", "pool"):
                yield from _generic(kind, live.get(kind, []), retired.get(kind, []), counter, gauge)

        counts: dict[tuple[str, ...], float] = {(k,): float(v) for k, v in self._reg.count().items()}
        for k in ("handle", "pool"):
            counts.setdefault((k,), 0.0)
        yield gauge("dsio_tracked_objects", "Live objects exported, by kind.", ("kind",), counts)
        yield gauge(
            "dsio_backend_available",
            "1 if the kernel backend can run on this machine.",
            ("backend",),
            {(name,): float(ok) for name, ok in self._backend_status()},
        )
        from . import __version__

        yield gauge("dsio_info", "dsio build information.", ("version",), {(__version__,): 1.0})

    def _pools(
        self, live: dict[str, list[Any]], retired: dict[str, list[Any]], counter, gauge
    ) -> Iterator[Any]:
        live_pools = [st.pool for st in live.get("handle", [])] + live.get("pool", [])
        dead_pools = [st.pool for st in retired.get("handle", [])] + retired.get("pool", [])
        levels = {"buffers": 0.0, "in_use": 0.0, "waiters": 0.0, "bytes": 0.0}
        for p in live_pools:
            levels["buffers"] += p.buffers
            levels["in_use"] += p.in_use
            levels["waiters"] += p.waiters
            levels["bytes"] += p.buffers * p.buffer_bytes
        yield gauge("dsio_pool_buffers", "Pinned pool buffers.", (), {(): levels["buffers"]})
        yield gauge("dsio_pool_buffers_in_use", "Pinned pool buffers handed out.", (), {(): levels["in_use"]})
        yield gauge("dsio_pool_waiters", "Tasks waiting for a pool buffer.", (), {(): levels["waiters"]})
        yield gauge("dsio_pool_bytes", "Pinned pool memory.", (), {(): levels["bytes"]})
        totals = {"acquired": 0.0, "waited": 0.0, "wait_s": 0.0}
        for p in live_pools + dead_pools:
            totals["acquired"] += p.acquired_total
            totals["waited"] += p.waited_total
            totals["wait_s"] += p.wait_seconds_total
        yield counter("dsio_pool_acquisitions", "Pool buffers acquired.", (), {(): totals["acquired"]})
        yield counter("dsio_pool_waits", "Pool acquisitions that had to wait.", (), {(): totals["waited"]})
        yield counter(
            "dsio_pool_wait_seconds", "Time spent waiting for pool buffers.", (), {(): totals["wait_s"]}
        )

    def _backend_status(self) -> list[tuple[str, bool]]:
        if self._backends is None:
            try:
                from ._backends import backend_status

                self._backends = [(s.name, s.available) for s in backend_status()]
            except Exception:
                self._backends = []
        return self._backends


def _size_bounds() -> list[str] | None:
    from . import _stats

    b = getattr(_stats, "SIZE_BUCKET_BOUNDS_BYTES", None)
    if not b:
        return None
    return [("+Inf" if math.isinf(x) else format(float(x), ".12g")) for x in b]


def _is_gauge(field: str, value: object) -> bool:
    """Levels (exported as gauges, live objects only) versus running totals (counters).

    ``*_total`` is always a counter; booleans, ``last_*``/``current_*``..., ``in_flight``-like
    names and bare unit suffixes (``staging_buffer_bytes``, ``last_write_seconds``) are levels;
    any other number (``saves``, ``failed_saves``) counts events.
    """
    if field.endswith("_total"):
        return False
    return (
        isinstance(value, bool)
        or field in _GAUGE_NAMES
        or field.startswith(_GAUGE_PREFIXES)
        or field.endswith(_GAUGE_SUFFIXES)
        or field.endswith(_UNIT_SUFFIXES)
    )


def _fields(snap: Any) -> Iterator[tuple[str, float, bool]]:
    """(name, value, is_gauge) of each numeric field of a dataclass or mapping snapshot."""
    if dataclasses.is_dataclass(snap) and not isinstance(snap, type):
        items: Iterable[tuple[str, Any]] = ((f.name, getattr(snap, f.name)) for f in dataclasses.fields(snap))
    elif isinstance(snap, Mapping):
        items = snap.items()
    else:
        return
    for name, v in items:
        if isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isnan(v)):
            yield name, float(v), _is_gauge(name, v)


def _generic(kind: str, live: list[Any], retired: list[Any], counter, gauge) -> Iterator[Any]:
    """``dsio_<kind>_<field>`` for each numeric field: levels as gauges (live objects; ``last_*``
    the max over objects, others the sum), running totals as counters (live + retired), e.g.
    ``saves`` -> ``dsio_checkpoint_saves_total``, ``blocked_seconds_total`` ->
    ``dsio_checkpoint_blocked_seconds_total``, ``last_write_seconds`` ->
    ``dsio_checkpoint_last_write_seconds``."""
    namespace, _, kind = kind.rpartition(":")
    prefix = (namespace or "dsio") + "_" + re.sub(r"[^a-zA-Z0-9_]", "_", kind)
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    for snap in live:
        for name, v, is_gauge in _fields(snap):
            if not is_gauge:
                counters[name] = counters.get(name, 0.0) + v
            elif name.startswith("last_") and name in gauges:
                gauges[name] = max(gauges[name], v)
            else:
                gauges[name] = gauges.get(name, 0.0) + v
    for snap in retired:
        for name, v, is_gauge in _fields(snap):
            if not is_gauge:
                counters[name] = counters.get(name, 0.0) + v
    for name, v in sorted(gauges.items()):
        yield gauge(f"{prefix}_{name}", f"{kind} statistics field {name} (level).", (), {(): v})
    for name, v in sorted(counters.items()):
        base = name[: -len("_total")] if name.endswith("_total") else name
        yield counter(f"{prefix}_{base}", f"{kind} statistics field {name} (running total).", (), {(): v})


# -- registration and the HTTP exporter ------------------------------------------------------------
_default_collector: DsioCollector | None = None
_default_lock = threading.Lock()


def register(registry: Any = None) -> DsioCollector:
    """Register the dsio collector into ``registry`` (prometheus-client's default registry when
    None; registering there twice is a no-op) and return it."""
    global _default_collector
    if registry is None:
        from prometheus_client import REGISTRY

        with _default_lock:
            if _default_collector is None:
                _default_collector = DsioCollector()
                REGISTRY.register(_default_collector)
            return _default_collector
    c = DsioCollector()
    registry.register(c)
    return c


class MetricsServer:
    """A running exporter: ``url``, ``port``; ``close()`` stops it (also a context manager)."""

    def __init__(self, httpd: Any, thread: threading.Thread, addr: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.addr = addr
        self.port: int = int(httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int = DEFAULT_PORT, addr: str = "127.0.0.1", *, registry: Any = None) -> MetricsServer:
    """Serve ``/metrics`` on ``addr:port`` (loopback by default; ``port=0`` picks a free port) from a
    daemon thread. With no ``registry``, a fresh one holding only the dsio collector is served (plus
    prometheus-client's process and platform collectors); pass a registry to serve it instead (the
    dsio collector is registered into it)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    register(registry)
    httpd, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(httpd, thread, addr)
