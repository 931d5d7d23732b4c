"""`OffloadOptimizerStatistics`: the counters of one rank's offloaded optimizer (a frozen snapshot,
read by ``dstrain.offload.metrics`` at scrape time and by bench/offload_worker.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dstrain.offload.swap.swapper import SwapperStatistics

__all__ = ["OffloadOptimizerStatistics"]


@dataclass(frozen=True, slots=True)
class OffloadOptimizerStatistics:
    """Swap and stall counters of one rank's offloaded optimizer."""

    device: str
    sub_groups: int
    sub_group_numel: int
    steps: int
    stall_seconds: float
    """Training-thread time spent waiting for swapped-in state that was not there yet."""
    step_seconds: float
    """Time inside `OffloadAdam.step` (the stalls included)."""
    prefetch_hits: int
    """Sub-groups whose state was already in memory when the step reached them."""
    prefetch_misses: int
    stepped_in_backward: int
    """Sub-groups stepped during the boundary backward (`dstrain.offload.optimizer.early_step`), not in `step`."""
    backward_step_seconds: float
    """Time spent stepping sub-groups during backward (not in ``step_seconds``); with the step
    thread, the backward thread's part: taking their state and handing them over."""
    stepped_on_thread: int
    """Of ``stepped_in_backward``, those stepped on the step thread (`dstrain.offload.optimizer.step_thread`)."""
    pinned_budget: int
    pinned_bytes: int
    """Pinned bytes allocated for this optimizer's swapping (never above ``pinned_budget``)."""
    swapper: SwapperStatistics | None
