"""Which parts of a state a streamed save has finished reading, in the order its owner will change them.

A training step changes its state piece by piece (an offloaded optimizer steps sub-group after
sub-group). An async save that streams that state must not read a piece after the step changed it,
but the step need not wait for the *whole* save either: only for the pieces it is about to change.

The owner describes what it will change as a *touch order*: a list of touch sets, in the order it
will change them, each a list of spans (`MemorySpan`: bytes of memory, e.g. a slice of an fp32
master; `FileSpan`: bytes of a file, e.g. a sub-group's slot of a swap file). The streamed writer
(`dsio.checkpoint._stream`) then fills its windows in that order (a window holding bytes of touch
set 0 first) and resolves `Capture.future(i)` as soon as every window holding a byte of the state
that overlaps set ``i`` has been read (lazy sources) and copied (in-memory tensors). The owner waits
on that future right before it changes set ``i``.

Memory spans are compared by address, so a tensor saved under two names (an fp32 parameter that is
also the ZeRO master) is covered under both. File spans match `FileRegions` sources by path.

*Stable* sources: a `LazyTensor` whose ``stable`` attribute is true promises that its bytes do not
change while the save reads them, whatever its owner does meanwhile (e.g. dstrain's swap-file
versions pinned copy-on-write). No touch set can overlap one, and `Capture.volatile` -- "the save
no longer reads anything the owner can change" -- resolves once every window holding a byte of an
in-memory tensor or of a non-stable lazy source is filled; those windows are filled before the
windows that hold stable bytes only, so the owner may go on changing its state while the stable
rest still streams.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ._format import TensorEntry
from ._lazy import FileRegions, LazyTensor

__all__ = ["Capture", "FileSpan", "MemorySpan", "TouchOrder", "WindowPlan", "plan_windows"]


@dataclass(frozen=True, slots=True)
class MemorySpan:
    """Bytes ``[ptr, ptr + nbytes)`` of memory (CPU or device addresses) the owner will change."""

    ptr: int
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> MemorySpan:
        """The memory a tensor's elements occupy (from its first to its last element)."""
        if tensor.numel() == 0:
            return cls(tensor.data_ptr(), 0)
        last = sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride(), strict=True))
        return cls(tensor.data_ptr(), (last + 1) * tensor.element_size())


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Bytes ``[offset, offset + nbytes)`` of the file ``path`` the owner will change."""

    path: str
    offset: int
    nbytes: int


TouchOrder = Sequence[Sequence[MemorySpan | FileSpan]]
"""Touch sets in the order their owner will change them."""


class Capture:
    """One future per touch set of a save: resolved once the save no longer needs that set's bytes
    (read into its windows, or the staging ended, successfully or not); `volatile` once it no longer
    reads anything but stable sources; `over` once staging ended. Thread-safe to wait on."""

    def __init__(self, sets: int) -> None:
        self.futures: list[concurrent.futures.Future[None]] = [
            concurrent.futures.Future() for _ in range(sets)
        ]
        self.volatile: concurrent.futures.Future[None] = concurrent.futures.Future()
        """Resolved once every byte of the state its owner can change (in-memory tensors, lazy
        sources that are not ``stable``) is read, or staging ended."""
        self.over: concurrent.futures.Future[None] = concurrent.futures.Future()
        """Resolved once staging ended, successfully or not: the save reads nothing of the state."""

    def __len__(self) -> int:
        return len(self.futures)

    def future(self, index: int) -> concurrent.futures.Future[None]:
        return self.futures[index]

    def resolve(self, index: int) -> None:
        f = self.futures[index]
        if not f.done():
            f.set_result(None)

    def resolve_volatile(self) -> None:
        if not self.volatile.done():
            self.volatile.set_result(None)

    def resolve_all(self) -> None:
        """Staging is over: nothing of the state is read any more."""
        for i in range(len(self.futures)):
            self.resolve(i)
        self.resolve_volatile()
        if not self.over.done():
            self.over.set_result(None)

    def when_over(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once staging is over (at once if it is; on the thread that ends it)."""
        self.over.add_done_callback(lambda _f: fn())


@dataclass(slots=True)
class WindowPlan:
    """The order to fill a streamed file's windows in, and which touch sets each window completes."""

    order: list[int]
    """Window indices (window ``k`` = data bytes ``[k * chunk, (k + 1) * chunk)``), in fill order."""
    sets_of: list[list[int]]
    """Per window: the touch sets holding one of its bytes."""
    remaining: list[int]
    """Per touch set: windows not filled yet (0: resolved at once)."""
    volatile: list[bool]
    """Per window: it holds a byte of an in-memory tensor or of a lazy source that is not stable."""
    volatile_left: int
    """Volatile windows not filled yet."""

    def filled(self, window: int, capture: Capture | None) -> None:
        """Window ``window`` is read and copied: resolve the touch sets it was the last window of,
        and `Capture.volatile` once no volatile window is left."""
        for i in self.sets_of[window]:
            self.remaining[i] -= 1
            if self.remaining[i] == 0 and capture is not None:
                capture.resolve(i)
        if self.volatile[window]:
            self.volatile_left -= 1
        if self.volatile_left == 0 and capture is not None:  # (also: a state with none at all)
            capture.resolve_volatile()


def is_stable(src: torch.Tensor | LazyTensor) -> bool:
    """A lazy source whose bytes cannot change while a save reads them (see the module's text)."""
    return isinstance(src, LazyTensor) and bool(src.stable)


def _memory_extent(t: torch.Tensor) -> tuple[int, int]:
    span = MemorySpan.of(t)
    return span.ptr, span.ptr + span.nbytes


def plan_windows(
    entries: Sequence[TensorEntry],
    sources: Mapping[str, torch.Tensor | LazyTensor],
    chunk_bytes: int,
    data_bytes: int,
    touch_order: TouchOrder | None,
) -> WindowPlan:
    """Map each touch set to the windows holding bytes of the state that overlap it, and order the
    windows by the first touch set needing them, then volatile before stable-only windows, then by
    position (windows that no set needs come after those that one does)."""
    n_win = -(-data_bytes // chunk_bytes) if data_bytes > 0 else 0
    sets = list(touch_order or ())
    sets_of: list[list[int]] = [[] for _ in range(n_win)]
    remaining = [0] * len(sets)
    volatile = [False] * n_win
    for e in entries:
        if e.nbytes and not is_stable(sources[e.name]):
            for w in range(e.begin // chunk_bytes, (e.end - 1) // chunk_bytes + 1):
                volatile[w] = True
    n_volatile = sum(volatile)
    if not sets:
        order = sorted(range(n_win), key=lambda w: (not volatile[w], w))
        return WindowPlan(order, sets_of, remaining, volatile, n_volatile)
    # in-memory tensors by address; FileRegions by (path, file offset)
    mem: list[tuple[int, int, TensorEntry, bool]] = []  # (lo, hi, entry, contiguous)
    files: dict[str, list[tuple[int, int, TensorEntry, int]]] = {}  # path -> (offset, n, entry, at)
    for e in entries:
        src = sources[e.name]
        if not e.nbytes:
            continue
        if isinstance(src, torch.Tensor):
            lo, hi = _memory_extent(src)
            mem.append((lo, hi, e, src.is_contiguous()))
        elif isinstance(src, FileRegions) and not is_stable(src):  # a stable one no set can touch
            at = 0
            for path, off, n in src.regions:
                if n:
                    files.setdefault(os.path.realpath(path), []).append((off, n, e, at))
                at += n
    mem.sort(key=lambda m: m[0])
    mem_lo = [m[0] for m in mem]
    for regions in files.values():
        regions.sort(key=lambda r: r[0])
    file_lo = {p: [r[0] for r in rs] for p, rs in files.items()}
    first_set = [len(sets)] * n_win

    def windows(e: TensorEntry, lo: int, hi: int) -> range:  # entry bytes [lo, hi) -> windows
        return range((e.begin + lo) // chunk_bytes, (e.begin + hi - 1) // chunk_bytes + 1)

    for i, spans in enumerate(sets):
        hit: set[int] = set()
        for s in spans:
            if s.nbytes <= 0:
                continue
            if isinstance(s, MemorySpan):
                a, b = s.ptr, s.ptr + s.nbytes
                # entries starting before b; aliases overlap, so scan them (a state has few entries)
                for lo, hi, e, contiguous in mem[: bisect.bisect_left(mem_lo, b)]:
                    if hi <= a:
                        continue
                    if contiguous:
                        hit.update(windows(e, max(a, lo) - lo, min(b, hi) - lo))
                    else:  # a strided view: conservatively every window of the entry
                        hit.update(windows(e, 0, e.nbytes))
            else:
                path = os.path.realpath(s.path)
                in_file = files.get(path)
                if not in_file:
                    continue
                regions = in_file
                a, b = s.offset, s.offset + s.nbytes
                k = max(0, bisect.bisect_right(file_lo[path], a) - 1)
                while k < len(regions) and regions[k][0] < b:
                    off, n, e, at = regions[k]
                    if off + n > a:
                        hit.update(windows(e, at + max(a, off) - off, at + min(b, off + n) - off))
                    k += 1
        remaining[i] = len(hit)
        for w in hit:
            sets_of[w].append(i)
            first_set[w] = min(first_set[w], i)
    order = sorted(range(n_win), key=lambda w: (first_set[w], not volatile[w], w))
    return WindowPlan(order, sets_of, remaining, volatile, n_volatile)
