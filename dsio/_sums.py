"""Checksums computed by the engine while a read's bytes arrive (``AsyncFile.pread(..., sums=)``).

A reader that will checksum what it reads (a checkpoint load verifying crc32c) names the byte
ranges it wants checksummed as *fragments*: sorted file offsets ``cuts``, fragment ``j`` being
``[cuts[j], cuts[j + 1])``. The engine's copier computes the crc32c of every fragment lying wholly
inside one piece of the read (block_size bytes of the request, read in full), right when the piece
lands: a staged piece is checksummed and copied out in one pass over it (each 64 KiB step's crc32c,
then its copy, from the cache), a piece read straight into the caller's memory (O_DIRECT, or
buffered) is checksummed there. So the checksums cost no second pass over memory that is no longer
in any cache, and they overlap the disk like the copies do.

What the engine does not mark (a fragment straddling two pieces, one in a piece that failed or came
back short, every fragment on a CPU without a crc32c instruction: `engine_sums`) the caller
checksums itself: `values` gives None for them. A fragment is marked only after its bytes were read, so
once the read is over the values are final.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._native import native
from ._tuning import SWITCHES

__all__ = ["ReadSums", "engine_sums"]

_DONE = 1 << 32


def engine_sums() -> bool:
    """Whether reads given `ReadSums` have them computed by the engine here: the CPU has a crc32c
    instruction (AVX-512 folds or SSE4.2) and ``SWITCHES.engine_sums`` is on."""
    return SWITCHES.engine_sums and bool(native().crc32c_hw_supported())


class ReadSums:
    """The fragments of a read (``cuts``: strictly increasing file offsets, at least two) and their
    crc32c as the engine computes them. Keep it alive until the read is over (the read does)."""

    __slots__ = ("cuts", "_cuts", "_out")

    def __init__(self, cuts: Sequence[int]) -> None:
        if len(cuts) < 2 or any(b <= a for a, b in zip(cuts, cuts[1:])) or cuts[0] < 0:
            raise ValueError("cuts must be at least two strictly increasing non-negative offsets")
        self.cuts = list(cuts)
        self._cuts = torch.tensor(self.cuts, dtype=torch.int64)  # read by the engine as uint64
        self._out = torch.zeros(len(self.cuts) - 1, dtype=torch.int64)

    @property
    def engine_args(self) -> tuple[int, int, int]:
        """``(sum_cuts, sum_ncuts, sum_out)`` for ``Engine.submit`` / ``submit_staged``; ``(0, 0, 0)``
        where the engine does not checksum (`engine_sums`)."""
        if not engine_sums():
            return 0, 0, 0
        return self._cuts.data_ptr(), len(self.cuts), self._out.data_ptr()

    def values(self, start: int = 0, stop: int | None = None) -> list[int | None]:
        """Fragments ``start:stop``'s crc32c as the engine computed them, None where it did not (yet)."""
        return [v & 0xFFFFFFFF if v & _DONE else None for v in self._out[start:stop].tolist()]
