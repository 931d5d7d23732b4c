"""RNG state for recomputation: what a checkpointed forward drew is drawn again in backward.

`RNGStatesTracker` is DeepSpeed's (Megatron's) ``CudaRNGStatesTracker``: named generator states that
code ``fork``s into (tensor-parallel dropout draws from its own stream). It tracks the accelerator's
generator (CUDA when available, torch's CPU generator otherwise). `capture` / `replay` save and
reinstate the CPU generator, the current CUDA device's generator and every tracked state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dstrain.errors import DstrainError

__all__ = [
    "CudaRNGStatesTracker",
    "RNGState",
    "RNGStatesTracker",
    "capture",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "replay",
]

_MODEL_PARALLEL_RNG = "model-parallel-rng"


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named accelerator RNG states (DeepSpeed's ``CudaRNGStatesTracker``)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states = {}
        self.seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the named states (the tensors are the states, not clones)."""
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states (as `get_states` returned them)."""
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed`` (both must be new)."""
        if seed in self.seeds:
            raise DstrainError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise DstrainError(f"RNG state {name!r} already exists in the tracker")
        self.seeds.add(seed)
        orig = _get_state()
        _seed(seed)
        self.states[name] = _get_state()
        _set_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state ``name`` inside the block; the default generator is left as it was."""
        if name not in self.states:
            raise DstrainError(f"RNG state {name!r} is not added to the tracker")
        orig = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(orig)


CudaRNGStatesTracker = RNGStatesTracker
"""DeepSpeed's name."""

_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that `checkpoint` captures and replays."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's seeding: the default generator gets ``seed``, the tracker's ``model-parallel-rng``
    ``seed + 2718`` (+ the tensor-parallel rank, always 0 here: dstrain has no tensor parallelism)."""
    _TRACKER.reset()
    _seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718)


@dataclass(frozen=True, slots=True)
class RNGState:
    """Every generator state a checkpointed forward may draw from."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    """The current CUDA device's generator (None when CUDA is not in use)."""
    device: int | None
    tracked: dict[str, torch.Tensor]


def capture() -> RNGState:
    """The generators' states now (before a checkpointed forward)."""
    device = torch.cuda.current_device() if _cuda() else None
    return RNGState(
        cpu=torch.get_rng_state(),
        cuda=None if device is None else torch.cuda.get_rng_state(device),
        device=device,
        tracked=_TRACKER.get_states(),
    )


def _reinstate(state: RNGState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None and state.device is not None:
        torch.cuda.set_rng_state(state.cuda, state.device)
    _TRACKER.set_states(state.tracked)


@contextlib.contextmanager
def replay(state: RNGState) -> Iterator[None]:
    """Run the block from ``state`` (the recompute draws what the forward drew); afterwards every
    generator is back where it was before the block."""
    now = capture()
    _reinstate(state)
    try:
        yield
    finally:
        _reinstate(now)
