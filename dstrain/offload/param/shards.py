"""`OffloadedShards`: stage-3 parameter shards on CPU or NVMe (ZeRO-Infinity ``offload_param``).

A `dstrain.zero.units.ShardStore` that Stage3Zero is built with. Each param group's shards are laid
end to end (the group's ``offsets``), as in the resident layout:

- ``device="cpu"``: in a host buffer per group, apart from the training device's tensors. A gather
  copies the unit's shard into its own slot of the gathered buffer (host -> device on a GPU).
- ``device="nvme"``: in one file per rank, a page-aligned region per group, through one `Swapper`
  (dsio handle on dsio's loop thread, bounded pinned pool). Reads run ahead along the order of
  the shard reads of the last pass (recorded here, from `begin_pass` to the step: the gathers'
  own order, whatever the gather prefetch depth, a unit used in forward and backward once per
  use); a gather copies the shard out of its buffer, which goes back to the pool unwritten (or
  stays as the read of the unit's next gather when the read-ahead holds it until then anyway:
  `TraceReadAhead.release`, ``gathers_reused``), so a shard is read at most once per gather.
  Shards are written once per step, after the optimizer. At fp32 with `holds_master` the pass's
  first shard is kept as the step stores it (`_stepped_range`: a GPT's embedding, final last in
  backward, gathered first in forward) and copied instead of read back (``gathers_from_step``).

The fp32 master: resident (a tensor of the group) unless `holds_master` (parameters and optimizer
state both on NVMe): then `OffloadAdam` reads and writes it sub-group by sub-group through the
store's `SwappedMaster` (``master``: `fetch_master` / `store_master`), and no full-size master or
shard copy stays in memory. At fp32 the master *is* the shard in the file; at bf16/fp16 it lives in
a file of its own (`MasterFile`) and each stepped range is cast into the shard file as it is stored
(`SwappedMaster.stream_shard`).

Gradients: in memory (`Stage3Zero`'s ``master_grad``; on a GPU with `holds_master` and ``pin_memory``,
page-locked host tensors as ZeRO-Offload's: docs/offload.md) unless, on a CPU run, ``host_budget`` (the
``offload_pinned_bytes`` budget) cannot hold them: then `expect` makes an `OffloadedGrads` (``grads``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsio import all_done
from dstrain.errors import ConfigError
from dstrain.offload.param.grads import GradStoreStatistics, OffloadedGrads
from dstrain.offload.param.host_master import HostGradCopies
from dstrain.offload.param.master_file import MasterFile
from dstrain.offload.param.read_ahead import TraceReadAhead
from dstrain.offload.param.swapped_master import SwappedMaster
from dstrain.offload.swap.swapper import ALIGN, STAGING_BYTES, Lease, Swapper, SwapperStatistics, align_up
from dstrain.zero.units import ShardStore, Unit

if TYPE_CHECKING:
    from dstrain.checkpoint.sources import SwapRegions
    from dstrain.zero.reduce import Handle
    from dstrain.zero.units import ShardGroup

__all__ = ["OffloadedShards", "ParamStoreStatistics"]

log = logging.getLogger(__name__)

_BUDGET = "zero_optimization.offload_pinned_bytes"

_MIN_PIECE = 1 << 20
"""Smallest pool buffer when a shard is read in pieces (`OffloadedShards._pieces_pool`): a request of
dsio's default block size, so a large shard is a few large reads, not thousands of small ones."""


@dataclass(frozen=True, slots=True)
class ParamStoreStatistics:
    """Swap and stall counters of one rank's offloaded parameter shards."""

    device: str
    holds_master: bool
    shard_bytes: int
    """Bytes of this rank's shards (all groups) in the store."""
    stall_seconds: float
    """Training-thread time spent waiting for a shard (or master range) not read yet."""
    prefetch_hits: int
    """Gathers whose shard was already read when the gather needed it."""
    prefetch_misses: int
    master_reads: int
    """Master ranges the optimizer asked for (`SwappedMaster.fetch_master`), read or assembled."""
    master_writes: int
    shard_writes: int
    """Shard ranges written after steps (resident-master mode) and at initialization."""
    pinned_budget: int
    pinned_bytes: int
    """Pinned bytes this store allocated (never above ``pinned_budget``)."""
    swapper: SwapperStatistics | None
    grads: GradStoreStatistics | None = None
    """The gradient store's counters when gradients are on NVMe too (else None)."""
    master_swapper: SwapperStatistics | None = None
    """The fp32 master file's swapper (bf16/fp16 shards with `holds_master`; else None)."""
    master_from_gathers: int = 0
    """Of ``master_reads``, ranges assembled from the backward gathers' shards instead of read from
    the file (fp32 with `holds_master`, during backward: `SwappedMaster.capture`)."""
    master_from_gathers_bytes: int = 0
    """Their page-rounded bytes: what reading them would have cost."""
    gathers_from_step: int = 0
    """Of ``prefetch_hits``, gathers that copied their shard from the master ranges the step before
    had just stored (the pass's first unit, fp32 with `holds_master`) instead of reading it back."""
    gathers_from_step_bytes: int = 0
    """Their shards' page-rounded bytes: what reading them would have cost."""
    gathers_reused: int = 0
    """Of ``prefetch_hits``, gathers served by the buffers an earlier gather of the same unit in the
    same pass kept (`TraceReadAhead.release`: the last units of forward, first in backward) instead
    of reading the shard again."""
    gathers_reused_bytes: int = 0
    """Their shards' page-rounded bytes: what reading them again would have cost."""


class OffloadedShards(ShardStore):
    """Shards of every stage-3 unit of this rank on ``device`` (``"cpu"`` or ``"nvme"``)."""

    streams_initial_shards = True  # `place` builds one unit's shard at a time (no copy of them all)

    def __init__(
        self,
        device: str,
        *,
        dtype: torch.dtype,
        nvme_path: str | None = None,
        pinned_budget: int = 1 << 29,
        buffer_count: int = 5,
        buffer_size: int = 100_000_000,
        pin_memory: bool = False,
        holds_master: bool = False,
        io_config: Any = None,
        host_budget: int | None = None,
        grads_on_host: bool = True,
    ) -> None:
        if device not in ("cpu", "nvme"):
            raise ConfigError(
                "zero_optimization.offload_param.device", f"expected cpu or nvme, got {device!r}"
            )
        if holds_master and device != "nvme":
            raise ValueError("the store holds the master only with shards on NVMe")
        self.device = device
        self.dtype = dtype
        self.holds_master = holds_master
        self._esize = torch.empty((), dtype=dtype).element_size()
        self._nvme_path = nvme_path
        self._budget = pinned_budget
        self._count_hint = buffer_count
        self._size_hint = buffer_size
        self._pin = pin_memory and torch.cuda.is_available()
        self._io_config = io_config
        # gradients go to NVMe too when this many bytes (offload_pinned_bytes) cannot hold them
        self._host_budget = host_budget
        self.grads: OffloadedGrads | None = None
        # on a GPU with `holds_master`: the gradient partitions in host memory, copied out through these
        self._grads_on_host = grads_on_host
        self._grad_copies: HostGradCopies | None = None
        # bf16/fp16 with `holds_master`: the fp32 master in a file of its own (at fp32 it is the shard)
        self._mfile: MasterFile | None = None
        # with `holds_master`: the fp32 master, for OffloadAdam (made by `expect`, once the file is open)
        self.master: SwappedMaster | None = None
        self._groups: dict[int, ShardGroup] = {}
        self._host: dict[int, torch.Tensor] = {}  # device="cpu": (group total,) per group
        self._base: dict[int, int] = {}  # device="nvme": the group's region offset in the file
        self._swapper: Swapper | None = None
        self._closed_stats: SwapperStatistics | None = None
        self._ahead = TraceReadAhead(
            self._read_unit,
            self._discard,
            self._unit_of,
            # the buffers the optimizer borrows during backward are not the read-ahead's then
            lambda: (
                self._swapper.buffers - (self._lent if self._ahead.in_pass else 0) if self._swapper else 0
            ),
            lambda unit: len(self._pieces(unit)),
            self._kept_whole,
        )
        # fp32 with `holds_master`: the shard of the unit the next pass gathers first, as the step
        # stored it (`_stepped_range`): (unit index, (shard,) values, {range start: elements kept})
        self._kept: tuple[int, torch.Tensor, dict[int, int]] | None = None
        self._lent = 0  # shard-pool buffers the read-ahead leaves to the optimizer (`_lend`)
        self._unit_group: dict[int, ShardGroup] = {}
        self._stall = 0.0
        self._hits = self._misses = 0
        self._shard_writes = 0
        self._from_step = self._from_step_bytes = 0
        self._reused = self._reused_bytes = 0
        self.buffer_bytes = 0
        from dstrain.offload.metrics import register_offload

        register_offload(self, kind="param")  # dstrain_offload_*{kind="param"} at scrape time

    # -- layout -------------------------------------------------------------------------------

    def place(self, group: ShardGroup) -> None:
        """Move ``group``'s initial shards into the store; keep a resident fp32 master unless the
        store holds it. Units' ``shard`` becomes empty (the store owns the values); no copy of the
        whole group is staged on the way."""
        self._groups[group.index] = group
        for u in group.units:
            self._unit_group[u.index] = group
        current: dict[int, torch.Tensor] = {}  # the one unit whose initial shard is built right now

        def shard_of(u: Unit) -> torch.Tensor:
            if u.index not in current:
                current.clear()
                current[u.index] = u.initial_shard()  # from the model's own parameter memory
            return current[u.index]

        def fill(out: torch.Tensor, start: int) -> None:
            """Elements ``[start, start + out.numel())`` of the group's shards into ``out``."""
            for u in group.units:
                off, n = group.offsets[u.index], u.layout.shard
                lo, hi = max(off, start), min(off + n, start + out.numel())
                if lo < hi:
                    out[lo - start : hi - start].copy_(shard_of(u)[lo - off : hi - off])

        if self.holds_master:
            # never touched (so never resident); storage-less once the views exist (`placed`); on the
            # host with the gradients there (a view's ``.grad`` is on its device)
            where = torch.device("cpu") if self._grad_copies is not None else group.device
            group.master = torch.empty(group.total, dtype=torch.float32, device=where)
        else:
            group.master = torch.empty(group.total, dtype=torch.float32, device=group.device)
            fill(group.master, 0)
        if self.device == "cpu":
            host = torch.empty(group.total, dtype=self.dtype, pin_memory=self._pin)
            fill(host, 0)
            self._host[group.index] = host
        else:
            if self._swapper is None:
                raise RuntimeError("OffloadedShards.expect(units) must run before place()")
            self._base[group.index] = self._swapper.reserve_region(group.total * self._esize)
            self._write_group(group, fill)
            if self._mfile is not None:  # the fp32 master starts as the shards' values, upcast
                self._mfile.place(group.index, group.total, fill)
        for u in group.units:
            u.shard = torch.empty(0, dtype=self.dtype, device=group.device)
            u.drop_origin()  # the model's original parameter memory goes now
        current.clear()

    def expect(self, units: Sequence[Unit]) -> None:
        """Size the swap buffers for the largest shard of every unit and open the swap file."""
        if self.device != "nvme" or self._swapper is not None:
            return
        assert self._nvme_path is not None
        largest = max((u.layout.shard for u in units), default=1)
        # a unit's shard spans its pages plus at most one partial page at each end
        need = align_up(largest * self._esize) + 2 * ALIGN
        grad_bytes = 4 * sum(u.layout.shard for u in units)  # this rank's fp32 gradient shards
        on_cpu = all(u.full.device.type == "cpu" for u in units)  # on a GPU they stay in its memory
        over = self._host_budget is not None and grad_bytes > self._host_budget
        if self.holds_master and not on_cpu and self._grads_on_host and self._pin:
            # the step reads nothing else from the GPU: its gradients go to the host beside the master
            # (page-locked only: a copy into pageable memory crosses PCIe ~30x slower, see host_master)
            self._grad_copies = HostGradCopies(self._pin)
            log.info(
                "offload: fp32 gradient shards (%d bytes) in page-locked host memory (beside %s)",
                grad_bytes,
                _BUDGET,
            )
        elif over and not on_cpu:
            log.info("offload: fp32 gradient shards (%d bytes) stay in the GPU's memory", grad_bytes)
        offload_grads = over and on_cpu
        own_master = self.holds_master and self.dtype != torch.float32
        # the shard pool keeps at least one buffer; the gradient and master files share the rest with it
        share = max(0, self._budget - need - STAGING_BYTES) // (1 + offload_grads + own_master)
        if offload_grads:
            # "gradients stay in memory unless the budget says otherwise": it says otherwise
            if self.dtype == torch.float16:
                from dstrain.errors import NotImplementedConfigError

                raise NotImplementedConfigError(
                    _BUDGET,
                    f"fp16's loss scaling needs the gradients in memory, and {grad_bytes} bytes of fp32 "
                    f"gradient shards exceed {self._host_budget}: raise the budget or use bf16",
                )
            log.info(
                "offload: fp32 gradient shards (%d bytes) exceed %s=%d: gradients go to NVMe too",
                grad_bytes,
                _BUDGET,
                self._host_budget,
            )
            self.grads = OffloadedGrads(self._nvme_path, pinned_budget=share, io_config=self._io_config)
            self._budget -= self.grads.pinned_bytes
        if own_master:
            self._mfile = MasterFile(
                self._nvme_path, pinned_budget=share, on_store=self._master_stored, io_config=self._io_config
            )
            self._budget -= self._mfile.pinned_bytes
        room = self._budget - STAGING_BYTES
        hint = align_up(min(self._size_hint * self._esize, max(room // max(self._count_hint, 1), need)))
        size = max(need, hint)
        if size > room:
            raise ConfigError(
                _BUDGET,
                f"{self._budget} bytes cannot hold one parameter swap buffer of {size} bytes "
                f"(the largest unit's shard plus alignment) and dsio's staging pool",
            )
        if size != align_up(self._size_hint * self._esize):
            log.info(
                "offload_param.buffer_size: %d -> %d bytes per buffer", self._size_hint * self._esize, size
            )
        count = max(1, min(self._count_hint, room // size))
        if count < self._count_hint:
            size, count = self._pieces_pool(units, room, size, count)
            log.info(
                "offload_param: %d swap buffers of %d bytes fit %s=%d", count, size, _BUDGET, self._budget
            )
        self.buffer_bytes = size
        self._swapper = Swapper(
            self._nvme_path, "param", buffer_bytes=size, buffer_count=count, io_config=self._io_config
        )
        if self.holds_master:
            self.master = SwappedMaster(
                self._swapper,
                self._mfile,
                dtype=self.dtype,
                buffer_bytes=size,
                groups=self._groups,
                base=self._base,
                span=self._span,
                release_reads=self._release_reads,
                lend=self._lend,
                will_gather=self._ahead.will_read,
                on_stored=self._stepped_range if self._mfile is None else None,
            )

    def _pieces_pool(self, units: Sequence[Unit], room: int, size: int, count: int) -> tuple[int, int]:
        """(buffer bytes, count) when ``room`` holds fewer than the hinted buffers of the largest
        shard (``size``, ``count`` of them): buffers of a typical shard (the median of those read
        every pass, persistent units being read once; at least `_MIN_PIECE`), a larger shard read in several
        (`_pieces`), if that gives the read-ahead more bytes and it can still hold the largest
        shard's pieces with what the optimizer may borrow during backward taken out
        (`SwappedMaster.lend_master_buffers`: half the buffers at fp32, one at bf16/fp16); else
        ``(size, count)``. A 110M GPT's tied embedding (49 MB per rank) beside 4.7 MB layers left
        two whole-shard buffers, one of them lent: the gathers read one shard ahead."""

        def reads(n: int) -> int:
            if not self.holds_master or n < 2:
                return n
            return n - (n // 2 if self.dtype == torch.float32 else 1)

        shards = sorted(u.layout.shard for u in units if not u.persistent) or [1]
        piece = max(align_up(shards[len(shards) // 2] * self._esize) + 2 * ALIGN, _MIN_PIECE)
        more = room // piece
        if piece >= size or reads(more) < -(-size // piece) or reads(more) * piece <= reads(count) * size:
            return size, count
        return piece, more

    def _master_stored(self, group: int, start: int, values: torch.Tensor) -> None:
        assert self.master is not None
        self.master.stream_shard(group, start, values)

    def _stepped_range(self, group: int, start: int, values: torch.Tensor) -> None:
        """fp32 with `holds_master`: master elements ``[start, start + values.numel())`` of ``group``,
        just stepped, are about to be written. Keep the part in the shard of the unit the next pass
        gathers first: the forward's first gather would otherwise wait for the step's last writes
        and read those bytes back (the 110M GPT's tied embedding: 49 MB per rank, most of the
        gathers' stall), where it copies them from here (`_kept_whole`)."""
        unit = self._ahead.first()
        if unit is None or self._unit_group[unit.index].index != group:
            return
        off, n = self._unit_group[unit.index].offsets[unit.index], unit.layout.shard
        lo, hi = max(start, off), min(start + values.numel(), off + n)
        if lo >= hi:
            return
        if self._kept is None or self._kept[0] != unit.index:
            self._kept = (unit.index, torch.empty(n, dtype=torch.float32), {})
        self._kept[1][lo - off : hi - off].copy_(values[lo - start : hi - start])
        self._kept[2][start] = hi - lo  # a sub-group's range: the same start, step after step

    def _kept_whole(self, unit: Unit) -> bool:
        """Whether `_stepped_range` kept every element of ``unit``'s shard (its next gather copies
        them, the read-ahead skips its read)."""
        kept = self._kept
        return kept is not None and kept[0] == unit.index and sum(kept[2].values()) == unit.layout.shard

    def _lend(self, buffers: int) -> None:
        """The shard read-ahead counts ``buffers`` fewer pool buffers as its own (the optimizer's
        master ranges and shard writes during backward use them: `SwappedMaster.lend_master_buffers`)."""
        self._lent = buffers

    def _release_reads(self) -> None:
        """The optimizer's step takes the pool: shard read-ahead ends (it restarts in forward)."""
        self._ahead.end_pass()
        if self._ahead.queued:
            self._cancel_queue()

    # -- nvme helpers ---------------------------------------------------------------------------

    def _span(self, group: ShardGroup, start: int, numel: int) -> tuple[int, int, int]:
        """(file offset, bytes, byte offset inside the buffer) of elements ``[start, start+numel)``."""
        lo = self._base[group.index] + start * self._esize
        hi = self._base[group.index] + (start + numel) * self._esize
        first = lo - lo % ALIGN
        return first, align_up(hi) - first, lo - first

    def placed(self, group: ShardGroup) -> None:
        """The master's views exist: with `holds_master` its storage goes (its values are in the
        file; the views keep shapes and offsets for the optimizer)."""
        if self.holds_master:
            group.master.untyped_storage().resize_(0)

    def _write_group(
        self, group: ShardGroup, fill: Callable[[torch.Tensor, int], None], wait: bool = True
    ) -> None:
        """Write a whole group's shards, one buffer at a time (page-aligned pieces); ``fill(out,
        start)`` puts elements ``[start, start + out.numel())`` into ``out``. ``wait=False``: write
        behind (later reads of those pages wait for the writes, on the loop thread)."""
        assert self._swapper is not None
        self._cancel_queue()  # read-ahead left over from the last pass must not hold the buffers
        self._kept = None  # the shards change: a kept shard is stale
        per = (self.buffer_bytes // ALIGN) * ALIGN // self._esize
        futs = []
        for start in range(0, group.total, per):
            n = min(per, group.total - start)
            off, nbytes, at = self._span(group, start, n)
            lease = self._swapper.acquire_any().result()
            lease.tensor[:nbytes].zero_()
            try:
                fill(lease.view(self.dtype, at, n), start)
            except BaseException:
                self._swapper.discard(lease)  # e.g. a checkpoint's checksum error: the buffer goes back
                raise
            futs.append(self._swapper.store_range(lease, off, nbytes))
            self._shard_writes += 1
        if wait:
            for f in futs:
                f.result()

    def _write_values(self, group: ShardGroup, values: torch.Tensor, wait: bool = True) -> None:
        flat = values.reshape(-1)

        def fill(out: torch.Tensor, start: int) -> None:
            out.copy_(flat[start : start + out.numel()])  # cast to the shard dtype by copy_

        self._write_group(group, fill, wait)

    def _pieces(self, unit: Unit) -> list[tuple[int, int, int, int]]:
        """The pool buffers a read of ``unit``'s shard takes: ``(file offset, bytes, first element,
        elements)`` of each, in file order (one unless the shard spans more than a buffer)."""
        group = self._unit_group[unit.index]
        off, nbytes, at = self._span(group, group.offsets[unit.index], unit.layout.shard)
        lo, hi = off + at, off + at + unit.layout.shard * self._esize  # the shard's bytes
        out = []
        for p in range(off, off + nbytes, self.buffer_bytes):
            n = min(self.buffer_bytes, off + nbytes - p)
            a, z = max(lo, p), min(hi, p + n)
            out.append((p, n, (a - lo) // self._esize, (z - a) // self._esize))
        return out

    def _read_unit(self, unit: Unit) -> concurrent.futures.Future[list[Lease]]:
        assert self._swapper is not None
        sw = self._swapper
        # One future for the shard, done when every piece is (a failed piece: its error once all ended,
        # the pieces read for nothing back to the pool)
        return all_done([sw.fetch_range(p, n) for p, n, _, _ in self._pieces(unit)], discard=sw.discard)

    def _discard(self, leases: list[Lease]) -> None:
        assert self._swapper is not None
        for lease in leases:
            self._swapper.discard(lease)

    def _cancel_queue(self) -> None:
        """Hand back read-ahead buffers unused (the optimizer or a group write needs the pool)."""
        self._ahead.cancel()

    # -- the ShardStore surface -----------------------------------------------------------------

    def begin_pass(self) -> None:
        """Adopt the last pass's reads as the trace if it changed, and start reading its first shards."""
        if self._swapper is None:
            return
        self._ahead.begin_pass()

    def _unit_of(self, index: int) -> Unit | None:
        group = self._unit_group.get(index)
        if group is None:
            return None
        return next((u for u in group.units if u.index == index), None)

    def input_for(self, unit: Unit) -> torch.Tensor:
        """Copy ``unit``'s shard into its own slot of the gathered buffer and return that slot."""
        group = self._unit_group[unit.index]
        own = unit.full[unit.layout.lo : unit.layout.hi]
        off = group.offsets[unit.index]
        if self.device == "cpu":
            own.copy_(self._host[group.index][off : off + unit.layout.shard])
            return own
        assert self._swapper is not None
        kept, whole = self._kept, self._kept_whole(unit)
        if kept is not None and kept[0] == unit.index:
            self._kept = None  # used once (the file has the same values for the later gathers)
        if whole:
            assert kept is not None
            own.copy_(kept[1])  # as the step stored it, no read
            self._hits += 1
            self._from_step += 1
            self._from_step_bytes += sum(p[1] for p in self._pieces(unit))
            self._ahead.passed(unit)
        else:
            reused = self._ahead.reused
            fut = self._ahead.take(unit)  # read ahead along the recorded order, or now
            if self._ahead.reused > reused:  # the buffers an earlier gather of this pass kept
                self._reused += 1
                self._reused_bytes += sum(p[1] for p in self._pieces(unit))
            if fut.done():
                self._hits += 1
            else:
                self._misses += 1
                t0 = time.perf_counter()
                concurrent.futures.wait([fut])
                self._stall += time.perf_counter() - t0
            leases = fut.result()
            for lease, (p, _, e0, n) in zip(leases, self._pieces(unit), strict=True):
                at = self._base[group.index] + (off + e0) * self._esize - p  # its first byte in the buffer
                own[e0 : e0 + n].copy_(lease.view(self.dtype, at, n))
            self._ahead.release(unit, leases)  # unchanged: kept for its next gather, or back unwritten
        if self.master is not None and self.master.file is None:  # fp32: the shard is master too
            self.master.capture(group.index, off, own, unit.index)
        self._ahead.top_up()  # its buffers are free again: read the next shards of the trace into them
        return own

    def shard_numel(self, unit: Unit) -> int:
        return 0  # nothing of the shard stays in the training device's memory

    def new_master_grad(self, group: ShardGroup) -> torch.Tensor:
        """``group``'s fp32 gradient partition: in page-locked host memory on a GPU with `holds_master`
        and ``pin_memory``, else on the group's device."""
        if self._grad_copies is None:
            return super().new_master_grad(group)
        return torch.zeros(group.total, dtype=torch.float32, pin_memory=self._pin)

    def add_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
        if self._grad_copies is None or target.device == grad.device:
            super().add_grad(target, grad, alpha)
            return
        self._grad_copies.add(target, grad, alpha)  # a GPU gradient into its host range, staged

    def put_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> Handle:
        if self._grad_copies is None or target.device == grad.device:
            return super().put_grad(target, grad, alpha)
        return self._grad_copies.put(target, grad, alpha)  # one DMA into the host range, queued

    def after_step(self, group: ShardGroup) -> None:
        """Write the stepped master (cast to the shard dtype) once; nothing when the optimizer
        wrote it already (`holds_master`). On NVMe, then submit the reads of the group's units that
        stay gathered (persistent): `Stage3Zero.after_step` refreshes them next, one by one, and
        each would otherwise wait for its read alone (these wait for the writes they overlap)."""
        self._ahead.end_pass()
        if not self.holds_master:
            values = group.master.detach()
            if self.device == "cpu":
                self._host[group.index].copy_(values)
            else:
                self._write_values(group, values, wait=False)
        if self.device == "nvme":
            self._ahead.read_now([u for u in group.units if u.gathered])

    def read_master(self, group: ShardGroup) -> torch.Tensor:
        if self.master is None:
            return group.master.detach()
        return self.master.read(group)

    def checkpoint_master(self, group: ShardGroup) -> torch.Tensor | SwapRegions:
        """``group``'s fp32 master for a checkpoint: with `holds_master`, a lazy source over its
        file region (`SwappedMaster.checkpoint_master`), never materialized; else the tensor."""
        if self.master is None:
            return group.master.detach()
        return self.master.checkpoint_master(group)

    def load_master(self, group: ShardGroup, fill: Callable[[torch.Tensor, int], None]) -> None:
        """Replace ``group``'s master and shards with what ``fill(out, start)`` gives (a checkpoint's
        tensor or stored tensor, see `dstrain.zero.stage3.master_fill`). With `holds_master` the
        values go a swap buffer at a time, in element order, into the shard file (fp32: the master)
        or the master file and, cast, the shard file: no whole master is ever in memory."""
        if not self.holds_master:
            fill(group.master.detach(), 0)  # the master lives in memory anyway
            self.after_step(group)
            return
        self._ahead.end_pass()
        self._cancel_queue()  # the shard buffers are the load's now
        self._kept = None
        assert self.master is not None and self._swapper is not None
        if self.master.file is None:
            self._write_group(group, fill)  # at fp32 the shards are the master
            return
        self.master.load_file(group.index, fill)  # each range also cast into the shard file
        self._swapper.drain()  # the shard writes of `ShardStream` (their errors surface here)

    def write_shard(self, group: ShardGroup, unit: Unit, values: torch.Tensor) -> None:
        """Replace ``unit``'s shard and its range of the fp32 master with ``values`` (see
        `ShardStore.write_shard`): in the host buffer, or read-modify-written in the shard file
        (a buffer at a time: the shard's pieces); with `holds_master` the master is the shard
        file at fp32, and the master file as well at bf16/fp16. Shards already read ahead hold the
        old values and go back to the pool unused."""
        start, n = group.offsets[unit.index], unit.layout.shard
        self._cancel_queue()
        self._kept = None  # a kept shard holds the values before this write
        if not self.holds_master:
            group.master.detach()[start : start + n].copy_(values)  # resident
        if self.device == "cpu":
            self._host[group.index][start : start + n].copy_(values)
            return
        assert self._swapper is not None
        if self.master is not None and self.master.file is not None:
            self.master.file.write_range(group.index, start, values)
        for p, nbytes, e0, k in self._pieces(unit):  # one buffer each (`_pieces_pool`)
            lease = self._swapper.fetch_range(p, nbytes).result()  # the pages' other bytes kept
            at = self._base[group.index] + (start + e0) * self._esize - p
            lease.view(self.dtype, at, k).copy_(values[e0 : e0 + k])
            self._swapper.store_range(lease, p, nbytes).result()
            self._shard_writes += 1

    # -- introspection and lifetime -------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes of the shard swapper plus the gradient store's and master file's (when they exist)."""
        grads = self.grads.pinned_bytes if self.grads is not None else 0
        grads += self._mfile.pinned_bytes if self._mfile is not None else 0
        if self._swapper is not None:
            return self._swapper.pinned_bytes + grads
        if self._closed_stats is not None:
            return self._closed_stats.pinned_bytes + grads
        if self._pin:
            return sum(h.numel() * h.element_size() for h in self._host.values())
        return 0

    def statistics(self) -> ParamStoreStatistics:
        sw = self._swapper.statistics() if self._swapper is not None else self._closed_stats
        return ParamStoreStatistics(
            device=self.device,
            holds_master=self.holds_master,
            shard_bytes=sum(g.total for g in self._groups.values()) * self._esize,
            stall_seconds=self._stall,
            prefetch_hits=self._hits,
            prefetch_misses=self._misses,
            master_reads=self.master.reads if self.master is not None else 0,
            master_from_gathers=self.master.from_gathers if self.master is not None else 0,
            master_from_gathers_bytes=self.master.from_gathers_bytes if self.master is not None else 0,
            gathers_from_step=self._from_step,
            gathers_from_step_bytes=self._from_step_bytes,
            gathers_reused=self._reused,
            gathers_reused_bytes=self._reused_bytes,
            master_writes=self.master.writes if self.master is not None else 0,
            shard_writes=self._shard_writes + (self.master.shard_writes if self.master is not None else 0),
            pinned_budget=self._budget
            + (self.grads.pinned_bytes if self.grads is not None else 0)
            + (self._mfile.pinned_bytes if self._mfile is not None else 0),
            pinned_bytes=self.pinned_bytes,
            swapper=sw,
            grads=self.grads.statistics() if self.grads is not None else None,
            master_swapper=self._mfile.statistics() if self._mfile is not None else None,
        )

    def close(self) -> None:
        """Hand back read-ahead buffers, finish writes, free the pool, delete the swap file."""
        from dstrain.offload.metrics import unregister_offload

        unregister_offload(self)
        try:
            if self._swapper is not None:
                try:
                    self._cancel_queue()
                finally:
                    self._swapper.close()
                    self._closed_stats = self._swapper.statistics()
                    self._swapper = None
        finally:
            if self.grads is not None:
                self.grads.close()
            if self._mfile is not None:
                self._mfile.close()
        self._host.clear()
