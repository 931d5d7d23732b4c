"""`MasterFile`: the fp32 master of a bf16/fp16 stage-3 run, in its own swap file.

With parameters and optimizer state on NVMe, nothing of the master should stay in memory. At fp32
the master *is* the parameter shard (`OffloadedShards` reads and writes it in the shard file). At
bf16/fp16 the shards are half-precision copies, so the fp32 master needs a file of its own: one
page-aligned region per param group, read and written by `OffloadAdam` sub-group by sub-group
(`fetch` / `store`), through one `Swapper` (dsio handle on dsio's loop thread, bounded pinned pool).
Sub-group ranges start at multiples of 1024 elements (4096 bytes), so each range is its own pages
and a write never overlaps another range's.

The parameter store turns every stepped range into the half-precision shard as it is stored
(``on_store``), so the shard file is rewritten once per step from the stepped master, exactly the
``copy_`` (round to nearest even) the resident path makes.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch

from dstrain.errors import ConfigError
from dstrain.offload.swap.swapper import ALIGN, Lease, Swapper, SwapperStatistics, align_up, budget_buffers

__all__ = ["MasterFile", "ShardStream"]

_F32 = 4


class MasterFile:
    """fp32 master regions of every param group of this rank, in one swap file under ``nvme_path``."""

    def __init__(
        self,
        nvme_path: str,
        *,
        pinned_budget: int,
        on_store: Callable[[int, int, torch.Tensor], None],
        buffer_count: int = 3,
        io_config: Any = None,
    ) -> None:
        # small budgets: two buffers (one read ahead while one is stepped)
        buffer_count, size = budget_buffers(pinned_budget, buffer_count, 8 << 20)
        if size < 2 * ALIGN:
            raise ConfigError(
                "zero_optimization.offload_pinned_bytes",
                f"{pinned_budget} bytes leave no room for {buffer_count} fp32 master swap buffers",
            )
        self.buffer_bytes = size
        self._on_store = on_store
        self._swapper: Swapper | None = Swapper(
            nvme_path, "master", buffer_bytes=size, buffer_count=buffer_count, io_config=io_config
        )
        self._closed_stats: SwapperStatistics | None = None
        self._base: dict[int, int] = {}
        self._total: dict[int, int] = {}

    @property
    def buffers(self) -> int:
        """Swap buffers of the master file's pool."""
        return self._live().buffers

    @property
    def max_numel(self) -> int:
        """The most master elements one `fetch` can hold (a multiple of 1024)."""
        return (self.buffer_bytes - ALIGN) // _F32 // 1024 * 1024

    def _live(self) -> Swapper:
        if self._swapper is None:
            from dsio.errors import ClosedError

            raise ClosedError("the master file is closed")
        return self._swapper

    def _span(self, group: int, start: int, numel: int) -> tuple[int, int, int]:
        lo = self._base[group] + start * _F32
        first = lo - lo % ALIGN
        return first, align_up(lo + numel * _F32) - first, lo - first

    @property
    def path(self) -> str:
        """The swap file."""
        return self._live().path

    def region(self, group: int) -> tuple[str, int, int]:
        """(file, offset, bytes) of ``group``'s whole master in the swap file (for a checkpoint that
        streams it: `SwappedMaster.checkpoint_master`)."""
        return self.path, self._base[group], self._total[group] * _F32

    def written_span(self, group: int, start: int, numel: int) -> tuple[int, int]:
        """(file offset, bytes) that `store` writes for elements ``[start, start + numel)``."""
        off, nbytes, _ = self._span(group, start, numel)
        return off, nbytes

    def place(self, group: int, total: int, fill: Callable[[torch.Tensor, int], None]) -> None:
        """A region for ``group``'s ``total`` elements, written from ``fill(out, start)`` (elements
        ``[start, start + out.numel())`` of the initial master into ``out``)."""
        sw = self._live()
        self._base[group] = sw.reserve_region(total * _F32)
        self._total[group] = total
        per = self.buffer_bytes // _F32
        futs = []
        for start in range(0, total, per):
            n = min(per, total - start)
            lease = sw.acquire_any().result()
            fill(lease.view(torch.float32, 0, n), start)
            futs.append(sw.store_range(lease, self._base[group] + start * _F32, n * _F32))
        for f in futs:
            f.result()

    def fetch(
        self, group: int, start: int, numel: int
    ) -> concurrent.futures.Future[tuple[Lease, torch.Tensor]]:
        """A buffer with elements ``[start, start + numel)`` of ``group``'s master and the fp32 view."""
        off, nbytes, at = self._span(group, start, numel)
        key = (group, off, nbytes, start, numel, at)
        return self._live().fetch_view(off, nbytes, at, numel, key=key)

    def store(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Hand the stepped range to ``on_store`` (the half-precision shard), then write it back."""
        key: Any = lease.key
        group, off, nbytes, start, numel, at = key
        self._on_store(group, start, lease.view(torch.float32, at, numel))
        return self._live().store_range(lease, off, nbytes)

    def discard(self, lease: Lease) -> concurrent.futures.Future[None]:
        return self._live().discard(lease)

    def read(self, group: int) -> torch.Tensor:
        """``group``'s whole master (for checkpoints), read piecewise."""
        total = self._total[group]
        out = torch.empty(total, dtype=torch.float32)
        per = self.max_numel
        for start in range(0, total, per):
            n = min(per, total - start)
            lease, view = self.fetch(group, start, n).result()
            out[start : start + n].copy_(view)
            self.discard(lease).result()
        return out

    def load(self, group: int, fill: Callable[[torch.Tensor, int], None]) -> None:
        """Replace ``group``'s master with what ``fill(out, start)`` puts into ``out`` (elements
        ``[start, start + out.numel())``), one buffer at a time in element order; each range goes to
        ``on_store`` too (the half-precision shards), as a stepped range does."""
        sw = self._live()
        per = self.buffer_bytes // _F32
        futs = []
        for start in range(0, self._total[group], per):
            n = min(per, self._total[group] - start)
            lease = sw.acquire_any().result()
            view = lease.view(torch.float32, 0, n)
            try:
                fill(view, start)
            except BaseException:
                sw.discard(lease)
                raise
            self._on_store(group, start, view)
            futs.append(sw.store_range(lease, self._base[group] + start * _F32, n * _F32))
        for f in futs:
            f.result()

    def write_range(self, group: int, start: int, values: torch.Tensor) -> None:
        """Overwrite elements ``[start, start + values.numel())`` of ``group``'s master with
        ``values`` (upcast), a buffer at a time, read-modify-write (the pages' other elements are
        kept); ``on_store`` is not called (the caller writes the shard itself)."""
        flat = values.reshape(-1)
        for lo in range(0, flat.numel(), self.max_numel):
            n = min(self.max_numel, flat.numel() - lo)
            off, nbytes, _ = self._span(group, start + lo, n)
            lease, view = self.fetch(group, start + lo, n).result()
            view.copy_(flat[lo : lo + n])
            self._live().store_range(lease, off, nbytes).result()

    @property
    def pinned_bytes(self) -> int:
        if self._swapper is not None:
            return self._swapper.pinned_bytes
        return self._closed_stats.pinned_bytes if self._closed_stats is not None else 0

    def statistics(self) -> SwapperStatistics | None:
        return self._swapper.statistics() if self._swapper is not None else self._closed_stats

    def close(self) -> None:
        if self._swapper is not None:
            try:
                self._swapper.close()
            finally:
                self._closed_stats = self._swapper.statistics()
                self._swapper = None


class ShardStream:
    """One group's half-precision shards rewritten from its stepped master, range by range.

    Ranges may arrive in any order (sub-groups stepped during backward come in the order backward
    finishes their gradients), each once per rewrite. The pages a range covers whole are cast
    straight into swap buffers and written at once; a page it shares with a neighbouring range
    (half-precision ranges start at 2 KiB multiples) is assembled in memory and written once every
    range touching it has arrived. So every write of the shard region (at ``base`` in ``swapper``'s
    file, ``total`` elements of ``dtype``) is page-aligned and never shares a page with a write
    still to come, and a page a later gather may still read is never written before its ranges
    are all stepped.
    """

    def __init__(self, swapper: Swapper, base: int, total: int, dtype: torch.dtype) -> None:
        self._sw = swapper
        self._base = base
        self._total = total
        self._dtype = dtype
        self._esize = torch.empty((), dtype=dtype).element_size()
        self._end = base + total * self._esize  # the region's last byte + 1
        self._stored = 0  # elements stored so far
        self._edges: dict[int, list[Any]] = {}  # page offset -> [page image (uint8), bytes filled]

    @property
    def done(self) -> bool:
        return self._stored == self._total

    def cancel(self) -> None:
        """Drop the pages assembled so far unwritten (a rewrite abandoned part-way)."""
        self._edges.clear()

    def _page_need(self, page: int) -> int:
        """Bytes of the region in the page at file offset ``page``."""
        return min(ALIGN, self._end - page)

    def _write(self, off: int, src: torch.Tensor, dtype: torch.dtype, nbytes: int) -> None:
        """Write ``src`` cast to ``dtype`` (``nbytes`` of the region) at file offset ``off``."""
        lease = self._sw.acquire_any().result()
        lease.tensor[: src.numel() * torch.empty((), dtype=dtype).element_size()].view(dtype).copy_(src)
        self._sw.store_range(lease, off, nbytes)

    def write(self, start: int, values: torch.Tensor) -> int:
        """Cast ``values`` (elements ``[start, start + values.numel())``) into the shard region:
        whole pages written now, shared pages once complete; returns how many writes were submitted."""
        es, n = self._esize, values.numel()
        lo, hi = self._base + start * es, self._base + (start + n) * es
        if start < 0 or start + n > self._total:
            raise ValueError(
                f"master range [{start}, {start + n}) outside the group's {self._total} elements"
            )
        writes = 0
        # the whole pages inside [lo, hi) are [first, last) (the region's end counts as a page end)
        first = align_up(lo)
        last = hi if hi == self._end else hi - hi % ALIGN
        shared = set()
        if first > lo:
            shared.add(lo - lo % ALIGN)  # the page it shares with the range before
        if last < hi:
            shared.add(last)  # the page it shares with the range after
        for page in sorted(shared):
            a, z = max(lo, page), min(hi, page + ALIGN)
            entry = self._edges.setdefault(page, [torch.zeros(ALIGN, dtype=torch.uint8), 0])
            entry[0][a - page : z - page].view(self._dtype).copy_(values[(a - lo) // es : (z - lo) // es])
            entry[1] += z - a
            if entry[1] == self._page_need(page):  # every range of this page is in
                img = self._edges.pop(page)[0]
                self._write(page, img, torch.uint8, self._page_need(page))
                writes += 1
        per = self._sw.buffer_bytes // ALIGN * ALIGN  # bytes of one buffer, whole pages
        for off in range(first, max(first, last), per):
            k = min(per, last - off)
            e0 = (off - lo) // es
            self._write(off, values[e0 : e0 + k // es], self._dtype, k)
            writes += 1
        self._stored += n
        return writes
