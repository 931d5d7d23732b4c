"""Per-instruction timeline of one stage's last batch: where a pipeline step's time goes.

Off by default (``runner.trace = True`` turns it on; a disabled recorder costs one attribute test per
instruction). Each event is one schedule instruction (its `Op` value and micro-batch) or one end-of-batch phase
(``"status"``: the batch-status all-reduce, ``"drain"``: waiting on the last sends, ``"reduce_tied"``,
``"step"``: the engine's boundary step), with start and end in seconds since the batch began. Receive
instructions include their wait, so a stage's idle time is visible as long ``RecvActivation`` /
``RecvGrad`` events; send instructions only post (their cost is the post itself).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Timeline", "TimelineEvent"]


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One instruction or phase of a batch on one stage."""

    what: str
    """An `Op` value (e.g. ``"ForwardPass"``) or a phase: ``"status"``, ``"drain"``, ``"reduce_tied"``,
    ``"step"``."""
    micro_batch: int | None
    start: float
    """Seconds since the batch started."""
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    """Records the events of the current batch (when ``enabled``); keeps the last finished batch."""

    def __init__(self) -> None:
        self.enabled = False
        self._t0 = 0.0
        self._events: list[TimelineEvent] = []
        self._last: tuple[TimelineEvent, ...] = ()

    def begin(self) -> None:
        """A batch starts: forget the events of the unfinished one, if any."""
        self._t0 = time.perf_counter()
        self._events = []

    def add(self, what: str, micro_batch: int | None, start: float, end: float) -> None:
        """Record ``what`` between ``start`` and ``end`` (``time.perf_counter()`` values)."""
        self._events.append(TimelineEvent(what, micro_batch, start - self._t0, end - self._t0))

    def finish(self) -> None:
        """The batch ended (successfully or not): its events become `last`."""
        self._last = tuple(self._events)
        self._events = []

    @property
    def last(self) -> tuple[TimelineEvent, ...]:
        """Events of the last finished batch, in order."""
        return self._last
