"""Stage 3 module hooks: gather a module's units just before it runs (forward and backward), release
them after, and prefetch the next units from the order recorded during the first micro-step."""

from __future__ import annotations

from typing import Any

import torch

from dstrain.config_sections import ZeroConfig
from dstrain.zero.units import ShardStore, Unit

__all__ = ["GatherScheduler"]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class GatherScheduler:
    """Owns the forward / pre-backward hooks of every module that has trainable parameters."""

    def __init__(
        self,
        root: torch.nn.Module,
        module_units: dict[torch.nn.Module, list[Unit]],
        units: list[Unit],
        config: ZeroConfig,
        store: ShardStore | None = None,
    ) -> None:
        self.root = root
        self.store = store if store is not None else ShardStore()  # told the order shards are needed in
        self.units = units
        self.prefetch_numel = config.stage3_prefetch_bucket_size
        self.max_live = config.stage3_max_live_parameters
        self.trace: list[int] | None = None  # unit indices in demand order, as recorded
        self.recording: list[int] = []  # this pass's demands (forward, then backward)
        self.deviated = False  # this pass left the trace: re-record
        self.pos = 0
        self.following = False
        self.gathers = 0
        self.prefetches = 0
        self.peak_resident = 0
        self.handles: list[Any] = []
        # unit -> forwards running that need it: a module whose forward uses another module's
        # parameter (registered external) keeps that unit gathered past the owner's own forward
        self.in_use: dict[int, int] = {}
        self.handles.append(root.register_forward_pre_hook(self._root_pre_forward))
        for module, needed in module_units.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(needed)))
            self.handles.append(module.register_forward_hook(self._post_forward(needed)))

    # -- hooks -------------------------------------------------------------------------------

    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A new pass starts: (re)adopt the last pass as the trace if needed, follow it from the start."""
        if self.recording and (self.trace is None or self.deviated):
            self.trace = self.recording
        self.recording = []
        self.in_use.clear()
        self.deviated = False
        self.pos = 0
        self.following = self.trace is not None
        self.store.begin_pass()  # the store reads ahead along the order of its own shard reads

    def _pre_forward(self, needed: list[Unit]):
        def hook(module: torch.nn.Module, args: Any) -> None:
            for unit in needed:
                self.in_use[unit.index] = self.in_use.get(unit.index, 0) + 1
            self.need(needed)

        return hook

    def _post_forward(self, needed: list[Unit]):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for unit in needed:
                left = self.in_use.get(unit.index, 1) - 1
                self.in_use[unit.index] = left
                if left <= 0:  # an enclosing module still running (an external parameter) keeps it
                    unit.release()
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(needed))

        return hook

    def _pre_backward(self, needed: list[Unit]):
        def hook(grad: torch.Tensor) -> None:
            self.need(needed)

        return hook

    # -- gathering ---------------------------------------------------------------------------

    def need(self, needed: list[Unit]) -> None:
        """Make ``needed`` usable now, then prefetch what the trace says comes next."""
        for unit in needed:
            if unit.persistent and unit.gathered:
                continue
            self._advance(unit.index)
            if unit.start_gather():
                self.gathers += 1
            unit.finish_gather()
        self._note_resident()
        self._prefetch()

    def _advance(self, index: int) -> None:
        self.recording.append(index)
        if self.trace is None:
            return
        if self.following and self.pos < len(self.trace) and self.trace[self.pos] == index:
            self.pos += 1
        else:
            self.following = False  # this pass differs from the recorded one: stop prefetching
            self.deviated = True

    def _prefetch(self) -> None:
        if not self.following or self.trace is None or self.prefetch_numel == 0:
            return
        live = sum(u.numel for u in self.units if (u.gathered or u.handle is not None) and not u.persistent)
        budget = self.prefetch_numel
        for index in self.trace[self.pos :]:
            unit = self.units[index]
            if unit.gathered or unit.handle is not None:
                continue
            if budget <= 0 or live + unit.numel > self.max_live:
                break
            if unit.start_gather():
                self.gathers += 1
                self.prefetches += 1
                budget -= unit.numel
                live += unit.numel
        self._note_resident()

    def _note_resident(self) -> None:
        self.peak_resident = max(self.peak_resident, sum(u.resident_numel() for u in self.units))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
