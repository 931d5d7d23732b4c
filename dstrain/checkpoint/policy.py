"""`EngineCheckpoints`: what an engine's `save_checkpoint` / `load_checkpoint` do, so the engine owns no
checkpoint policy.

- where a tag goes (``global_step<N>`` is step N of ``save_dir``; any other tag, or
  ``save_latest=False``, a checkpoint directory ``save_dir/<tag>`` of its own);
- what a save collects: each part's state (`dstrain.checkpoint.state`), the module's buffers and frozen
  parameters, the full state dict on rank 0 below stage 3, the client state; an async save snapshots
  what forward changes (buffers, the client state) at the call;
- the save in flight (`PendingSave`): the fence before the optimizer changes what it still reads, the
  time it held training;
- what a load checks before anything is applied (stage and world size, each part's layout) and what
  it skips (``load_optimizer_states`` / ``load_lr_scheduler_states``).

The engine hands over its parts once (`EngineCheckpoints.parts`); a room contributes a part of its own
(MoE's expert layout: ``dstrain.moe.compose.ExpertLayoutPart``) through ``initialize``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from dstrain.checkpoint.agree import agree_step, gather_objects, storage_leaders
from dstrain.checkpoint.gate import lend_gate, touch_order
from dstrain.checkpoint.layout import Layout, PinnedPart, check_same_model, describe
from dstrain.checkpoint.pending import PendingSave
from dstrain.checkpoint.reshape import SavedStep, native_state, open_step, rank_path, saved_world
from dstrain.checkpoint.sources import materialize
from dstrain.checkpoint.state import STREAMED, Part, collect, restore
from dstrain.checkpoint.store import CheckpointStore, latest_step, load_any, step_name, validate_tag
from dstrain.dist.comm import Comm
from dstrain.errors import CheckpointNotFoundError, DstrainError, ReshapeError

__all__ = ["EngineCheckpoints", "Trained"]

_DEFAULT_TAG = re.compile(r"global_step(\d+)")


class Trained(Protocol):
    """What the checkpoint policy reads of the engine it serves."""

    module: torch.nn.Module
    global_steps: int

    @property
    def stepper(self) -> Any: ...

    @property
    def zero(self) -> Any: ...


class EngineCheckpoints:
    """One engine's checkpoints over ``store``; ``parts()`` lists the parts by checkpoint key (called at
    every save and load: a part attached after construction, e.g. a pipeline runner, is seen)."""

    def __init__(
        self,
        owner: Trained,
        store: CheckpointStore,
        *,
        parts: Callable[[], Mapping[str, Part | None]],
        world: Comm,
        dp: Comm,
        stage: int,
        tag_validation: str,
        node_local: bool = False,
    ) -> None:
        self.owner = owner
        self.store = store
        self.parts = parts
        self.world = world
        self.dp = dp
        self.stage = stage
        self.tag_validation = tag_validation
        self.node_local = node_local
        """``checkpoint.use_node_local_storage``: each host has its own ``save_dir``."""
        self._shared: set[str] = set()
        self.pending: PendingSave | None = None
        """The asynchronous save in flight (None when none is)."""
        self.blocked_seconds = 0.0
        """Time saves held training (see ``EngineStatistics.checkpoint_blocked_seconds``)."""

    # -- saving ---------------------------------------------------------------------------------

    def where(self, root: Path, tag: str | None, save_latest: bool) -> tuple[Path, int]:
        """(checkpoint directory, step) of a save (see the module docstring)."""
        tag = tag or f"global_step{self.owner.global_steps}"
        m = _DEFAULT_TAG.fullmatch(tag)
        if m is not None and save_latest:
            return root, int(m.group(1))
        if not tag or "/" in tag or tag in (".", ".."):
            raise DstrainError(f"checkpoint tag {tag!r} is not a plain name")
        return root / tag, self.owner.global_steps

    def check_shared(self, directory: Path) -> None:
        """Without node-local storage, refuse a ``save_dir`` that not every rank sees (each host its
        own), naming the key that makes that work; found once per directory (collective)."""
        key = os.path.abspath(directory)
        if self.node_local or self.world.world_size == 1 or key in self._shared:
            return
        leaders = storage_leaders(self.world, directory)
        others = [r for r, first in enumerate(leaders) if first != 0]
        if others:
            raise DstrainError(
                f"the checkpoint directory {directory} is not shared by every rank: ranks {others} see "
                "another directory at that path than rank 0 (storage local to each host?); set "
                '"checkpoint": {"use_node_local_storage": true} to save into per-host directories'
            )
        self._shared.add(key)

    def module_states(self, exclude_frozen: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(entries every rank saves: buffers and frozen parameters, full state dict on rank 0 below
        stage 3); ``exclude_frozen``: without the frozen parameters."""
        module = self.owner.module
        params = dict(module.named_parameters(remove_duplicate=False))
        trainable = {n for n, p in params.items() if p.requires_grad}
        frozen = {n for n, p in params.items() if not p.requires_grad} if exclude_frozen else set()
        sd = {k: v for k, v in module.state_dict().items() if k not in frozen}
        extra = {k: v for k, v in sd.items() if k not in trainable}
        return extra, sd if self.stage < 3 and self.dp.rank == 0 else None

    def save(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None,
        client_state: dict[str, Any] | None,
        save_latest: bool,
        async_save: bool,
        *,
        exclude_frozen: bool = False,
    ) -> Path:
        """`Engine.save_checkpoint`: returns this rank's file (to be, for an async save)."""
        t0 = time.perf_counter()
        self.wait()
        directory, step = self.where(Path(save_dir), tag, save_latest)
        validate_tag(str(directory / step_name(step)), self.world, self.tag_validation)
        self.check_shared(directory)
        extra, full = self.module_states(exclude_frozen)
        if async_save:  # buffers (e.g. BatchNorm statistics) change in forward: snapshot them now
            copies = {k: v.detach().clone() for k, v in extra.items() if isinstance(v, torch.Tensor)}
            extra = {**extra, **copies}
            full = None if full is None else {k: copies.get(k, v) for k, v in full.items()}
            client_state = _cloned(client_state or {})
        parts = self.parts()
        state = collect(
            parts,
            {
                "module_extra": extra,
                "module": full,
                "client_state": client_state or {},
                "layout": self.layout(parts).to_json(),  # global shapes and this file's slices
            },
        )
        stepper = self.owner.stepper
        order = touch_order(stepper, self.owner.module) if async_save else None
        pending = self.store.save(
            directory, step, state, self.world, background=async_save, touch_order=order
        )
        if async_save:  # staged while forward and backward run; the next step waits if unfinished
            self.pending = pending
            self.blocked_seconds += time.perf_counter() - t0
            return pending.path
        path = pending.wait()
        self.blocked_seconds += time.perf_counter() - t0
        return path

    def fence(self, lend: bool = False) -> None:
        """Before the optimizer changes parameters and state: wait for an async save's staging, or
        (``lend``) let a stepper that steps sub-group by sub-group wait for each one
        (`dstrain.checkpoint.gate`); its waits are counted at the next full fence."""
        pending = self.pending
        if pending is None or (lend and lend_gate(self.owner.stepper, pending)):
            return
        self.blocked_seconds += pending.wait_staged()

    def wait(self) -> Path | None:
        """Finish an asynchronous save (a collective); returns its file, or None when none was pending."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def layout(self, parts: Mapping[str, Part | None] | None = None) -> Layout:
        """This rank's `dstrain.checkpoint.layout.Layout`: what of the global model its file holds."""
        parts = self.parts() if parts is None else parts
        return describe(
            self.owner.module,
            self.owner.zero,
            self.owner.stepper,
            rank=self.world.rank,
            world_size=self.world.world_size,
            pinned=[k for k, p in parts.items() if isinstance(p, PinnedPart) and p.pins_shape()],
        )

    # -- loading --------------------------------------------------------------------------------

    def locate(self, load_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, int | None]:
        """(checkpoint directory, step or None for its latest) that ``tag`` names under ``load_dir``."""
        root = Path(load_dir)
        if tag is None:
            return root, None
        m = _DEFAULT_TAG.fullmatch(tag)
        if (root / tag).is_dir() and "/" not in tag:
            return root / tag, None
        if m is not None:
            return root, int(m.group(1))
        raise CheckpointNotFoundError(f"no checkpoint tagged {tag!r} in {root}")

    def load(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None,
        *,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_strict: bool = True,
    ) -> tuple[Path, dict[str, Any]]:
        """`Engine.load_checkpoint`: (this rank's file, client_state). The step is agreed by every rank
        first; a checkpoint of another world size, stage, offload or sub-group size is resharded
        (`dstrain.checkpoint.reshape`); one of another model is refused before anything is applied."""
        self.wait()
        directory, step = self.locate(load_dir, tag)
        step = agree_step(self.world, directory, step, latest=latest_step, committed=_committed)
        step_dir = directory / step_name(step)
        parts = self.parts()
        mine = self.layout(parts)
        world, suffix = saved_world(step_dir)
        if world != self.world.world_size:
            self._check_every_file(step_dir, world, suffix)
        home_rank = self.world.rank % max(world, 1)
        saved: SavedStep | None = None
        try:
            path, state, layout = self._home(directory, step, world, home_rank)
            if layout is not None:
                self._check_model(parts, state, layout, mine, str(path), strict=load_module_strict)
            if layout is None:  # written before dstrain recorded layouts: same shape only
                _check_shape(state, path, self.stage, self.dp.world_size)
            elif world != self.world.world_size or not layout.same_shape(mine):
                saved = open_step(step_dir, allow_pickle=_allow_pickle(self.store))
                zero_state, stepper_state = native_state(
                    saved,
                    mine,
                    my_stepper_groups=[len(v) for v in mine.views],
                    where=str(step_dir),
                    optimizer=load_optimizer_states,
                )
                state = {**state, "zero": zero_state, "stepper": stepper_state}
            skip = {"layout"}
            if not load_optimizer_states or state.get("stepper") is None:
                skip.add("stepper")
            if not load_lr_scheduler_states:
                skip.add("lr_scheduler")
            restore(parts, state, where=str(path), skip=skip)
            self.owner.module.load_state_dict(materialize(state["module_extra"]), strict=False)
            return path, materialize(state["client_state"])
        finally:
            if saved is not None:
                saved.close()

    def _check_every_file(self, step_dir: Path, world: int, suffix: str) -> None:
        """Resharding reads every saved rank's file: check that every rank sees them all (collective),
        else fail every rank with one `ReshapeError` naming both world sizes and what is missing (with
        node-local storage each host holds only its own ranks' files)."""
        missing = [r for r in range(world) if not rank_path(step_dir, r, suffix).is_file()]
        seen = gather_objects(self.world, [str(rank_path(step_dir, r, suffix)) for r in missing])
        lacking = [(r, m) for r, m in enumerate(seen) if m]
        if not lacking:
            return
        rank, files = lacking[0]
        hint = (
            " (checkpoint.use_node_local_storage: each host holds only its own ranks' files; copy every "
            "host's step directory into one directory each rank sees, or load at the saved world size)"
            if self.node_local
            else ""
        )
        raise ReshapeError(
            f"{step_dir} was saved at world size {world}; this engine runs world size {self.world.world_size}. "
            f"Resharding reads every saved rank's file, and rank {rank} lacks {len(files)} of them: "
            f"{', '.join(files[:4])}{' ...' if len(files) > 4 else ''}{hint}"
        )

    def _home(
        self, directory: Path, step: int, world: int, home_rank: int
    ) -> tuple[Path, dict[str, Any], Layout | None]:
        """(file, state with its big tensors left in the file, layout or None) of the rank file this rank
        takes its per-rank entries from: its own at the saved world size, else rank ``rank % saved``."""
        if world == self.world.world_size:
            path, state = load_any(self.store, directory, step, self.world, lazy=STREAMED)
        else:
            home = open_step(directory / step_name(step), [home_rank], allow_pickle=_allow_pickle(self.store))
            try:
                f = home.files[0]
                state = {k: v if k in STREAMED else materialize(v) for k, v in f.state.items()}
                path = f.path
            finally:
                home.close()  # the entries kept lazy are re-read from every rank file if resharded
            return path, state, f.layout
        raw = state.get("layout")
        return path, state, Layout.from_json(raw, str(path)) if isinstance(raw, str) else None

    def _check_model(
        self,
        parts: Mapping[str, Part | None],
        state: Mapping[str, Any],
        layout: Layout,
        mine: Layout,
        where: str,
        *,
        strict: bool,
    ) -> None:
        """Before anything is applied: parts that pin the shape check theirs (their own error, e.g. another
        ep_size), then the parameters' names and shapes (`CheckpointMismatchError`)."""
        for key, part in parts.items():
            if isinstance(part, PinnedPart) and part.pins_shape() and state.get(key) is not None:
                part.load_state_dict(materialize(state[key]))
        saved = layout.params
        if strict:
            check_same_model(saved, mine.params, where)
        else:  # DeepSpeed's load_module_strict=False: only what both hold must agree
            check_same_model(
                {k: v for k, v in saved.items() if k in mine.params},
                {k: v for k, v in mine.params.items() if k in saved},
                where,
            )

    def close(self) -> None:
        """Finish a pending save; release the store's locks."""
        self.wait()
        self.store.close()


def _committed(directory: Path, step: int) -> bool:
    return (directory / step_name(step)).is_dir()


def _allow_pickle(store: CheckpointStore) -> bool:
    return store.allow_pickle


def _check_shape(state: Mapping[str, Any], path: Path, stage: int, world: int) -> None:
    """A file without a layout (older dstrain) loads only into the stage and world size it was saved with."""
    if "layout" in state:
        return
    saved = state.get("zero") or {}
    if saved.get("stage") != stage or saved.get("world_size") != world:
        raise DstrainError(
            f"{path} was saved at ZeRO stage {saved.get('stage')} with world size {saved.get('world_size')}; "
            f"this engine runs stage {stage} with world size {world} (and the file records no layout to reshard by)"
        )


def _cloned(value: Any) -> Any:
    """``value`` with its tensors cloned (an async save's client state, captured at the call)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return value
