"""`SlotTable`: where each slot of a swap file lives now, and copy-on-write versions pinned by saves.

A swapper's slot (one key's bytes, e.g. a sub-group's Adam m and v) lives in a page-aligned region
of the swap file. An async checkpoint save reads the state *as it was at save time* while training
goes on, so it pins (`SlotTable.pin`) the version of every slot current at that moment: a cheap
reference (offset, size), no copy. A later write of a pinned key goes to another region of the
same size (a spare one when there is one, else the file grows); reads by the training step always
go to the key's current region, so the step never waits for the save, and the save keeps reading
the pinned regions. When
the save is over it releases its pin (`SwapPin.release`): regions no longer current and no longer
pinned become spares, reused by the next relocation.

Disk use: the file grows by at most the bytes pinned by saves in flight at once (one save pins at
most the whole optimizer state: the file can double while it streams); spares are reused, so
sequential saves do not grow the file further.

All decisions (where a read or a write goes, what a pin holds) are made when the transfer is
*submitted*, under one lock, in the caller's order; so a pin taken after a write was submitted
holds that write's version, and a read submitted after a write reads that write's region. A region
with a transfer in flight is never handed out as a spare (a late write to an old version cannot
land on top of a new one).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["SlotTable", "SlotTableStatistics", "SwapPin"]


@dataclass(frozen=True, slots=True)
class SlotTableStatistics:
    """Copy-on-write counters of one swap file."""

    pins: int
    """Pins not yet released (saves reading versions of this file)."""
    pinned_bytes: int
    """Bytes of the regions those pins hold (each region counted once)."""
    relocated_bytes: int
    """Bytes written to another region because their key's region was pinned (over the file's life)."""
    relocations: int
    """Writes sent to another region because the key's region was pinned."""
    spare_bytes: int
    """Regions of the file free for the next relocation."""
    grown_bytes: int
    """Bytes the file grew by beyond its reserved slots and regions (relocations with no spare)."""


class SwapPin:
    """The versions of a swap file's slots current when the pin was taken (`SlotTable.pin`).

    ``locations[key]`` is ``(offset, bytes)`` of the key's pinned region of ``path``; those bytes
    do not change until `release`. Release exactly once when done (success, failure or cancel);
    further calls do nothing. Thread-safe."""

    __slots__ = ("_table", "locations", "path")

    def __init__(self, table: SlotTable, path: str, locations: dict[Hashable, tuple[int, int]]) -> None:
        self._table: SlotTable | None = table
        self.path = path
        self.locations = locations

    def region(self, key: Hashable) -> tuple[str, int, int]:
        """``(path, offset, bytes)`` of ``key``'s pinned version."""
        offset, size = self.locations[key]
        return self.path, offset, size

    @property
    def released(self) -> bool:
        return self._table is None

    def release(self) -> None:
        """Let the pinned regions go (spares once no longer current). Idempotent."""
        table, self._table = self._table, None
        if table is not None:
            table._release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"SwapPin({self.path!r}, {len(self.locations)} slots, {state})"


class SlotTable:
    """Slots (fixed-size keys that may move) and regions (fixed file ranges) of one swap file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._slots: dict[Hashable, tuple[int, int]] = {}
        self._end = 0
        self._grown = 0  # bytes added by relocations that found no spare
        self._pinned: dict[int, int] = {}  # region offset -> pins holding it
        self._owner: dict[int, Hashable] = {}  # pinned region offset -> its key
        self._spare: dict[int, list[int]] = {}  # size -> free region offsets
        self._busy: dict[int, int] = {}  # region offset -> transfers in flight
        self._pins: set[SwapPin] = set()
        self._relocations = 0
        self._relocated_bytes = 0

    # -- layout -------------------------------------------------------------------------------

    @property
    def end(self) -> int:
        """The file's size in bytes (reserved slots and regions, plus relocations)."""
        return self._end

    def reserve(self, key: Hashable, size: int) -> int:
        """A slot of ``size`` bytes (already page-aligned) for ``key``; returns its offset."""
        with self._lock:
            if key in self._slots:
                raise KeyError(f"slot {key!r} is already reserved")
            offset = self._grow(size)
            self._slots[key] = (offset, size)
            return offset

    def reserve_region(self, size: int) -> int:
        """A fixed region of ``size`` bytes (page-aligned): never pinned, never moved."""
        with self._lock:
            return self._grow(size)

    def _grow(self, size: int) -> int:
        self._end += size
        return self._end - size

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def size(self, key: Hashable) -> int:
        return self._slots[key][1]

    def current(self, key: Hashable) -> tuple[int, int]:
        """``(offset, bytes)`` of ``key``'s current version."""
        return self._slots[key]

    # -- transfers ----------------------------------------------------------------------------

    def for_read(self, key: Hashable) -> tuple[int, int]:
        """Where a read of ``key`` submitted now goes (its current version); counted in flight
        until `done`."""
        with self._lock:
            offset, size = self._slots[key]
            self._busy[offset] = self._busy.get(offset, 0) + 1
            return offset, size

    def for_write(self, key: Hashable) -> tuple[int, int]:
        """Where a write of ``key`` submitted now goes: its current region, or, when a pin holds
        that version, another region (which becomes current); counted in flight until `done`."""
        with self._lock:
            offset, size = self._slots[key]
            if self._pinned.get(offset):
                offset = self._take_spare(size)
                self._slots[key] = (offset, size)
                self._relocations += 1
                self._relocated_bytes += size
            self._busy[offset] = self._busy.get(offset, 0) + 1
            return offset, size

    def done(self, offset: int) -> None:
        """A transfer counted by `for_read` / `for_write` at ``offset`` finished (or never ran)."""
        with self._lock:
            left = self._busy[offset] - 1
            if left:
                self._busy[offset] = left
            else:
                del self._busy[offset]

    def _take_spare(self, size: int) -> int:
        free = self._spare.get(size, [])
        for i, offset in enumerate(free):
            if offset not in self._busy:  # an old version's transfer may still be in flight
                free.pop(i)
                return offset
        self._grown += size
        return self._grow(size)

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, keys: Iterable[Hashable] | None = None) -> SwapPin:
        """Hold the current version of ``keys`` (every slot by default) until the pin is released."""
        with self._lock:
            wanted = list(self._slots) if keys is None else list(keys)
            locations = {k: self._slots[k] for k in wanted}
            for k, (offset, _) in locations.items():
                self._pinned[offset] = self._pinned.get(offset, 0) + 1
                self._owner[offset] = k
            pin = SwapPin(self, self.path, locations)
            self._pins.add(pin)
            return pin

    def _release(self, pin: SwapPin) -> None:
        with self._lock:
            if pin not in self._pins:
                return  # released by `release_all` (the swapper closed)
            self._pins.discard(pin)
            for k, (offset, size) in pin.locations.items():
                left = self._pinned[offset] - 1
                if left:
                    self._pinned[offset] = left
                    continue
                del self._pinned[offset]
                del self._owner[offset]
                if self._slots[k][0] != offset:  # an old version: free for the next relocation
                    self._spare.setdefault(size, []).append(offset)

    def release_all(self) -> int:
        """Release every pin (the file is going away); returns how many were held."""
        with self._lock:
            pins = list(self._pins)
        for pin in pins:
            pin.release()
        return len(pins)

    def statistics(self) -> SlotTableStatistics:
        with self._lock:
            sizes = {off: self._slots[k][1] for off, k in self._owner.items()}
            return SlotTableStatistics(
                pins=len(self._pins),
                pinned_bytes=sum(sizes.values()),
                relocated_bytes=self._relocated_bytes,
                relocations=self._relocations,
                spare_bytes=sum(size * len(offs) for size, offs in self._spare.items()),
                grown_bytes=self._grown,
            )
