"""`StateReads`: `OffloadAdam`'s read-ahead of swapped sub-group state, along the step order.

One entry per sub-group read ahead: its m, v lease (from the optimizer's `Swapper`) and its master
range (stage 3 with the master in the parameter file) and gradient range (gradients on NVMe). As
many entries as the swapper has buffers; reads are submitted in the step order (``order``), so the
pool hands buffers out in the order they are consumed. Entries may be consumed out of order
(sub-groups stepped during backward as their gradients become final); every sub-group before
position ``next`` of the order is either stepped or still queued here.

Master and gradient ranges are read inside the step for every queued entry, and during the
boundary backward (`dstrain.offload.early_step`) for the entries whose gradients are final
(`fetch_final`): at most ``in_pass`` ranges of each kind at once, since during backward those pools
also serve the gathers' shard reads and the gradient accumulation, which must always find a buffer.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from typing import Any

from dstrain.offload.optimizer.sub_groups import SubGroup
from dstrain.offload.swap.swapper import Lease, Swapper

__all__ = ["StateReads"]


class StateReads:
    """Reads ahead of ``swapper``'s sub-group slots (plus ``master`` / ``grads`` ranges in the step)."""

    def __init__(self, swapper: Swapper, master: Any = None, grads: Any = None) -> None:
        self.swapper = swapper
        self.master = master
        self.grads = grads
        self.in_pass = (0, 0)
        """(master, gradient) ranges `fetch_final` may hold at once during backward."""
        self.ahead: deque[list[Any]] = deque()  # [sub-group, state future, master future, grad future]
        self.next = 0  # position in the order of the next read to submit
        self.hits = self.misses = 0
        self.stall = 0.0
        """Seconds `take` waited for reads that were late."""

    def top_up(self, order: list[SubGroup], stepped: set[int], in_step: bool) -> None:
        """Keep reads submitted for the next sub-groups of ``order`` not in ``stepped`` (one per
        buffer); inside the step (``in_step``) also their master and gradient ranges."""
        while len(self.ahead) < self.swapper.buffers and self.next < len(order):
            sg = order[self.next]
            self.next += 1
            if sg.index not in stepped:
                self.ahead.append([sg, self.swapper.fetch(sg.index), None, None])
        if self.grads is not None and in_step:  # gradients are final only once the step runs
            for entry in self.ahead:
                if entry[3] is None:
                    entry[3] = self.grads.fetch(entry[0].group, entry[0].master_start, entry[0].numel)
        if self.master is not None and in_step:
            # master reads only inside the step: during forward/backward the parameter pool
            # belongs to the shard reads of the gathers
            for entry in self.ahead:
                if entry[2] is None:
                    sg = entry[0]
                    entry[2] = self.master.fetch_master(sg.group, sg.master_start, sg.numel)

    def fetch_final(self, ready: set[int]) -> None:
        """During backward: read ahead the master ranges of queued sub-groups (in queue order: the
        master changes only when its sub-group steps) and the gradient ranges of those of ``ready``
        (their gradients are final), within the ``in_pass`` limits. Those limits leave each pool a
        buffer the pass never holds for long, so the step can take these entries in queue order
        (`fetched_in_pass`) whatever order the gradient reads were asked in."""
        masters = sum(1 for e in self.ahead if e[2] is not None)
        grads = sum(1 for e in self.ahead if e[3] is not None)
        max_m, max_g = self.in_pass
        for entry in self.ahead:
            sg = entry[0]
            if self.master is not None and entry[2] is None and masters < max_m:
                entry[2] = self.master.fetch_master(sg.group, sg.master_start, sg.numel, in_pass=True)
                masters += 1
            if self.grads is not None and entry[3] is None and grads < max_g and sg.index in ready:
                entry[3] = self.grads.fetch(sg.group, sg.master_start, sg.numel)
                grads += 1

    def fetched_in_pass(self) -> list[SubGroup]:
        """Queued sub-groups holding master / gradient buffers read during backward, in queue order
        (the step takes these first: the other sub-groups' reads may wait for their buffers)."""
        return [e[0] for e in self.ahead if e[2] is not None or e[3] is not None]

    def read_in(self, ready: set[int]) -> SubGroup | None:
        """A queued sub-group of ``ready`` whose reads are all done (taking it will not wait)."""
        for sg, fut, mfut, gfut in self.ahead:
            if sg.index not in ready or not fut.done():
                continue
            if self.master is not None and (mfut is None or not mfut.done()):
                continue
            if self.grads is not None and (gfut is None or not gfut.done()):
                continue
            return sg
        return None

    def take(self, sg: SubGroup) -> tuple[Lease, Any, Any]:
        """The sub-group's state lease, its (master lease, master view) when the master is swapped,
        and its (gradient lease, gradient view) when the gradients are; waits if a read is late."""
        at = next((i for i, entry in enumerate(self.ahead) if entry[0] is sg), None)
        if at is None:
            raise RuntimeError("offload read-ahead out of order")  # a bug, never user input
        _, fut, mfut, gfut = self.ahead[at]
        del self.ahead[at]
        if gfut is not None:
            self.grads.took(gfut)
        if mfut is not None and not mfut.done():
            self.master.settle()  # a range assembling from gathers that will not come: read it
        futs = [f for f in (fut, mfut, gfut) if f is not None]
        if all(f.done() for f in futs):
            self.hits += 1
        else:
            self.misses += 1
            t0 = time.perf_counter()
            concurrent.futures.wait(futs)
            self.stall += time.perf_counter() - t0
        if any(f.exception() is not None for f in futs):
            # a failed read gave its own buffer back; the others go back unused, then it raises
            self._discard(fut, mfut, gfut)
            for f in futs:
                f.result()
        return (
            fut.result(),
            mfut.result() if mfut is not None else None,
            gfut.result() if gfut is not None else None,
        )

    def _discard(self, fut: Any, mfut: Any, gfut: Any) -> None:
        """Hand the buffers of one entry's reads that succeeded back unused (a failed read already
        gave its own back)."""
        for f, give_back in (
            (fut, self.swapper.discard),
            (mfut, lambda got: self.master.discard_master(got[0])),
            (gfut, lambda got: self.grads.discard(got[0])),
        ):
            if f is not None and f.exception() is None:
                give_back(f.result())

    def cancel(self) -> None:
        """Hand every buffer read ahead back unused and restart at the order's head."""
        self.next = 0
        if self.master is not None:
            self.master.settle()
        while self.ahead:
            _, fut, mfut, gfut = self.ahead.popleft()
            concurrent.futures.wait([f for f in (fut, mfut, gfut) if f is not None])
            self._discard(fut, mfut, gfut)  # every entry's, even behind a read that failed
        self.swapper.drain()
