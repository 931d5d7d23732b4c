"""`SwappedMaster`: the fp32 master of an NVMe parameter store that holds it (`OffloadedShards` with
``holds_master``: parameters and optimizer state both on NVMe), read and written by `OffloadAdam`
sub-group by sub-group: at fp32 from the shard file (the master *is* the shard), at bf16/fp16 from
the `MasterFile`, each stepped range then cast into the shard file (`ShardStream`).

At fp32 a master range asked for during backward (a sub-group read ahead to step as its gradients
become final) is the shards of units that backward's gathers have read already (their gathered
buffers, prefetched ahead of backward's compute, hold them until released) or are still to read in
this pass: those gathers read the very same bytes, so such a range is assembled from them (copied at
once from the gathered buffers, `capture`d from the later gathers as they arrive) into a swap
buffer taken only when the last piece is in, instead of being read from the file a third time. If
the pass leaves the recorded order, a range still incomplete when the step needs it is read from the
file (`settle`).

Checkpoints stream it: `checkpoint_master` hands the writer a lazy source over the master's file
region (``dstrain.checkpoint.SwapRegions``, read after this store's master writes in flight), and
`master_span` tells an async save which bytes each sub-group's step rewrites, so the step waits
until the save has read them (``dstrain.checkpoint.gate``): the master is never read into memory.

A member of `dstrain.offload.param.shards.OffloadedShards` (``store.master``), made by the store once
its swap file is open; the store hands it the layout it shares (the groups, their file regions and
the span of a range) and a way to take the pool back from the shard read-ahead.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dstrain.checkpoint.sources import SwapRegions
from dstrain.offload.param.master_file import MasterFile, ShardStream
from dstrain.offload.swap.swapper import ALIGN, Lease, Swapper

if TYPE_CHECKING:
    from dsio.checkpoint import FileSpan
    from dstrain.zero.units import ShardGroup, Unit

__all__ = ["SwappedMaster"]

Span = Callable[["ShardGroup", int, int], tuple[int, int, int]]
"""(group, start, numel) -> (file offset, bytes, byte offset inside the buffer) in the shard file."""


class SwappedMaster:
    """The fp32 master of an `OffloadedShards` with ``holds_master`` (see the module's docstring).

    ``swapper``: the shard file's; ``file``: the master's own file (bf16/fp16 shards; None at fp32,
    where the master is the shard); ``groups`` / ``base``: the store's groups by index and their
    regions in the shard file (filled as groups are placed); ``span``: the shard file bytes of a
    range; ``release_reads``: hand the shard read-ahead's buffers back (the step owns the pool);
    ``lend(n)``: the shard read-ahead counts ``n`` fewer buffers as its own; ``will_gather(unit)``:
    whether ``unit``'s shard is still to be read by a gather of this pass (its recorded order).
    """

    def __init__(
        self,
        swapper: Swapper,
        file: MasterFile | None,
        *,
        dtype: torch.dtype,
        buffer_bytes: int,
        groups: Mapping[int, ShardGroup],
        base: Mapping[int, int],
        span: Span,
        release_reads: Callable[[], None],
        lend: Callable[[int], None],
        will_gather: Callable[[Unit], bool] = lambda unit: False,
        on_stored: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> None:
        self.file = file
        self._swapper = swapper
        self._dtype = dtype
        self._buffer_bytes = buffer_bytes
        self._groups = groups
        self._base = base
        self._span = span
        self._release_reads = release_reads
        self._lend = lend
        self._will_gather = will_gather
        self._on_stored = on_stored  # fp32: (group, start, new values) of a range about to be written
        self._assembling: list[_Assembly] = []  # master ranges waiting for the gathers' shards
        self._unfinished: set[concurrent.futures.Future[Any]] = set()  # their results, until set
        self._streams: dict[int, ShardStream] = {}  # group -> its shard file rewrite in progress
        self._stores: list[concurrent.futures.Future[None]] = []  # master writes in flight
        self.reads = 0
        """Master ranges read (`fetch_master`)."""
        self.writes = 0
        """Master ranges written back (`store_master`)."""
        self.shard_writes = 0
        """Shard ranges written from stepped master ranges (bf16/fp16: `stream_shard`)."""
        self.from_gathers = 0
        """Master ranges of `reads` assembled from the backward gathers' shards (not read from the file)."""
        self.from_gathers_bytes = 0
        """Their bytes (page-rounded, as a read of them would have been)."""

    # -- the master, for OffloadAdam (holds_master) ---------------------------------------------

    @property
    def max_master_numel(self) -> int:
        """The most master elements one `fetch_master` can hold (a multiple of 1024)."""
        if self.file is not None:
            return self.file.max_numel
        return (self._buffer_bytes - ALIGN) // 4 // 1024 * 1024

    def fetch_master(
        self, group: int, start: int, numel: int, *, in_pass: bool = False
    ) -> concurrent.futures.Future[tuple[Lease, torch.Tensor]]:
        """A buffer with master elements ``[start, start + numel)`` of ``group`` and the fp32 view of
        them (after any write of those pages in flight). ``in_pass``: during backward (a sub-group
        stepped as its gradients become final), within the buffers `lend_master_buffers` set aside,
        so the gathers' shard read-ahead goes on; otherwise the step owns the pool from now on."""
        if not in_pass:
            self._release_reads()  # the step owns the pool now: read-ahead of shards restarts in forward
        if self.file is not None:
            self.reads += 1
            return self.file.fetch(group, start, numel)
        g = self._groups[group]
        off, nbytes, at = self._span(g, start, numel)
        self.reads += 1
        # only a range of whole pages (or the region's last), so no neighbour's bytes are in its buffer
        if in_pass and at == 0 and (numel * 4 == nbytes or start + numel == g.total):
            assembly = self._assemble(g, start, numel, off, nbytes)
            if assembly is not None:
                return assembly.result
        return self._swapper.fetch_view(off, nbytes, at, numel, key=(g.index, off, nbytes, start, numel, at))

    def _assemble(self, g: ShardGroup, start: int, numel: int, off: int, nbytes: int) -> _Assembly | None:
        """An assembly of master elements ``[start, start + numel)`` of ``g`` from the shards of the
        units over them, if each either holds its shard in its gathered buffer now (gathered ahead
        by backward's prefetch, or persistent: copied now) or is still to be gathered in this pass;
        else None (the range is read from the file)."""
        parts = []
        for u in g.units:
            lo, hi = g.offsets[u.index], g.offsets[u.index] + u.layout.shard
            if hi <= start or start + numel <= lo:
                continue
            if u.holds_shard:  # the values of this pass: shards change only at the step
                parts.append((u, True))
            elif self._will_gather(u):
                parts.append((u, False))
            else:
                return None
        if not parts:
            return None
        a = _Assembly(g.index, start, numel, off, nbytes)
        self._unfinished.add(a.result)
        a.result.add_done_callback(self._unfinished.discard)
        for u, now in parts:
            if now:
                a.add(g.offsets[u.index], u.full[u.layout.lo : u.layout.hi])
            else:
                a.waiting.add(u.index)
        self._assembling.append(a)
        self._finish_if_complete(a)
        return a

    def assembling(self, fut: concurrent.futures.Future[Any]) -> bool:
        """Whether ``fut`` (from `fetch_master`) is a range assembling from this pass's gathers and
        not complete yet: it completes as the training thread gathers, so waiting for it there
        during backward would never end."""
        return fut in self._unfinished

    def capture(self, group: int, start: int, shard: torch.Tensor, unit: int) -> None:
        """A gather of unit ``unit`` read its shard ``shard`` (master elements ``[start, start +
        shard.numel())`` of ``group``, fp32): copy it into the master ranges assembling from it."""
        if not self._assembling:
            return
        for a in list(self._assembling):
            if a.group == group and unit in a.waiting:
                a.waiting.discard(unit)
                a.add(start, shard)
                self._finish_if_complete(a)

    def _finish_if_complete(self, a: _Assembly) -> None:
        if a.waiting:
            return
        self._assembling.remove(a)
        self.from_gathers += 1
        self.from_gathers_bytes += a.nbytes
        a.finish(self._swapper.acquire_any())

    def settle(self) -> None:
        """Read from the file every master range still assembling (the pass left its recorded order,
        so some gathers it waits for will not come); their futures complete with those reads."""
        while self._assembling:
            a = self._assembling.pop(0)
            g = self._groups[a.group]
            key = (g.index, a.off, a.nbytes, a.start, a.numel, 0)
            a.instead(self._swapper.fetch_view(a.off, a.nbytes, 0, a.numel, key=key))

    def lend_master_buffers(self) -> int:
        """Set aside buffers for the master ranges read and written during backward (stepping during
        backward, `dstrain.offload.optimizer.early_step`); returns how many master ranges may be
        held at once then (0: the pools are too small, stepping stays after backward).

        The shard pool serves the gathers' read-ahead during backward, and the training thread waits
        for its buffers there, so whatever the optimizer holds in it must be buffers the read-ahead
        never counts on: at fp32 (the master is the shard) half of them hold master ranges; at
        bf16/fp16 one takes the cast shard writes (`ShardStream`) and the master ranges come from
        the master file's own pool, all of its buffers but one (`StateReads.fetch_final`)."""
        buffers = self._swapper.buffers
        if buffers < 2:
            return 0
        if self.file is not None:
            self._lend(1)
            return self.file.buffers - 1  # one the pass never holds (the step takes its reads in order)
        self._lend(buffers // 2)
        return buffers // 2

    def store_master(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Write a stepped master range back (once per step) and return its buffer."""
        self.writes += 1
        if self.file is not None:
            fut = self.file.store(lease)  # and the half-precision shard, via `stream_shard`
        else:
            key: Any = lease.key  # (group, file offset, bytes, first element, elements, byte in buffer)
            if self._on_stored is not None:
                self._on_stored(int(key[0]), int(key[3]), lease.view(torch.float32, int(key[5]), int(key[4])))
            fut = self._swapper.store_range(lease, int(key[1]), int(key[2]))
        # a checkpoint reads the master's region after these (`checkpoint_master`)
        self._stores = [f for f in self._stores if not f.done()]
        self._stores.append(fut)
        return fut

    def discard_master(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Hand a master buffer back unwritten."""
        if self.file is not None:
            return self.file.discard(lease)
        return self._swapper.discard(lease)

    def stream_shard(self, group: int, start: int, values: torch.Tensor) -> None:
        """A stepped (or loaded) master range, cast into the shard file (`ShardStream`): the
        master file's ``on_store``."""
        stream = self._streams.get(group)
        if stream is None:
            g = self._groups[group]
            stream = ShardStream(self._swapper, self._base[group], g.total, self._dtype)
            self._streams[group] = stream
        self.shard_writes += stream.write(start, values)
        if stream.done:
            del self._streams[group]

    def read(self, group: ShardGroup) -> torch.Tensor:
        """``group``'s whole fp32 master, read into memory (a swap buffer at a time at fp32)."""
        if self.file is not None:
            return self.file.read(group.index)
        out = torch.empty(group.total, dtype=torch.float32)
        per = (self._buffer_bytes - ALIGN) // 4
        for start in range(0, group.total, per):
            n = min(per, group.total - start)
            lease, view = self.fetch_master(group.index, start, n).result()
            out[start : start + n].copy_(view)
            self._swapper.discard(lease).result()
        return out

    def load_file(self, group: int, fill: Callable[[torch.Tensor, int], None]) -> None:
        """Replace ``group``'s master in its own file with what ``fill(out, start)`` gives; each
        range is also cast into the shard file (`stream_shard`). A failed load leaves no partial
        shard rewrite behind (the next step rewrites the shards from the start)."""
        assert self.file is not None
        try:
            self.file.load(group, fill)
        except BaseException:
            partial = self._streams.pop(group, None)
            if partial is not None:
                partial.cancel()
            raise

    # -- checkpoints ------------------------------------------------------------------------------

    def master_span(self, group: int, start: int, numel: int) -> FileSpan:
        """The file bytes `store_master` rewrites for master elements ``[start, start + numel)`` of
        ``group`` (a touch span of the step: an async save that streams the master must have read
        them before the step writes them)."""
        from dsio.checkpoint import FileSpan

        if self.file is not None:
            off, nbytes = self.file.written_span(group, start, numel)
            return FileSpan(self.file.path, off, nbytes)
        off, nbytes, _ = self._span(self._groups[group], start, numel)
        return FileSpan(self._swapper.path, off, nbytes)

    def checkpoint_master(self, group: ShardGroup) -> SwapRegions:
        """``group``'s fp32 master for a checkpoint: a lazy source over its region of the shard
        file (fp32: the master is the shard) or of the master file (bf16/fp16), read by the
        checkpoint writer a window at a time once the master writes in flight are done, never
        materialized. The region must not change until the save has read it: the optimizer's step
        waits per sub-group (`master_span`), any other change waits for staging."""
        self._stores = [f for f in self._stores if not f.done()]
        if self.file is not None:
            path, off, nbytes = self.file.region(group.index)
        else:
            path, off, nbytes = self._swapper.path, self._base[group.index], group.total * 4
        return SwapRegions([(path, off, nbytes)], torch.float32, (group.total,), after=self._stores)


class _Assembly:
    """One master range (``numel`` elements of ``group`` from ``start``, the file's ``[off, off +
    nbytes)``, page-aligned) filled from shards in memory; ``result`` completes with ``(lease,
    view)`` as a read of it would (the lease keyed for `SwappedMaster.store_master`)."""

    def __init__(self, group: int, start: int, numel: int, off: int, nbytes: int) -> None:
        self.group, self.start, self.numel, self.off, self.nbytes = group, start, numel, off, nbytes
        self.values = torch.empty(numel, dtype=torch.float32)  # (numel,) plain memory until complete
        self.waiting: set[int] = set()  # units whose gathers are still to come
        self.result: concurrent.futures.Future[tuple[Lease, torch.Tensor]] = concurrent.futures.Future()

    def add(self, start: int, shard: torch.Tensor) -> None:
        """Copy the part of ``shard`` (master elements from ``start``) inside this range."""
        lo, hi = max(start, self.start), min(start + shard.numel(), self.start + self.numel)
        self.values[lo - self.start : hi - self.start].copy_(shard[lo - start : hi - start])

    def finish(self, buffer: concurrent.futures.Future[Lease]) -> None:
        """Once ``buffer`` is lent: the values into it (bytes after them, the region's padding past
        its last element, zeroed as the file has them), then ``result``."""

        def done(f: concurrent.futures.Future[Lease]) -> None:
            exc = f.exception()
            if exc is not None:
                self.result.set_exception(exc)
                return
            lease = f.result()
            lease.key = (self.group, self.off, self.nbytes, self.start, self.numel, 0)
            view = lease.view(torch.float32, 0, self.numel)
            view.copy_(self.values)
            lease.tensor[self.numel * 4 : self.nbytes].zero_()
            self.values = torch.empty(0)
            self.result.set_result((lease, view))

        buffer.add_done_callback(done)

    def instead(self, read: concurrent.futures.Future[tuple[Lease, torch.Tensor]]) -> None:
        """Complete ``result`` with ``read`` (the range read from the file) instead."""

        def done(f: concurrent.futures.Future[tuple[Lease, torch.Tensor]]) -> None:
            exc = f.exception()
            if exc is not None:
                self.result.set_exception(exc)
            else:
                self.result.set_result(f.result())

        self.values = torch.empty(0)
        read.add_done_callback(done)
