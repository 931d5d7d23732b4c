"""Probe the kernel backends at run time and open an engine, falling back loudly.

Order for ``backend="auto"``: io_uring, then Linux AIO, then posix worker threads.
Each fallback is logged once per process with the reason. ``DSIO_DISABLE_BACKENDS``
(comma separated) hides backends, so the fallback itself can be exercised.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from dataclasses import dataclass

from ._native import native
from .config import IOConfig
from .errors import BackendUnavailableError

__all__ = ["BackendStatus", "backend_status", "load_native", "open_engine", "warn_once"]

log = logging.getLogger("dsio")
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


load_native = native
"""Alias of :func:`dsio._native.native` (the one module that loads ``dsio._C``)."""


@dataclass(frozen=True, slots=True)
class BackendStatus:
    name: str
    available: bool
    reason: str
    """Why it is unavailable (empty when available)."""


def _disabled() -> set[str]:
    return {b.strip() for b in os.environ.get("DSIO_DISABLE_BACKENDS", "").split(",") if b.strip()}


@functools.cache
def _probe(name: str) -> int:
    """The kernel's answer for one backend (0, or -errno), asked once per process: a probe sets up and
    tears down a ring or an AIO context, ~5 ms and ~30 ms of waiting (``io_destroy`` waits out an RCU
    grace period), and every ``dstrain.initialize`` asks (its checkpoint store). What the kernel allows
    a process does not change under it; an engine that cannot start still falls back in `open_engine`."""
    C = native()
    probes = {"io_uring": C.probe_io_uring, "aio": C.probe_aio}
    return probes[name]() if name in probes else 0


def backend_status() -> list[BackendStatus]:
    """Availability of each kernel backend on this machine, with the reason when unavailable (the
    kernel probed once per process; ``DSIO_DISABLE_BACKENDS`` read at each call)."""
    native()  # raises where the native core is not built, as before the first probe
    out = []
    for name in ("io_uring", "aio", "posix"):
        if name in _disabled():
            out.append(BackendStatus(name, False, "disabled by DSIO_DISABLE_BACKENDS"))
            continue
        rc = _probe(name)
        if rc == 0:
            out.append(BackendStatus(name, True, ""))
        else:
            why = os.strerror(-rc)
            if -rc == errno.ENOSYS:
                why += " (kernel built without it)"
            elif -rc == errno.EPERM:
                why += " (blocked: seccomp, container policy or kernel.io_uring_disabled)"
            out.append(BackendStatus(name, False, why))
    return out


def open_engine(cfg: IOConfig, backend: str | None = None):
    """Create a ``_C.Engine`` for ``cfg``; ``auto`` falls back in order, an explicit backend must work.

    ``backend`` overrides ``cfg.backend`` (the GPU path opens a ``"cufile"`` engine this way)."""
    C = native()
    want = backend or cfg.backend
    names = ["io_uring", "aio", "posix"] if want == "auto" else [want]
    reasons = []
    for name in names:
        if name in _disabled():
            reasons.append(f"{name}: disabled by DSIO_DISABLE_BACKENDS")
            continue
        try:
            engine = C.Engine(
                name,
                cfg.block_size,
                cfg.queue_depth,
                cfg.intra_op_parallelism,
                cfg.single_submit,
                cfg.overlap_events,
            )
        except (RuntimeError, OSError) as e:
            reasons.append(f"{name}: {e}")
            continue
        if reasons:
            warn_once("fallback:" + name, f"dsio: using the {name} backend ({'; '.join(reasons)})")
        return engine
    raise BackendUnavailableError("no I/O backend could start: " + "; ".join(reasons))
