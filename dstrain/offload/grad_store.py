"""`OffloadedGrads`: stage-3 fp32 gradient shards in an NVMe swap file instead of memory.

"Gradients stay in memory unless the budget says otherwise": when ``offload_pinned_bytes`` cannot
hold this rank's fp32 gradient shards (parameters and optimizer state both on NVMe, stage 3), the
parameter store makes one of these and `Stage3Zero` keeps no full-size gradient buffer. Instead:

- each unit's reduce-scattered gradient is accumulated into the file as soon as it arrives
  (`accumulate`): the unit's current values are read where this accumulation already wrote them
  (zeros elsewhere), ``add_``-ed in a unit-sized temporary with exactly the call the in-memory path
  makes on its slice of the gradient buffer (same shapes, same lanes: bitwise the same sums), then
  written back block by block (write-behind; a later read of those pages waits for the write);
- `OffloadAdam` reads each sub-group's gradient range back in the optimizer step (`fetch`), read
  ahead like its state;
- `zero` forgets every block: the next accumulation starts from zeros without touching the disk.

The file is cut into page-aligned blocks of ``block_bytes``; a block is *valid* once this
accumulation wrote it. Blocks never written since `zero` read as zeros (a parameter unused this
step has a zero gradient, as in memory). Everything goes through one `Swapper` (dsio handle on
dsio's loop thread, bounded pinned pool), the machinery of the parameter and optimizer swaps.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.offload.swapper import ALIGN, STAGING_BYTES, Lease, Swapper, SwapperStatistics, align_up

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
    """Blocks read back before a write (written earlier in the same accumulation)."""
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
        room = pinned_budget - STAGING_BYTES
        count = max(2, buffer_count) if room >= max(2, buffer_count) * 4 * ALIGN else 2
        size = min(4 << 20, (room // count) // ALIGN * ALIGN)
        if size < 2 * ALIGN:
            from dstrain.errors import ConfigError

            raise ConfigError(
                "zero_optimization.offload_pinned_bytes",
                f"{pinned_budget} bytes leave no room for {count} gradient swap buffers of {2 * ALIGN} bytes "
                f"and dsio's staging pool",
            )
        self.buffer_bytes = size
        self.block_bytes = size
        self._budget = pinned_budget
        self._swapper: Swapper | None = Swapper(
            nvme_path, "grad", buffer_bytes=size, buffer_count=count, io_config=io_config
        )
        self._closed_stats: SwapperStatistics | None = None
        self._base: dict[int, int] = {}  # group -> region offset in the file
        self._total: dict[int, int] = {}
        self._valid: dict[int, list[bool]] = {}  # group -> per block: written since `zero`
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

    def place(self, group: int, total: int) -> None:
        """Give param group ``group`` a region of ``total`` fp32 elements (all zero)."""
        sw = self._live()
        self._base[group] = sw.reserve_region(total * _F32)
        self._total[group] = total
        self._valid[group] = [False] * (-(-total * _F32 // self.block_bytes))

    def _live(self) -> Swapper:
        if self._swapper is None:
            from dsio.errors import ClosedError

            raise ClosedError("the gradient store is closed")
        return self._swapper

    def _blocks(self, group: int, start: int, numel: int) -> range:
        lo = start * _F32 // self.block_bytes
        hi = -(-(start + numel) * _F32 // self.block_bytes)
        return range(lo, hi)

    def _block_span(self, group: int, b: int) -> tuple[int, int, int, int]:
        """(file offset, bytes, first element, elements) of block ``b`` of ``group``."""
        per = self.block_bytes // _F32
        first = b * per
        n = min(per, self._total[group] - first)
        return self._base[group] + b * self.block_bytes, align_up(n * _F32), first, n

    def _wait(self, fut: concurrent.futures.Future[Any]) -> Any:
        if not fut.done():
            t0 = time.perf_counter()
            concurrent.futures.wait([fut])
            self._stall += time.perf_counter() - t0
        return fut.result()

    # -- accumulation (during backward) ---------------------------------------------------------

    def accumulate(self, group: int, start: int, values: torch.Tensor, alpha: float) -> None:
        """Gradient elements ``[start, start + values.numel())`` of ``group`` += ``values * alpha``,
        with the arithmetic of ``buffer[start:end].add_(values, alpha=alpha)`` on a resident buffer."""
        sw = self._live()
        n = values.numel()
        valid = self._valid[group]
        blocks = self._blocks(group, start, n)
        tmp = torch.zeros(n, dtype=torch.float32)  # (n,) this unit's running sum, zeros where unwritten
        for b in blocks:
            if valid[b]:
                off, nbytes, first, count = self._block_span(group, b)
                lease = self._wait(sw.fetch_range(off, nbytes))
                lo, hi = max(first, start), min(first + count, start + n)
                tmp[lo - start : hi - start].copy_(lease.view(torch.float32, (lo - first) * _F32, hi - lo))
                sw.discard(lease)
        tmp.add_(values.reshape(-1), alpha=alpha)  # the same call, on the same shapes, as in memory
        for b in blocks:
            off, nbytes, first, count = self._block_span(group, b)
            lo, hi = max(first, start), min(first + count, start + n)
            if valid[b]:
                if lo > first or hi < first + count:  # other units' elements of this block: keep them
                    lease = self._wait(sw.fetch_range(off, nbytes))
                    self._rmw += 1
                else:
                    lease = self._wait(sw.acquire_any())
            else:
                lease = self._wait(sw.acquire_any())
                lease.tensor[:nbytes].zero_()  # not written since `zero`: every other element is 0
            lease.view(torch.float32, (lo - first) * _F32, hi - lo).copy_(tmp[lo - start : hi - start])
            sw.store_range(lease, off, nbytes)  # write-behind
            valid[b] = True
        self._accumulations += 1

    def zero(self) -> None:
        """Every gradient is zero again (nothing is written: unwritten blocks read as zeros)."""
        for flags in self._valid.values():
            flags[:] = [False] * len(flags)

    # -- reads (in the optimizer step) ------------------------------------------------------------

    def fetch(
        self, group: int, start: int, numel: int
    ) -> concurrent.futures.Future[tuple[Lease, torch.Tensor]]:
        """A buffer holding gradient elements ``[start, start + numel)`` of ``group`` (after any
        write of those pages still in flight; zeros for blocks not written since `zero`) and the
        fp32 view of them. Hand it back with `discard`."""
        sw = self._live()
        base = self._base[group]
        lo = base + start * _F32
        first = lo - lo % ALIGN
        at = lo - first
        nbytes = align_up(at + numel * _F32)
        if nbytes > self.buffer_bytes:
            raise ValueError(
                f"a gradient range of {numel} elements exceeds a swap buffer ({self.buffer_bytes} B)"
            )
        unwritten = [b for b in self._blocks(group, start, numel) if not self._valid[group][b]]
        spans = [self._block_span(group, b) for b in unwritten]
        inner = sw.fetch_range(first, nbytes)
        out: concurrent.futures.Future[tuple[Lease, torch.Tensor]] = concurrent.futures.Future()

        def done(f: concurrent.futures.Future[Lease]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            lease = f.result()
            view = lease.view(torch.float32, at, numel)
            for _, _, bfirst, bcount in spans:  # stale bytes of an earlier step: zeros
                a, z = max(bfirst, start), min(bfirst + bcount, start + numel)
                view[a - start : z - start].zero_()
            out.set_result((lease, view))

        inner.add_done_callback(done)
        self._fetches += 1
        return out

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
