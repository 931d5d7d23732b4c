"""What every ZeRO strategy provides to the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dstrain.dist.comm import Comm
from dstrain.optim.clip import GradSet

__all__ = [
    "GathersModule",
    "MasterPiece",
    "ReportsUnitReduced",
    "ZeroStatistics",
    "ZeroStrategy",
]


@dataclass(frozen=True, slots=True)
class MasterPiece:
    """Elements ``[start, start + length)`` of ``param`` (row-major flattened; ``shape`` is its whole
    shape) held at ``[offset, offset + length)`` of one param group's master partition."""

    offset: int
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    start: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroStatistics:
    """Memory and gather counters of one rank's ZeRO strategy."""

    stage: int
    world_size: int
    model_numel: int
    """Trainable parameter elements of the whole model."""
    master_numel: int
    """fp32 master elements held by this rank (its partition, or everything at stage 0)."""
    resident_param_numel: int
    """Parameter elements in this rank's storage right now (at stage 3: shards plus gathered)."""
    peak_resident_param_numel: int
    """The largest `resident_param_numel` seen (stage 3; otherwise equal to it)."""
    gathers: int
    """Stage 3 all-gathers issued (including prefetches)."""
    prefetches: int
    """Stage 3 gathers issued ahead of need from the recorded order."""


@runtime_checkable
class GathersModule(Protocol):
    """A strategy whose module parameters are partitioned between uses (stage 3): it can gather all of
    them at once (export, `Engine.full_state_dict`) and release them again (DeepSpeed's
    ``empty_partition_cache``)."""

    def gathered_module(self) -> None:
        """Gather every parameter of the module."""
        ...

    def release_all(self) -> None:
        """Release every gathered parameter (back to this rank's shard)."""
        ...


@runtime_checkable
class ReportsUnitReduced(Protocol):
    """A strategy that reduces each unit's gradient during backward (stage 3) and says so: the
    offload room's early stepping (`dstrain.offload.optimizer.early_step`) listens."""

    def on_unit_reduced(self, listener: Callable[[int, int, int], None]) -> None:
        """Call ``listener(group, offset, numel)`` after each unit's gradient is reduced."""
        ...


class ZeroStrategy(ABC):
    """Owns the flat parameter storage, the fp32 master copy and gradient reduction of one stage.

    The engine calls, in order per optimizer step: `before_backward` / `after_backward` for each
    micro-step, then `reduce_gradients`, `master_grads` (to unscale) and `grad_sets` (the global norm
    for clipping and overflow), the stepper's step on `param_groups`, `after_step`, `zero_grad`.
    Gradients are reduced through `dstrain.zero.reduce` (one `Route` per param group).
    """

    stage: int
    comm: Comm

    @property
    def loss_prescale(self) -> float:
        """Factor the engine applies to the loss before backward (e.g. 1/world where the strategy
        sums gradients over ranks instead of averaging them)."""
        return 1.0

    @property
    @abstractmethod
    def partitioned(self) -> bool:
        """True when each rank's master gradients are a different slice (norms sum over ranks)."""

    @abstractmethod
    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer param groups over the fp32 master tensors, with the user's group options."""

    def before_backward(self, boundary: bool) -> None:
        """Called before each micro-step's backward."""
        return None

    def after_backward(self, boundary: bool) -> None:
        """Called after each micro-step's backward."""
        return None

    @abstractmethod
    def reduce_gradients(self) -> None:
        """At a gradient-accumulation boundary: average gradients over ranks into the master grads."""

    @abstractmethod
    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients of the master tensors (what precision unscales and clips)."""

    def grad_sets(self) -> list[GradSet]:
        """`master_grads` as sets for `dstrain.optim.clip.global_grad_norm` (with the group each is
        partitioned over). Default: one set, summed over ``comm`` when `partitioned`."""
        return [GradSet(self.master_grads(), self.comm if self.partitioned else None)]

    @abstractmethod
    def after_step(self, stepped: bool) -> None:
        """Write updated master weights back into the model's parameters (gathering them as needed)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear all accumulated gradients."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's master partitions (and what is needed to check they fit on load)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore master partitions saved by `state_dict` and refresh the model's parameters."""

    @abstractmethod
    def master_pieces(self) -> list[list[MasterPiece]]:
        """Per param group, in master order: which elements of which parameter this rank's master
        partition holds (padding is not listed). What a checkpoint records to be loaded into any
        other world size or stage (``dstrain.checkpoint.layout``)."""

    @abstractmethod
    def gathered_units(self) -> Iterator[list[torch.nn.Parameter]]:
        """The trainable parameters whole, a unit at a time (a collective at stage 3: each unit is
        gathered while the caller holds it and released after); stages 0-2: all of them at once."""

    @abstractmethod
    def statistics(self) -> ZeroStatistics:
        """A snapshot of memory and gather counters."""

    def close(self) -> None:
        """Remove hooks; the model keeps its current parameter values."""
        return None
