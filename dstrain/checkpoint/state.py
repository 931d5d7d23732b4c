"""What an engine checkpoint holds: one entry per part of the engine, under that part's own key.

    {"format": 2,
     "engine": {"global_steps", "micro_steps", "skipped_steps"},
     "zero": ZeroStrategy.state_dict(),      # this rank's master partitions
     "stepper": Stepper.state_dict(),        # optimizer state (an offloading stepper: its own entries)
     "precision": ..., "lr_scheduler": ... or None, "rng": {"torch": ...},
     "module_extra": buffers and frozen parameters, "module": full state dict (rank 0, stages 0-2) or None,
     "client_state": {...}}

Each part saves and restores itself (`Part`); the engine only lists its parts. A part whose state lives
in files (an offloaded optimizer) contributes, through ``checkpoint_state()``, entries that are lazy
sources over those files (`dstrain.checkpoint.sources`): the store streams them, never all in RAM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from dstrain.checkpoint.sources import check_lazy, has_lazy, lazy_bytes, materialize, verify_lazy
from dstrain.errors import DstrainError

__all__ = [
    "EAGER_BYTES",
    "FORMAT",
    "STREAMED",
    "CountersPart",
    "Part",
    "RngPart",
    "StreamsState",
    "collect",
    "restore",
]

FORMAT = 2
"""Version of the layout above (1 was the single-dict layout of dstrain's own commit protocol)."""

STREAMED = ("stepper", "zero", "module")
"""Entries a load may leave in the checkpoint file (big tensors as ``dsio.checkpoint.StoredTensor``):
the parts stream or read them in `restore`; ``module`` (the full state dict, for export) is not read."""


class Part(Protocol):
    """Anything that contributes its state to a checkpoint."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@runtime_checkable
class StreamsState(Protocol):
    """A part whose checkpoint state holds lazy sources (``dsio.checkpoint.LazyTensor``: swap file
    regions, streamed by the writer) instead of tensors, and that loads stored tensors piece by
    piece where they belong (the offloaded optimizer, stage 3 with an offloading store)."""

    def checkpoint_state(self) -> Any:
        """`state_dict` with lazy sources where the state is not in memory."""
        ...

    def load_checkpoint_state(self, state: Any) -> None:
        """`load_state_dict` of an entry whose tensors may still be in the checkpoint file."""
        ...


class RngPart:
    """torch's CPU generator (and the current CUDA device's, where there is one)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        # a fresh tensor: a state read from a file may be a view at an offset of a bigger buffer
        # (dsio's StoredTensor.materialize), which set_rng_state reads from the buffer's start (segfault)
        torch.set_rng_state(state["torch"].clone())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].clone())


class CountersPart:
    """The engine's step counters (read from and written to the engine's attributes)."""

    NAMES = ("global_steps", "micro_steps", "skipped_steps")

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, int]:
        return {n: int(getattr(self.owner, n)) for n in self.NAMES}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for n in self.NAMES:
            setattr(self.owner, n, int(state[n]))


def collect(parts: Mapping[str, Part | None], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint dict: each part's state under its key (None for an absent part), plus ``extra``.

    A part with a ``checkpoint_state()`` method contributes that (its state with lazy sources) rather
    than ``state_dict()``."""
    state: dict[str, Any] = {"format": FORMAT}
    for key, part in parts.items():
        if part is None:
            state[key] = None
            continue
        state[key] = part.checkpoint_state() if isinstance(part, StreamsState) else part.state_dict()
    for key, value in extra.items():
        if key in state:
            raise ValueError(f"checkpoint entry {key!r} given twice")
        state[key] = value
    return state


#: Entries read into memory (not streamed) are all read, each byte checked, before any is applied while
#: their stored bytes total at most this. Beyond it they are checked first through one bounded buffer (a
#: second read of those bytes) and then read and applied one at a time: a load then holds one entry beside
#: the parts' own state, never every entry at once.
EAGER_BYTES = 256 << 20


def restore(
    parts: Mapping[str, Part | None], state: Mapping[str, Any], *, where: str, skip: set[str]
) -> None:
    """Hand each part its entry (parts in ``skip``, or absent on either side, are left alone).

    An entry loaded with tensors left in the file (`STREAMED`) goes to the part's
    ``load_checkpoint_state`` where it has one (it streams them), else it is read into memory first.
    Every byte read into memory is checked against the file's checksums before any part is restored
    (see `EAGER_BYTES` for how, within bounded memory)."""
    if state.get("format") != FORMAT:
        raise DstrainError(f"{where}: unknown checkpoint format {state.get('format')!r} (expected {FORMAT})")
    missing = [k for k, p in parts.items() if p is not None and k not in skip and k not in state]
    if missing:
        raise DstrainError(f"{where}: checkpoint lacks the entries {missing}")
    todo = [(k, p) for k, p in parts.items() if p is not None and k not in skip and state[k] is not None]
    # A corrupted file fails the load with nothing applied. A part that streams its entry checks each
    # piece (block by block) before it uses it.
    streamed = {k for k, p in todo if isinstance(p, StreamsState) and has_lazy(state[k])}
    eager = [k for k, _ in todo if k not in streamed]
    read: dict[str, Any] = {}
    if sum(lazy_bytes(state[k]) for k in eager) <= EAGER_BYTES:
        read = {k: materialize(state[k]) for k in eager}  # each byte checked as it is read
    else:
        for k in eager:
            check_lazy(state[k])
    for key, part in todo:
        if key in streamed:
            assert isinstance(part, StreamsState)
            # reads the stored tensors piece by piece where they belong
            part.load_checkpoint_state(state[key])
            verify_lazy(state[key])
        else:
            part.load_state_dict(read.pop(key) if key in read else materialize(state[key]))
