"""``dstrain_`` Prometheus metrics, exported by dsio's one metrics mechanism.

The engine is registered as a *source* of :mod:`dsio.metrics` (``track(engine, describe=...)``):
at scrape time dsio's collector reads ``Engine.statistics()`` and :func:`samples` turns the
snapshot into named values. The training hot path never touches prometheus-client, and dsio's
exporter (``dsio.metrics.serve()``, one port per local rank) serves dsio's and dstrain's
families together.

Every series carries ``rank`` and ``engine``: one process may train several engines at once (a
GAN's generator and discriminator, an evaluation copy), and a value of one engine is never added
to another's (two engines' losses or learning rates summed mean nothing). ``engine`` is the name
given to `register`, else the smallest number (``"0"``, ``"1"``, ...) that no other open registered
engine of the process holds: a process with one engine exports ``engine="0"``, and so does the
next engine once the first is closed. `Engine.close` stops the export at once; an engine dropped
without ``close()`` is exported until it is garbage-collected (dsio's registry holds it weakly).
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dsio.metrics import Sample, track

if TYPE_CHECKING:
    from dstrain.engine import Engine, EngineStatistics

__all__ = ["labels", "register", "samples"]

_COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def samples(s: EngineStatistics, rank: int, engine: str = "0") -> Iterator[Sample]:
    """The ``dstrain_*`` values of one engine snapshot, labelled with the rank and the engine's name."""
    r = {"rank": str(rank), "engine": engine}

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


_names: dict[str, weakref.ref[Engine]] = {}  # engine label -> the registered engine holding it
_names_lock = threading.Lock()


def _holder(name: str) -> Engine | None:
    """The open engine registered under ``name``, if any (a closed or collected one holds no name)."""
    ref = _names.get(name)
    engine = ref() if ref is not None else None
    if engine is None or engine.closed:
        _names.pop(name, None)
        return None
    return engine


def _name_of(engine: Engine) -> str | None:
    return next((n for n, ref in list(_names.items()) if ref() is engine and _holder(n) is engine), None)


def register(engine: Engine, registry: Any = None, *, name: str | None = None) -> Any:
    """Export ``engine``'s statistics through dsio's collector (held weakly, live values only, until
    `Engine.close`), and make sure that collector is registered in ``registry`` (default:
    prometheus-client's global one; ``dsio.metrics.serve()`` serves its own registry, which already
    has it). Returns the collector.

    ``name`` is the ``engine`` label of its series (a Prometheus label value: letters, digits, ``_``,
    ``-``, ``.``); by default the smallest number no other open registered engine holds (see the
    module's docstring, and `labels`). Registering an engine again keeps its name. Raises
    ValueError for a closed engine, a name another open engine holds, or a second, other name."""
    from dsio import metrics

    if engine.closed:
        raise ValueError("the engine is closed: it has no statistics to export")
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"name must be letters, digits, '_', '-' or '.', got {name!r}")
    with _names_lock:
        have = _name_of(engine)
        if have is not None and name is not None and name != have:
            raise ValueError(f"the engine is already registered as engine={have!r}, not {name!r}")
        label = have if have is not None else name
        if label is None:
            label = next(str(i) for i in range(len(_names) + 1) if _holder(str(i)) is None)
        elif have is None and _holder(label) is not None:
            raise ValueError(f"another open engine is registered as engine={label!r}")
        _names[label] = weakref.ref(engine)
        rank = int(engine.comm.rank)
        track(engine, kind="engine", namespace="dstrain", describe=lambda snap: samples(snap, rank, label))
    return metrics.register(registry)


def labels(engine: Engine) -> dict[str, str]:
    """The labels of ``engine``'s ``dstrain_*`` series (``rank`` and ``engine``), e.g. for
    ``registry.get_sample_value("dstrain_steps_total", labels(engine))``. Raises KeyError if it is
    not registered (or closed)."""
    with _names_lock:
        name = _name_of(engine)
    if name is None:
        raise KeyError("the engine is not registered (dstrain.metrics.register), or is closed")
    return {"rank": str(int(engine.comm.rank)), "engine": name}
