"""``dstrain_`` Prometheus metrics, exported by dsio's one metrics mechanism.

The engine is registered as a *source* of :mod:`dsio.metrics` (``track(engine, describe=...)``):
at scrape time dsio's collector reads ``Engine.statistics()`` and :func:`samples` turns the
snapshot into named values. The training hot path never touches prometheus-client, and dsio's
exporter (``dsio.metrics.serve()``, one port per local rank) serves dsio's and dstrain's
families together.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dsio.metrics import Sample, track

if TYPE_CHECKING:
    from dstrain.engine import Engine, EngineStatistics

__all__ = ["register", "samples"]

_COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def samples(s: EngineStatistics, rank: int) -> Iterator[Sample]:
    """The ``dstrain_*`` values of one engine snapshot, labelled with the rank."""
    r = {"rank": str(rank)}

    def counter(name: str, doc: str, value: float, **labels: str) -> Sample:
        return Sample(name, "counter", float(value), doc, {**r, **labels})

    def gauge(name: str, doc: str, value: float) -> Sample:
        return Sample(name, "gauge", float(value), doc, r)

    yield counter("dstrain_steps", "Optimizer steps attempted", s.global_steps)
    yield counter("dstrain_skipped_steps", "Steps skipped on fp16 overflow", s.skipped_steps)
    yield counter("dstrain_micro_steps", "Forward/backward micro-steps", s.micro_steps)
    yield counter("dstrain_samples", "Samples processed by this rank", s.samples)
    for phase, value in (
        ("forward", s.forward_seconds),
        ("backward", s.backward_seconds),
        ("step", s.step_seconds),
    ):
        yield counter("dstrain_phase_seconds", "Time per training phase", value, phase=phase)
    yield gauge("dstrain_last_step_seconds", "Wall time of the last optimizer step", s.last_step_seconds)
    yield gauge("dstrain_loss_scale", "Current fp16 loss scale", s.loss_scale)
    # the training series (what the monitors write as Train/Samples/*)
    yield gauge("dstrain_loss", "Mean loss of the last optimizer step's micro-steps", s.last_loss)
    for group, lr in enumerate(s.lr):
        yield Sample("dstrain_lr", "gauge", float(lr), "Learning rate", {**r, "group": str(group)})
    yield gauge(
        "dstrain_grad_norm",
        "Global gradient norm of the last step (nan unless clipping or fp16)",
        s.last_grad_norm,
    )
    yield counter("dstrain_tokens", "Tokens processed by this rank", s.tokens)
    yield gauge("dstrain_tokens_per_second", "Tokens of the last step / its wall time", s.tokens_per_second)
    yield gauge(
        "dstrain_model_flops_per_step", "Model FLOPs per step (flops profiler)", s.model_flops_per_step
    )
    yield gauge("dstrain_mfu", "Model FLOPs utilisation of the last step (flops profiler)", s.mfu)
    for op in _COMM_OPS:
        yield counter(
            "dstrain_comm_bytes", "Bytes sent into collectives", getattr(s.comm, f"{op}_bytes"), op=op
        )
        yield counter("dstrain_comm_calls", "Collectives issued", getattr(s.comm, f"{op}_calls"), op=op)
    c = s.comm
    yield counter(
        "dstrain_comm_bytes",
        "Bytes sent into collectives",
        c.compressed_wire_bytes,
        op="compressed_all_reduce",
    )
    yield counter("dstrain_comm_calls", "Collectives issued", c.compressed_calls, op="compressed_all_reduce")
    yield counter(
        "dstrain_comm_compressed_fp32_bytes",
        "Bytes fp32 all-reduces would have sent in place of the compressed ones (1-bit / 0-1 Adam)",
        c.compressed_fp32_bytes,
    )
    yield counter("dstrain_comm_wait_seconds", "Time blocked on collectives", s.comm.wait_seconds)
    yield gauge(
        "dstrain_resident_param_elements", "Parameter elements held by this rank", s.zero.resident_param_numel
    )


def register(engine: Engine, registry: Any = None) -> Any:
    """Export ``engine``'s statistics through dsio's collector (held weakly, live values only),
    and make sure that collector is registered in ``registry`` (default: prometheus-client's
    global one; ``dsio.metrics.serve()`` serves its own registry, which already has it).
    Returns the collector."""
    from dsio import metrics

    rank = int(engine.comm.rank)
    track(engine, kind="engine", namespace="dstrain", describe=lambda snap: samples(snap, rank))
    return metrics.register(registry)
