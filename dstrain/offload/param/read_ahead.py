"""`TraceReadAhead`: parameter shard reads run ahead along the order the last pass recorded.

Stage 3 gathers each unit's parameters once per use (forward, then backward), in an order that is
the same from one pass to the next unless the model's control flow changes. `OffloadedShards`
records the order of its shard reads during a pass (from `begin_pass` to the step), adopts it as the
*trace* of the next pass, and keeps one pool buffer reading ahead per future position of that trace.
Each read-ahead is consumed by one gather (or kept for the next, below), so a shard is read at most
once per gather. When the pass
leaves the trace, read-ahead stops and the pass is recorded again; a shard already read ahead is
still used when its unit comes (shards change only at the step).

A shard may take several pool buffers (``cost``: its pieces, when the pool's buffers are smaller than
the largest shard); the read-ahead keeps as many shards queued as their buffers fit ``capacity``.

A gather hands its shard's buffers back through `release`: when the trace reads the same unit again
soon enough that the buffers would be held for that position anyway (the last units of forward are
the first of backward), they are kept, unchanged, as the read for that position (`reused`) instead
of being handed back and the same bytes read again into other buffers. "Soon enough": the reads the
trace needs before that position and the kept buffers fit the capacity together; reads queued for
later positions give way (they are read again when the buffers free). Shards change only at the
step, so a kept buffer holds the values the later gather would read.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from typing import Any

from dstrain.offload.swap.swapper import Lease
from dstrain.zero.units import Unit

__all__ = ["TraceReadAhead"]


Read = concurrent.futures.Future[list[Lease]]
"""A shard's read: its pieces' buffers, in file order."""


class TraceReadAhead:
    """Read-ahead of one store's shards: ``read(unit)`` submits a read, ``discard(leases)`` hands its
    buffers back unused, ``unit_of(index)`` finds a unit, ``capacity()`` is the pool's buffer count
    the read-ahead may hold, ``cost(unit)`` the buffers a read of ``unit`` takes."""

    def __init__(
        self,
        read: Callable[[Unit], Read],
        discard: Callable[[list[Lease]], Any],
        unit_of: Callable[[int], Unit | None],
        capacity: Callable[[], int],
        cost: Callable[[Unit], int] = lambda unit: 1,
        served: Callable[[Unit], bool] = lambda unit: False,
    ) -> None:
        self._read = read
        self._served = served  # the unit's next gather takes its shard from elsewhere: no read ahead
        self._discard = discard
        self._unit_of = unit_of
        self._capacity = capacity
        self._cost = cost
        # (position in `_trace`, unit index, read, its buffers) in consumption order
        self._queue: deque[tuple[int, int, Read, int]] = deque()
        self._soon: deque[Unit] = deque()  # `read_now`'s units not submitted yet
        self._trace: list[int] | None = None  # unit indices of the last whole pass's shard reads
        self._recording: list[int] = []  # this pass's shard reads so far
        self._cursor = 0  # position in `_trace` of the next read a gather will ask for
        self._following = False  # this pass's reads match `_trace` so far
        self._deviated = False
        self._in_pass = False
        self._taken_at: int | None = None  # trace position of the read `take` returned last
        self.reused = 0
        """Reads not made: gathers served by the buffers an earlier gather of the unit kept (`release`)."""

    @property
    def queued(self) -> int:
        """Reads submitted ahead and not consumed yet."""
        return len(self._queue)

    @property
    def in_pass(self) -> bool:
        """Between `begin_pass` and `end_pass` (forward and backward)."""
        return self._in_pass

    @property
    def held(self) -> int:
        """Pool buffers the queued reads take."""
        return sum(e[3] for e in self._queue)

    def cancel(self) -> None:
        """Hand back read-ahead buffers unused (the order changed, or someone else needs the pool):
        every queued read is waited for and its buffers discarded; then the first failure (a read
        that failed, whose buffers are back already, or a discard) is raised."""
        self._soon.clear()
        first: BaseException | None = None
        while self._queue:
            _, _, fut, _ = self._queue.popleft()
            try:
                self._discard(fut.result())
            except BaseException as e:  # the later reads still hold buffers: hand them back too
                first = first or e
        if first is not None:
            raise first

    def end_pass(self) -> None:
        """The step started: reads from now until the next `begin_pass` are off the trace."""
        self._in_pass = False
        self._following = False

    def begin_pass(self) -> None:
        """Adopt the last pass's reads as the trace if it changed, and start reading its first shards."""
        if self._recording and (self._trace is None or self._deviated):
            self._trace = self._recording
        self._recording = []
        self._deviated = False
        self._in_pass = True
        self.cancel()  # nothing is queued between passes; a pass cut short may leave some
        self._cursor = 0
        self._following = self._trace is not None
        self.top_up()

    def _skip(self, pos: int) -> int:
        """The first position >= ``pos`` of the trace whose unit will really be read (a persistent
        unit that stays gathered is read once, in the first pass only)."""
        assert self._trace is not None
        while pos < len(self._trace):
            unit = self._unit_of(self._trace[pos])
            if unit is not None and not (unit.persistent and unit.gathered) and not self._served(unit):
                break
            pos += 1
        return pos

    def first(self) -> Unit | None:
        """The unit whose shard the next pass reads first (the trace `begin_pass` will adopt), None
        before a pass was recorded."""
        trace = (
            self._recording if self._recording and (self._trace is None or self._deviated) else self._trace
        )
        for index in trace or ():
            unit = self._unit_of(index)
            if unit is not None and not (unit.persistent and unit.gathered):
                return unit
        return None

    def passed(self, unit: Unit) -> None:
        """``unit``'s gather took its shard from elsewhere, without a read (it is no longer
        ``served``): record it and move past its trace position."""
        if self._in_pass:
            self._recording.append(unit.index)
        if self._following and self._trace is not None:
            self._cursor = self._skip(self._cursor)
            if self._cursor < len(self._trace) and self._trace[self._cursor] == unit.index:
                self._cursor += 1
            else:
                self._following = False
                self._deviated = True

    def top_up(self) -> None:
        """Keep reads submitted for the next trace positions, as many as their buffers fit (off the
        trace: the rest of `read_now`'s units)."""
        if self._soon:
            self._read_soon()
        if not self._following or self._trace is None:
            return
        queued = {e[0] for e in self._queue}  # (buffers kept by `release` may be ahead of a gap)
        units = {e[1] for e in self._queue}
        pos, held, room = self._cursor, self.held, self._capacity()
        while True:
            pos = self._skip(pos)
            if pos >= len(self._trace):
                break
            index = self._trace[pos]
            # a unit queued for an earlier position: that gather keeps its buffers for this one
            if pos not in queued and index not in units:
                unit = self._unit_of(index)
                assert unit is not None
                cost = self._cost(unit)
                if held + cost > room:
                    break
                self._insert((pos, unit.index, self._read(unit), cost))
                units.add(index)
                held += cost
            pos += 1

    def _insert(self, entry: tuple[int, int, Read, int]) -> None:
        """Queue ``entry`` in trace-position order (the order gathers consume them)."""
        at = next((i for i, e in enumerate(self._queue) if e[0] > entry[0]), len(self._queue))
        self._queue.insert(at, entry)

    def release(self, unit: Unit, leases: list[Lease]) -> None:
        """A gather is done with ``unit``'s shard in ``leases`` (from `take`): keep them as the read
        of the unit's next trace position if the trace's reads up to it fit with them (see the
        module's docstring), else hand them back."""
        at, self._taken_at = self._taken_at, None
        nxt = self._next_position(unit, at)
        if nxt is None:
            self._discard(leases)
            return
        # what the trace holds up to ``nxt`` if these buffers stay: the reads queued before it and
        # those still to submit (a unit once: its gather keeps the buffers for its next position)
        room = self._capacity()
        before = [e for e in self._queue if e[0] < nxt]
        need = self._cost(unit) + sum(e[3] for e in before)
        seen = {unit.index, *(e[1] for e in before)}
        assert self._trace is not None
        pos = self._cursor
        while need <= room:
            pos = self._skip(pos)
            if pos >= nxt:
                break
            if self._trace[pos] not in seen:
                seen.add(self._trace[pos])
                other = self._unit_of(self._trace[pos])
                need += self._cost(other) if other is not None else 0
            pos += 1
        if need > room:
            self._discard(leases)
            return
        done: Read = _Kept()
        done.set_result(leases)
        self._insert((nxt, unit.index, done, self._cost(unit)))
        while self.held > room and self._queue[-1][0] > nxt:  # later reads give way
            self._discard(self._queue.pop()[2].result())

    def _next_position(self, unit: Unit, at: int | None) -> int | None:
        """The trace position after ``at`` where ``unit`` is read again in this pass, None if none (or
        off the trace)."""
        if at is None or not self._following or self._trace is None or not self._in_pass:
            return None
        for pos in range(max(at + 1, self._cursor), len(self._trace)):
            if self._trace[pos] == unit.index and self._skip(pos) == pos:
                return pos if not any(e[0] == pos for e in self._queue) else None
        return None

    def will_read(self, unit: Unit) -> bool:
        """Whether a gather of this pass is still to read ``unit``'s shard (the pass follows the
        recorded order and the unit comes again at or after the next position)."""
        if not self._following or self._trace is None:
            return False
        return unit.index in self._trace[self._cursor :]

    def read_now(self, units: list[Unit]) -> None:
        """Read ``units`` ahead, off the trace, in this order (the step's refresh of the units that
        stay gathered asks for them next, one by one): as many at once as the capacity holds, the
        rest as `take` frees buffers (`top_up`); `take` finds them."""
        self._soon.extend(units)
        self._read_soon()

    def _read_soon(self) -> None:
        held, room = self.held, self._capacity()
        while self._soon:
            cost = self._cost(self._soon[0])
            if held + cost > room:
                break
            unit = self._soon.popleft()
            self._queue.append((-1, unit.index, self._read(unit), cost))
            held += cost

    def take(self, unit: Unit) -> Read:
        """The read of ``unit``'s shard for the gather now asking for it: the read-ahead at this
        trace position, else one already queued for the unit, else a new read (in a buffer freed by
        giving up the furthest read-ahead). Records the read in this pass's order."""
        if self._in_pass:
            self._recording.append(unit.index)
        self._taken_at = None
        if self._following and self._trace is not None:
            self._cursor = self._skip(self._cursor)
            if self._cursor < len(self._trace) and self._trace[self._cursor] == unit.index:
                fut = None
                if self._queue and self._queue[0][0] == self._cursor:
                    fut = self._queue.popleft()[2]
                self._taken_at = self._cursor
                self._cursor += 1
                if fut is not None:
                    return self._counted(fut)
            else:  # the model took another path: stop reading ahead, re-record this pass
                self._following = False
                self._deviated = True
        # off the trace (the order changed): a shard already read ahead is still valid (shards
        # change only at the step) and is used; else it is read now
        hit = next((e for e in self._queue if e[1] == unit.index), None)
        if hit is not None:
            self._queue.remove(hit)
            return self._counted(hit[2])
        cost = self._cost(unit)
        while self._queue and self.held + cost > self._capacity():
            self._discard(self._queue.pop()[2].result())
        return self._read(unit)

    def _counted(self, fut: Read) -> Read:
        if isinstance(fut, _Kept):
            self.reused += 1
        return fut


class _Kept(concurrent.futures.Future[list[Lease]]):
    """A read not made: buffers a gather kept for the unit's next position (`TraceReadAhead.release`)."""
