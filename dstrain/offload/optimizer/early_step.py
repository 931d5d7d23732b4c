"""Stepping `OffloadAdam` sub-groups during the accumulation boundary's backward.

`EarlyStep` listens to the ZeRO strategy's "unit reduced" events and steps a sub-group as soon as
every unit covering its master range was reduced for the last time in the pass (stage 3, no
clipping, no fp16 loss scaling: bitwise what stepping it after backward gives); `engine.step()`
steps the rest. A pass that reduces a unit again after its sub-group stepped raises
`EarlyStepError`, naming ``zero_optimization.offload_optimizer.step_in_backward``, the key that
turns it off. The design, in full: docs/offload.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from dstrain.errors import EarlyStepError
from dstrain.offload.optimizer.sub_groups import SubGroup

__all__ = ["KEY", "EarlyStep", "ReadyStepper"]

KEY = "zero_optimization.offload_optimizer.step_in_backward"
"""The dstrain key that turns stepping during backward off."""

UnitKey = tuple[int, int]  # (param group, offset of the unit's shard in the group's master)


class ReadyStepper(Protocol):
    """What `EarlyStep` asks of the optimizer it steps (`OffloadAdam`)."""

    @property
    def sub_groups(self) -> Sequence[SubGroup]:
        """Every sub-group, by index."""
        ...

    def stepped(self, index: int) -> bool:
        """Whether sub-group ``index`` is already stepped in the optimizer step under way."""
        ...

    def step_ready(self, ready: set[int]) -> int:
        """Step the sub-groups of ``ready`` whose state is in memory; how many were stepped."""
        ...


class EarlyStep:
    """Steps ``optimizer``'s sub-groups during the boundary backward of ``zero`` (a `Stage3Zero`)."""

    def __init__(self, optimizer: ReadyStepper, zero: Any) -> None:
        self._opt = optimizer
        units: dict[int, list[tuple[int, int]]] = {}  # group -> [(offset, numel)] of its units' shards
        base: dict[int, int] = {}
        for g in zero.groups:
            units[g.index] = [(g.offsets[u.index], u.layout.shard) for u in g.units]
            base[g.index] = g.master.storage_offset()
        self._units_of: dict[int, list[UnitKey]] = {}
        self._subs_of: dict[UnitKey, list[int]] = {}
        for sg in optimizer.sub_groups:
            lo = sg.master_start - base[sg.group]  # in the group's master
            hi = lo + sg.numel
            keys = [(sg.group, off) for off, n in units.get(sg.group, []) if off < hi and lo < off + n]
            self._units_of[sg.index] = keys
            for k in keys:
                self._subs_of.setdefault(k, []).append(sg.index)
        self._expected: dict[UnitKey, int] | None = None  # reductions per unit in the last armed pass
        self._seen: Counter[UnitKey] = Counter()
        self._ready: set[int] = set()
        self._sequence: list[int] = []  # sub-groups in the order their units were all reduced
        self._armed = False
        self.passes = 0
        """Boundary backward passes armed so far (the first one only records)."""
        zero.on_unit_reduced(self._on_reduced)

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        """The accumulation boundary's backward starts: gradients become final as units reduce."""
        self._armed = True
        self._seen.clear()
        self._ready.clear()
        self._sequence.clear()

    def _on_reduced(self, group: int, offset: int, numel: int) -> None:
        if not self._armed:
            return  # a non-final micro-batch (or a step held for a checkpoint save)
        key = (group, offset)
        self._seen[key] += 1
        subs = self._subs_of.get(key, ())
        expected = self._expected
        if expected is not None and self._seen[key] > expected.get(key, 0):
            late = [i for i in subs if self._opt.stepped(i)]
            if late:
                raise EarlyStepError(
                    f"a unit's gradient was reduced again after sub-group(s) {late} were stepped during "
                    f"backward (this pass reduces it {self._seen[key]} times, the last one "
                    f"{expected.get(key, 0)}): the model's control flow changed; set {KEY} to false"
                )
        for i in subs:
            if i in self._ready:
                continue
            keys = self._units_of[i]
            if i not in self._sequence and all(self._seen[k] for k in keys):
                self._sequence.append(i)
            if expected is not None and all(
                expected.get(k, 0) >= 1 and self._seen[k] >= expected[k] for k in keys
            ):
                self._ready.add(i)
        if self._ready:
            self._opt.step_ready(self._ready)

    def finish(self) -> list[int] | None:
        """The optimizer step is over: remember this pass's reduction counts; returns the sub-group
        order for the next step's reads (final ones first, in the order they became final), or
        None when this step was not armed."""
        if not self._armed:
            return None
        self._armed = False
        self.passes += 1
        self._expected = dict(self._seen)
        order = list(self._sequence)
        seen = set(order)
        order += [sg.index for sg in self._opt.sub_groups if sg.index not in seen]
        return order
