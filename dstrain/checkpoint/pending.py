"""`PendingSave`: a checkpoint save in flight, as the engine sees it.

A background save returns at once; the engine calls `PendingSave.wait_staged` (or, sub-group by
sub-group through an offloading stepper, `PendingSave.wait_captured`) before it changes what the save
still reads, and `PendingSave.wait` (collective) to have the step committed.

What the save "still reads" excludes *stable* sources (swap-file versions pinned copy-on-write,
``dstrain.checkpoint.sources``): once everything else is captured (``Capture.volatile``), training
goes on while the save keeps streaming the pinned versions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsio.checkpoint import Capture

__all__ = ["PendingSave"]


class PendingSave:
    """A save in flight: `wait_staged` (local) until its state may change, `wait` (collective) until
    it is committed; `wait` returns this rank's committed file."""

    def __init__(
        self,
        path: Path,
        finish: Callable[[], Path],
        staged: Callable[[], float] | None = None,
        capture: Capture | None = None,
    ) -> None:
        self.path = path
        """Where this rank's file will be once committed."""
        self._finish: Callable[[], Path] | None = finish
        self._staged = staged
        self._capture = capture if staged is not None else None
        self._result: Path | None = None
        self._unreported = 0.0
        self.blocked_seconds = 0.0
        """Time `wait_staged` and `wait_captured` blocked their caller."""
        self.gate_seconds = 0.0
        """The part of it `wait_captured` waited (a step waiting, piece by piece, for the save to read
        what it is about to change)."""

    @property
    def gated(self) -> bool:
        """Staging is still running and reports its progress per touch set (`wait_captured`)."""
        return self._staged is not None and self._capture is not None and len(self._capture) > 0

    def wait_captured(self, index: int) -> float:
        """Block until the save no longer reads touch set ``index`` of the touch order it was given
        (``dsio.checkpoint.Checkpointer.save``); returns the seconds waited. Errors stay with `wait`."""
        if self._capture is None or index >= len(self._capture):
            return self.wait_staged()
        fut = self._capture.future(index)
        if fut.done():
            return 0.0
        t0 = time.perf_counter()
        fut.result()
        waited = time.perf_counter() - t0
        self.blocked_seconds += waited
        self.gate_seconds += waited
        self._unreported += waited
        return waited

    def wait_staged(self) -> float:
        """Block until the save no longer reads anything training can change (its tensors, swap
        files not pinned for it; a pinned version may still be streaming); returns the seconds
        waited, plus what `wait_captured` waited since the last call (0 when that was already so).
        Errors stay with `wait`."""
        staged, self._staged = self._staged, None
        waited, self._unreported = self._unreported, 0.0
        if staged is None:
            return waited
        if self._capture is not None:  # only the state training can change
            fut, t = self._capture.volatile, 0.0
            if not fut.done():
                t0 = time.perf_counter()
                fut.result()
                t = time.perf_counter() - t0
        else:
            t = staged()
        self.blocked_seconds += t
        return waited + t

    def wait(self) -> Path:
        """Block until the step is committed on every rank (raises the save's error, on every rank)."""
        self.wait_staged()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        assert self._result is not None
        return self._result
