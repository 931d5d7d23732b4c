"""``dstrain_`` Prometheus metrics, read from `Engine.statistics()` snapshots at scrape time.

The training hot path never touches prometheus-client: the collector calls ``statistics()`` only
when scraped. ``dsio.metrics.serve(port)`` (or prometheus-client's own ``start_http_server``) exposes
the registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dstrain.engine import Engine

__all__ = ["EngineCollector", "register"]


class EngineCollector:
    """A prometheus-client collector for one engine (labelled with its rank)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.statistics()
        rank = str(self.engine.comm.rank)

        def counter(name: str, doc: str, value: float, **labels: str) -> Any:
            m = CounterMetricFamily(name, doc, labels=["rank", *labels])
            m.add_metric([rank, *labels.values()], value)
            return m

        def gauge(name: str, doc: str, value: float) -> Any:
            m = GaugeMetricFamily(name, doc, labels=["rank"])
            m.add_metric([rank], value)
            return m

        yield counter("dstrain_steps", "Optimizer steps attempted", s.global_steps)
        yield counter("dstrain_skipped_steps", "Steps skipped on fp16 overflow", s.skipped_steps)
        yield counter("dstrain_micro_steps", "Forward/backward micro-steps", s.micro_steps)
        yield counter("dstrain_samples", "Samples processed by this rank", s.samples)
        phase = CounterMetricFamily(
            "dstrain_phase_seconds", "Time per training phase", labels=["rank", "phase"]
        )
        for name, value in (
            ("forward", s.forward_seconds),
            ("backward", s.backward_seconds),
            ("step", s.step_seconds),
        ):
            phase.add_metric([rank, name], value)
        yield phase
        yield gauge("dstrain_last_step_seconds", "Wall time of the last optimizer step", s.last_step_seconds)
        yield gauge("dstrain_loss_scale", "Current fp16 loss scale", s.loss_scale)
        comm_bytes = CounterMetricFamily(
            "dstrain_comm_bytes", "Bytes sent into collectives", labels=["rank", "op"]
        )
        comm_calls = CounterMetricFamily("dstrain_comm_calls", "Collectives issued", labels=["rank", "op"])
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            comm_bytes.add_metric([rank, op], getattr(s.comm, f"{op}_bytes"))
            comm_calls.add_metric([rank, op], getattr(s.comm, f"{op}_calls"))
        yield comm_bytes
        yield comm_calls
        yield counter("dstrain_comm_wait_seconds", "Time blocked on collectives", s.comm.wait_seconds)
        yield gauge(
            "dstrain_resident_param_elements",
            "Parameter elements held by this rank",
            s.zero.resident_param_numel,
        )


def register(engine: Engine, registry: Any = None) -> EngineCollector:
    """Register a collector for ``engine`` with ``registry`` (default: prometheus-client's global one)."""
    from prometheus_client import REGISTRY

    collector = EngineCollector(engine)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
