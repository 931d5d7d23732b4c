"""Prometheus metrics read from ``statistics()`` snapshots at scrape time.

The design, in full: docs/metrics.md.
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import itertools
import math
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from . import _stats
from ._exporter import DEFAULT_PORT, LISTEN_BACKLOG, MetricsServer, default_port, start
from ._registry import REGISTRY, Registry, Sample, track, tracked, untrack
from ._stats import LATENCY_BUCKET_BOUNDS_S

__all__ = [
    "DEFAULT_PORT",
    "LISTEN_BACKLOG",
    "DsioCollector",
    "MetricsServer",
    "Sample",
    "default_port",
    "register",
    "serve",
    "track",
    "tracked",
    "untrack",
]


_OPS = ("read", "write", "fsync")
#: Snapshot fields of "other" kinds that are levels, not running totals (exported as gauges).
_GAUGE_NAMES = frozenset(
    {"in_flight", "in_use", "waiters", "pending", "queued", "retained", "active", "buffers", "capacity"}
)
_GAUGE_PREFIXES = ("last_", "current_", "max_", "min_", "num_", "n_")
_GAUGE_SUFFIXES = ("_in_flight", "_in_use", "_pending", "_queued", "_inflight", "_capacity")
_UNIT_SUFFIXES = ("_bytes", "_seconds", "_per_s", "_per_second", "_ratio")


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

    def __init__(self, registry: Registry | None = None) -> None:
        self._reg = registry or REGISTRY
        self._backends: list[tuple[str, bool]] | None = None

    def describe(self) -> list[Any]:
        return []  # families vary with what is tracked; skip prometheus-client's collect() probe

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        live, retired, samples = self._reg.snapshots()
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
        routes: dict[tuple[str, ...], float] = {}
        pieces: dict[tuple[str, ...], float] = {}
        short: dict[tuple[str, ...], float] = {}
        syscalls: dict[tuple[str, ...], float] = {}
        for st in all_handles:
            eng, be = st.engine, st.engine.backend
            for op in _OPS:
                o = getattr(eng, op)
                _add(reqs, (op, be), o.ops)
                _add(nbytes, (op, be), o.bytes)
                for code, n in o.errors_by_errno.items():
                    _add(errs, (op, be, _errno_name(code)), n)
                rest = o.errors - sum(o.errors_by_errno.values())
                if rest > 0:
                    _add(errs, (op, be, "short"), rest)
                _add(errs, (op, be, "unreported"), 0)  # keep the series alive
                buckets, s, c = lat.get((op, be), ([0.0] * len(o.latency_buckets), 0.0, 0.0))
                for i, n in enumerate(o.latency_buckets):
                    buckets[i] += n
                lat[(op, be)] = (buckets, s + o.latency_seconds_total, c + o.ops)
                sb = o.size_buckets
                prev, s2, c2 = size.get((op, be), (None, 0.0, 0.0))
                prev = [a + b for a, b in zip(prev or [0.0] * len(sb), sb)]
                size[(op, be)] = (prev, s2 + o.bytes, c2 + o.ops)
            _add(calls, ("read", st.backend), st.reads)
            _add(calls, ("write", st.backend), st.writes)
            _add(call_errs, (st.backend,), st.errors)
            for route in ("direct", "staged", "buffered"):
                _add(routes, (route,), getattr(st, f"{route}_bytes"))
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
        bounds = _bounds(LATENCY_BUCKET_BOUNDS_S)
        for (op, be), (buckets, s, _c) in sorted(lat.items()):
            cum = list(itertools.accumulate(buckets))
            hist.add_metric([op, be], list(zip(bounds, cum)), s)
        yield hist
        size_hist = HistogramMetricFamily(
            "dsio_request_size_bytes", "Engine request size (bytes).", labels=["op", "backend"]
        )
        size_bounds = _bounds(_stats.SIZE_BUCKET_BOUNDS_BYTES)  # read at scrape time
        for (op, be), (sb_acc, s, c) in sorted(size.items()):
            if sb_acc is not None and len(size_bounds) == len(sb_acc):
                pairs = list(zip(size_bounds, itertools.accumulate(sb_acc)))
            else:
                pairs = [("+Inf", c)]
            size_hist.add_metric([op, be], pairs, s)
        yield size_hist
        yield counter("dsio_calls", "pread/pwrite calls on handles, finished.", ("op", "backend"), calls)
        yield counter("dsio_call_errors", "Handle calls that raised an I/O error.", ("backend",), call_errs)
        yield counter(
            "dsio_transfer_bytes",
            "Handle bytes by route: direct (O_DIRECT from caller memory), staged (through the pinned pool), "
            "buffered (page cache).",
            ("route",),
            routes,
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

        yield from _from_samples(samples)

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


def _bounds(upper: Iterable[float]) -> list[str]:
    """A histogram's bucket labels (``le``) from the engine's upper bounds."""
    return [("+Inf" if math.isinf(x) else format(float(x), ".12g")) for x in upper]


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
        yield gauge(f"{prefix}_{_unit_name(name)}", f"{kind} statistics field {name} (level).", (), {(): v})
    for name, v in sorted(counters.items()):
        base = name[: -len("_total")] if name.endswith("_total") else name
        yield counter(
            f"{prefix}_{_unit_name(base)}", f"{kind} statistics field {name} (running total).", (), {(): v}
        )


def _unit_name(field: str) -> str:
    """Prometheus spells units out: a field ``..._per_s`` is exported as ``..._per_second``."""
    return field[: -len("_per_s")] + "_per_second" if field.endswith("_per_s") else field


def _from_samples(samples: list[Sample]) -> Iterator[Any]:
    """Families of sources' samples (``track(describe=...)``), grouped by name."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.name, s.kind), []).append(s)
    for (name, kind), group in sorted(groups.items()):
        label_names = sorted({k for s in group for k in s.labels})
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(name, group[0].doc or name, labels=label_names)
        values: dict[tuple[str, ...], float] = {}
        for s in group:
            key = tuple(str(s.labels.get(k, "")) for k in label_names)
            values[key] = values.get(key, 0.0) + float(s.value)
        for key, v in sorted(values.items()):
            fam.add_metric(list(key), v)
        yield fam


# -- registration and the HTTP exporter ------------------------------------------------------------
_collectors: dict[int, tuple[Any, DsioCollector]] = {}  # id(registry) -> (registry, its collector)
_collectors_lock = threading.Lock()


def register(registry: Any = None) -> DsioCollector:
    """Register the dsio collector into ``registry`` (prometheus-client's default registry when
    None) and return it. Registering into the same registry again returns the same collector."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    with _collectors_lock:
        have = _collectors.get(id(registry))
        if have is not None and have[0] is registry:
            return have[1]
        c = DsioCollector()
        registry.register(c)
        _collectors[id(registry)] = (registry, c)
        return c


def serve(port: int | None = None, addr: str = "127.0.0.1", *, registry: Any = None) -> MetricsServer:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread, loopback by default.

    ``port=None`` is :func:`default_port`: 10464 (or ``DSIO_METRICS_PORT``) plus ``LOCAL_RANK``
    under torchrun, one port per local rank; ``port=0`` picks a free port. Requests are served
    on threads with a listen backlog of :data:`LISTEN_BACKLOG`, so a burst of scrapes is queued,
    not refused. With no ``registry``, a fresh one holding the dsio collector (plus
    prometheus-client's process and platform collectors) is served; pass a registry to serve it
    instead (the dsio collector is registered into it).
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    register(registry)
    return start(registry, port, addr)
