"""``torch.save`` records for ``DsioStorageWriter``, serialised straight into its aligned region
(``dsio.checkpoint.dcp``): a counting/copying sink, no zip CRC-32 pass, tensors as stock DCP saves them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .._memory import memcpy

__all__ = ["Sink", "addr", "no_zip_crc32", "savable"]


class Sink:
    """A write-only file for ``torch.save``: counts bytes, or copies them into memory at ``ptr``."""

    def __init__(self, ptr: int = 0, limit: int = -1) -> None:
        self.ptr, self.limit, self.pos = ptr, limit, 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if self.limit >= 0:
            if self.pos + n > self.limit:
                raise RuntimeError("torch.save produced more bytes than it did a moment ago")
            if n:
                memcpy(self.ptr + self.pos, addr(mv), n)
        self.pos += n
        return n

    def flush(self) -> None:
        pass


def addr(mv: memoryview) -> int:
    # torch hands the writer (read-only) views of its own memory: take the address without a copy.
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


@contextlib.contextmanager
def no_zip_crc32() -> Iterator[None]:
    """torch.save without its CRC-32 pass (zlib, ~0.4 GB/s here); every item carries a crc32c."""
    # torch.save imports this module on its first call: imported here, the first save skips it too
    from torch.utils.serialization import config

    prev = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = prev


def savable(t: torch.Tensor) -> torch.Tensor:
    """What stock DCP would save: a CPU tensor whose storage is exactly its elements."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.clone(memory_format=torch.contiguous_format)
    return t
