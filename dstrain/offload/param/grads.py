"""`OffloadedGrads`: stage-3 fp32 gradient shards in an NVMe swap file instead of memory.

"Gradients stay in memory unless the budget says otherwise": when ``offload_pinned_bytes`` cannot
hold this rank's fp32 gradient shards (parameters and optimizer state both on NVMe, stage 3), the
parameter store makes one of these and `Stage3Zero` keeps no full-size gradient buffer. Instead:

- each unit's reduce-scattered gradient is accumulated into the file as soon as it arrives
  (`accumulate`): the unit's pages are read where this accumulation already wrote them (zeros
  elsewhere; at its first micro-step that is at most the page it shares with each neighbour),
  ``add_``-ed with exactly the call the in-memory path makes on its slice of the gradient buffer
  (same shapes, same lanes: bitwise the same sums), then written back whole (write-behind; a
  later read of those pages waits for the write, on dsio's loop thread);
- `OffloadAdam` reads each sub-group's gradient range back in the optimizer step (`fetch`), read
  ahead like its state;
- `zero` forgets every page: the next accumulation starts from zeros without touching the disk.

A page is *valid* once this accumulation wrote it; pages never written since `zero` read as zeros
(a parameter unused this step has a zero gradient, as in memory). Everything goes through one
`Swapper` (dsio handle on dsio's loop thread, bounded pinned pool), the machinery of the parameter
and optimizer swaps.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.offload.swap.swapper import ALIGN, Lease, Swapper, SwapperStatistics, align_up, budget_buffers

__all__ = ["GradStoreStatistics", "OffloadedGrads"]

_F32 = 4


@dataclass(frozen=True, slots=True)
class GradStoreStatistics:
    """Counters of one rank's offloaded gradient shards."""

    shard_bytes: int
    """Bytes of this rank's fp32 gradient shards (all groups) in the file."""
    accumulations: int
    """Unit gradients accumulated into the file."""
    read_modify_writes: int
    """Runs of pages read back before a write (written earlier in the same accumulation)."""
    fetches: int
    """Gradient ranges read for the optimizer."""
    stall_seconds: float
    """Training-thread time spent waiting for gradient reads (accumulation and optimizer)."""
    prefetch_hits: int
    prefetch_misses: int
    pinned_budget: int
    pinned_bytes: int
    swapper: SwapperStatistics | None


class OffloadedGrads:
    """fp32 gradient shards of every param group of a stage-3 rank, in one swap file under ``nvme_path``."""

    def __init__(
        self, nvme_path: str, *, pinned_budget: int, buffer_count: int = 4, io_config: Any = None
    ) -> None:
        count, size = budget_buffers(pinned_budget, max(2, buffer_count), 4 << 20)
        if size < 2 * ALIGN:
            from dstrain.errors import ConfigError

            raise ConfigError(
                "zero_optimization.offload_pinned_bytes",
                f"{pinned_budget} bytes leave no room for {count} gradient swap buffers of {2 * ALIGN} bytes "
                f"and dsio's staging pool",
            )
        self.buffer_bytes = size
        self._budget = pinned_budget
        self._swapper: Swapper | None = Swapper(
            nvme_path, "grad", buffer_bytes=size, buffer_count=count, io_config=io_config
        )
        self._closed_stats: SwapperStatistics | None = None
        self._base: dict[int, int] = {}  # group -> region offset in the file
        self._total: dict[int, int] = {}
        self._valid: dict[int, bytearray] = {}  # group -> per page: written since `zero`
        self._accumulations = self._rmw = self._fetches = 0
        self._hits = self._misses = 0
        self._stall = 0.0
        from dstrain.offload.metrics import register_offload

        register_offload(self, kind="grad")  # dstrain_offload_*{kind="grad"} at scrape time

    # -- layout -------------------------------------------------------------------------------

    @property
    def max_numel(self) -> int:
        """The most elements one `fetch` can return (a multiple of 1024)."""
        return (self.buffer_bytes - ALIGN) // _F32 // 1024 * 1024

    @property
    def buffers(self) -> int:
        """Swap buffers of the gradient pool (accumulation needs one; reads for the optimizer may
        hold the others)."""
        return self._live().buffers

    def place(self, group: int, total: int) -> None:
        """Give param group ``group`` a region of ``total`` fp32 elements (all zero)."""
        sw = self._live()
        self._base[group] = sw.reserve_region(total * _F32)
        self._total[group] = total
        self._valid[group] = bytearray(align_up(total * _F32) // ALIGN)  # per page

    def _live(self) -> Swapper:
        if self._swapper is None:
            from dsio.errors import ClosedError

            raise ClosedError("the gradient store is closed")
        return self._swapper

    def _pages(self, start: int, numel: int) -> tuple[int, int]:
        """The pages ``[first, end)`` of a group's region holding elements ``[start, start + numel)``."""
        return start * _F32 // ALIGN, -(-(start + numel) * _F32 // ALIGN)

    def _valid_runs(self, group: int, p0: int, p1: int, want: bool) -> list[tuple[int, int]]:
        """Maximal runs ``[p, q)`` of pages in ``[p0, p1)`` whose written-since-`zero` flag is
        ``want``, each at most a buffer long."""
        valid, most = self._valid[group], self.buffer_bytes // ALIGN
        runs, p = [], p0
        while p < p1:
            if bool(valid[p]) != want:
                p += 1
                continue
            q = p
            while q < p1 and bool(valid[q]) == want and q - p < most:
                q += 1
            runs.append((p, q))
            p = q
        return runs

    def _wait(self, fut: concurrent.futures.Future[Any]) -> Any:
        if not fut.done():
            t0 = time.perf_counter()
            concurrent.futures.wait([fut])
            self._stall += time.perf_counter() - t0
        return fut.result()

    # -- accumulation (during backward) ---------------------------------------------------------

    def accumulate(self, group: int, start: int, values: torch.Tensor, alpha: float) -> None:
        """Gradient elements ``[start, start + values.numel())`` of ``group`` += ``values * alpha``,
        with the arithmetic of ``buffer[start:end].add_(values, alpha=alpha)`` on a resident buffer.

        The unit's pages are read only where this accumulation already wrote them (its first
        micro-step reads at most the page it shares with each neighbour), then written whole."""
        sw = self._live()
        n = values.numel()
        base, total = self._base[group], self._total[group]
        p0, p1 = self._pages(start, n)
        first = p0 * ALIGN // _F32  # element at the first page's start
        span = min((p1 - p0) * ALIGN // _F32, total - first)
        buf = torch.zeros(span, dtype=torch.float32)  # (span,) the unit's pages, zeros where unwritten
        for p, q in self._valid_runs(group, p0, p1, True):
            lease = self._wait(sw.fetch_range(base + p * ALIGN, (q - p) * ALIGN))
            e0, e1 = p * ALIGN // _F32 - first, min(q * ALIGN // _F32 - first, span)
            buf[e0:e1].copy_(lease.view(torch.float32, 0, e1 - e0))
            sw.discard(lease)
            self._rmw += 1
        buf[start - first : start - first + n].add_(values.reshape(-1), alpha=alpha)  # as in memory
        per = self.buffer_bytes // _F32
        for c in range(0, span, per):
            k = min(per, span - c)
            lease = self._wait(sw.acquire_any())
            lease.view(torch.float32, 0, k).copy_(buf[c : c + k])
            sw.store_range(lease, base + (first + c) * _F32, k * _F32)  # write-behind
        self._valid[group][p0:p1] = b"\x01" * (p1 - p0)
        self._accumulations += 1

    def zero(self) -> None:
        """Every gradient is zero again (nothing is written: unwritten pages read as zeros)."""
        for flags in self._valid.values():
            flags[:] = bytes(len(flags))

    # -- reads (in the optimizer step) ------------------------------------------------------------

    def fetch(
        self, group: int, start: int, numel: int
    ) -> concurrent.futures.Future[tuple[Lease, torch.Tensor]]:
        """A buffer holding gradient elements ``[start, start + numel)`` of ``group`` (after any
        write of those pages still in flight; zeros for pages not written since `zero`) and the
        fp32 view of them. Hand it back with `discard`."""
        sw = self._live()
        lo = self._base[group] + start * _F32
        first = lo - lo % ALIGN
        at = lo - first
        nbytes = align_up(at + numel * _F32)
        if nbytes > self.buffer_bytes:
            raise ValueError(
                f"a gradient range of {numel} elements exceeds a swap buffer ({self.buffer_bytes} B)"
            )
        p0, p1 = self._pages(start, numel)
        stale = [
            (max(p * ALIGN // _F32, start), min(q * ALIGN // _F32, start + numel))
            for p, q in self._valid_runs(group, p0, p1, False)
        ]

        def zero_stale(view: torch.Tensor) -> None:
            for a, z in stale:  # bytes of an earlier step: zeros
                view[a - start : z - start].zero_()

        fut = sw.fetch_view(first, nbytes, at, numel, prepare=zero_stale)
        self._fetches += 1
        return fut

    def took(self, fut: concurrent.futures.Future[Any]) -> None:
        """Count a read-ahead consumed by the optimizer as a hit or a miss."""
        if fut.done():
            self._hits += 1
        else:
            self._misses += 1

    def discard(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Hand a buffer from `fetch` back (gradients are read-only to the optimizer)."""
        return self._live().discard(lease)

    def drain(self) -> None:
        """Wait for every write in flight."""
        if self._swapper is not None:
            self._swapper.drain()

    # -- introspection and lifetime -------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        if self._swapper is not None:
            return self._swapper.pinned_bytes
        return self._closed_stats.pinned_bytes if self._closed_stats is not None else 0

    def statistics(self) -> GradStoreStatistics:
        sw = self._swapper.statistics() if self._swapper is not None else self._closed_stats
        return GradStoreStatistics(
            shard_bytes=sum(self._total.values()) * _F32,
            accumulations=self._accumulations,
            read_modify_writes=self._rmw,
            fetches=self._fetches,
            stall_seconds=self._stall,
            prefetch_hits=self._hits,
            prefetch_misses=self._misses,
            pinned_budget=self._budget,
            pinned_bytes=self.pinned_bytes,
            swapper=sw,
        )

    def close(self) -> None:
        """Finish writes, free the pool, delete the file."""
        from dstrain.offload.metrics import unregister_offload

        unregister_offload(self)
        if self._swapper is not None:
            try:
                self._swapper.close()
            finally:
                self._closed_stats = self._swapper.statistics()
                self._swapper = None
