"""Host memory from the native core: page-aligned (and page-locked) buffers, and copies between raw
addresses. Every dsio module that needs either asks here, so the core's memory face is one module
(as kvikio's ``buffer.py`` is over its ``_lib.buffer``)."""

from __future__ import annotations

from typing import Any

import torch

from ._native import native

__all__ = ["aligned_buffer", "locked_tensor", "memcpy"]


def aligned_buffer(nbytes: int, *, lock: bool = True, hugepage: bool = False) -> Any:
    """A new ``nbytes`` region, 4096-aligned, ``mlock``ed when ``lock`` (check ``.locked``: a failed
    lock leaves it unlocked with ``.lock_errno``), on transparent huge pages when ``hugepage``. It
    is freed when the object goes; it exposes the buffer protocol, ``.ptr`` and ``.nbytes``."""
    return native().AlignedBuffer(nbytes, lock, hugepage)


def locked_tensor(
    nbytes: int, *, lock: bool = True, dtype: torch.dtype = torch.uint8, count: int = -1
) -> tuple[torch.Tensor, Any]:
    """A CPU tensor over a new `aligned_buffer` (``count`` elements of ``dtype``; -1: all of it),
    and the buffer, which the caller keeps as long as the tensor is used."""
    mem = aligned_buffer(nbytes, lock=lock)
    return torch.frombuffer(mem, dtype=dtype, count=count), mem


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst`` (the GIL released: copier threads run it)."""
    native().memcpy(dst, src, nbytes)
