"""Bytes autograd saves for backward during a stage's forwards (the runner's activation-memory counter)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """Counts the bytes of tensors autograd saves for backward (live: freed when the graph is), except the
    parameters themselves (a Linear saves its weight: a reference, not activation memory)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.exclude: set[int] = set()
        """Storage addresses of the module's parameters."""

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self.exclude:
            return _Saved(t, 0, self)
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        return _Saved(t, n, self)

    @staticmethod
    def unpack(s: Any) -> torch.Tensor:
        return s.t


class _Saved:
    __slots__ = ("counter", "n", "t")

    def __init__(self, t: torch.Tensor, n: int, counter: SavedBytes) -> None:
        self.t, self.n, self.counter = t, n, counter

    def __del__(self) -> None:
        self.counter.live -= self.n
