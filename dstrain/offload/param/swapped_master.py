"""`SwappedMaster`: the fp32 master of an NVMe parameter store that holds it (`OffloadedShards` with
``holds_master``: parameters and optimizer state both on NVMe), read and written by `OffloadAdam`
sub-group by sub-group: at fp32 from the shard file (the master *is* the shard), at bf16/fp16 from
the `MasterFile`, each stepped range then cast into the shard file (`ShardStream`).

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
    from dstrain.zero.units import ShardGroup

__all__ = ["SwappedMaster"]

Span = Callable[["ShardGroup", int, int], tuple[int, int, int]]
"""(group, start, numel) -> (file offset, bytes, byte offset inside the buffer) in the shard file."""


class SwappedMaster:
    """The fp32 master of an `OffloadedShards` with ``holds_master`` (see the module's docstring).

    ``swapper``: the shard file's; ``file``: the master's own file (bf16/fp16 shards; None at fp32,
    where the master is the shard); ``groups`` / ``base``: the store's groups by index and their
    regions in the shard file (filled as groups are placed); ``span``: the shard file bytes of a
    range; ``release_reads``: hand the shard read-ahead's buffers back (the step owns the pool);
    ``lend(n)``: the shard read-ahead counts ``n`` fewer buffers as its own.
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
        self._streams: dict[int, ShardStream] = {}  # group -> its shard file rewrite in progress
        self._stores: list[concurrent.futures.Future[None]] = []  # master writes in flight
        self.reads = 0
        """Master ranges read (`fetch_master`)."""
        self.writes = 0
        """Master ranges written back (`store_master`)."""
        self.shard_writes = 0
        """Shard ranges written from stepped master ranges (bf16/fp16: `stream_shard`)."""

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
        fut = self._swapper.fetch_view(off, nbytes, at, numel, key=(g.index, off, nbytes))
        self.reads += 1
        return fut

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
            key: Any = lease.key  # (group, file offset, bytes), set by fetch_master
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
