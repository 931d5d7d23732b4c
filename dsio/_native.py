"""The one face of dsio's native core (``dsio._C``, built from ``csrc/``).

No other module imports ``dsio._C``: they call :func:`native` (or use the lazy :data:`C`
proxy) at the moment they need it, so ``import dsio`` -- configs, errors, statistics
types, the checkpoint format, dstrain on a machine without a compiler -- works where the
native core is not built. The first real use then raises :class:`~dsio.BackendUnavailableError`
naming what is missing, instead of an ``ImportError`` at import time.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from .errors import BackendUnavailableError

__all__ = ["C", "available", "native"]

_module: ModuleType | None = None
_error: ImportError | None = None
_lock = threading.Lock()


def native() -> ModuleType:
    """The loaded ``dsio._C`` module, imported on first call.

    Raises :class:`~dsio.BackendUnavailableError` (every call, with the original reason) when
    the native core is not built or cannot load.
    """
    global _module, _error
    mod = _module
    if mod is not None:
        return mod
    with _lock:
        if _module is None and _error is None:
            try:
                from . import _C
            except ImportError as e:
                _error = e
            else:
                _module = _C
    if _module is None:
        raise BackendUnavailableError(
            f"dsio's native core (dsio._C) is not available: {_error}. "
            "Build it with `pip install .` or `make setup` (needs g++ and Python headers)."
        ) from _error
    return _module


def available() -> bool:
    """Whether the native core loads here (never raises)."""
    try:
        native()
    except BackendUnavailableError:
        return False
    return True


class _LazyNative:
    """``C.name`` is ``native().name``: a module-like handle that loads the core on first attribute."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(native(), name)

    def __repr__(self) -> str:
        return f"<dsio native core ({'loaded' if _module is not None else 'not loaded'})>"


C: Any = _LazyNative()
"""Lazy stand-in for the ``dsio._C`` module: attribute access loads the core."""
