"""The I/O hot path's run-time switches, in one home (as kvikio's ``defaults.py``).

Each is a measured choice with its A/B baseline kept for the benchmarks and tests that compare
them; a user never needs them (what a user tunes is an `IOConfig` field). Read them as
``SWITCHES.<name>`` at the moment of use; change them for a block with `switched`:

    with switched(ring_staging=False):
        ...  # staged reads one request per pool buffer
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["SWITCHES", "Switches", "switched"]


@dataclasses.dataclass(slots=True)
class Switches:
    """The switches (see each field's note for what was measured)."""

    fresh_staged: bool = True
    """A large read whose page-aligned destination is fresh (never touched: ``torch.empty`` of a
    page-aligned size, a new mmap) goes through the staging pool instead of straight into it: the
    kernel then faults the destination in on the engine's copier threads, piece by piece behind
    the disk, instead of inside the O_DIRECT reads (which pin each page first). Quiet machine,
    5 runs x 3 interleaved reps (bench/results/io-read-path-quiet-2026-11-30.md): staged fresh
    reads 1.13-1.17x DeepSpeed's locked read vs 0.91-1.05x read directly with prefaulting."""

    ring_staging: bool = True
    """A staged *read* is one engine request cycling through the pool buffers it could take
    (``Engine.submit_staged``): the workers read each block_size piece into a free staging slot and
    hand it to the engine's copier threads, which copy it out and give the slot to the next piece, so
    neither the event loop nor a copy stands between two submissions. Benchmarks' A/B switch: False
    restores one request per pool buffer.

    Staged *writes* always go one request per pool buffer: each worker copies a piece in just before
    submitting it, and the pool's other buffers are filled (copied ahead) while earlier ones are on
    the disk. The ring was measured slower for writes (quiet, 1 GiB ordinary tensor, new file +
    fsync, 4 interleaved reps: ring 0.92 GB/s vs per-buffer 1.64), so writes do not take it."""

    engine_sums: bool = True
    """A read given `dsio._sums.ReadSums` has its checksums computed by the engine's copier as each
    piece lands (fused with a staged piece's copy out: one pass over the bytes while they are in the
    cache). Benchmarks' and tests' A/B switch: False leaves every fragment to the caller (a
    checkpoint load then checksums each piece after it is read, as before the engine did it)."""

    loop_thread_copy: bool = False
    """Benchmarks' A/B switch only: True restores the earlier staging copies made on the event-loop
    thread (a whole chunk at a time, GIL released, loop blocked) instead of in the engine's workers."""

    hugepages: bool = True
    """A handle's staging pool is on transparent huge pages (``dsio._op`` reads this when it builds
    a handle). Measured for staged reads (issue 17): with 4 KiB pages a pool's read speed depends
    on where its pages landed (1.2-2.0 GB/s across pools of one process, each pool steady);
    huge-page pools ran at the direct path's speed. Why: a request to the disk holds at most
    ``max_segments`` (254 here) physically contiguous pieces of memory, so a 1 MiB slot on scattered
    4 KiB pages cannot merge with its neighbours into the 2-4 MiB requests the device serves best;
    a huge-page slot is one segment. Other pools (``PinnedPool()``) stay on 4 KiB
    pages unless asked: populating fresh huge pages cost 2-4x more here (a 2 GiB region 5-10 s vs
    2-3 s), which large pools would pay at start-up. Benchmarks flip this for their A/B."""


SWITCHES = Switches()
"""The process's switches (read at the moment of use: a change takes effect at the next transfer,
or for ``hugepages`` at the next handle)."""


@contextlib.contextmanager
def switched(**changes: Any) -> Iterator[Switches]:
    """Set some switches for the duration of the block, then restore them."""
    old = {k: getattr(SWITCHES, k) for k in changes}
    for k, v in changes.items():
        setattr(SWITCHES, k, v)
    try:
        yield SWITCHES
    finally:
        for k, v in old.items():
            setattr(SWITCHES, k, v)
