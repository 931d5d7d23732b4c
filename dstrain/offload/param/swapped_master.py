"""`SwappedMaster`: the fp32 master of an NVMe parameter store that holds it (`OffloadedShards` with
``holds_master``: parameters and optimizer state both on NVMe), read and written by `OffloadAdam`
sub-group by sub-group: at fp32 from the shard file (the master *is* the shard), at bf16/fp16 from
the `MasterFile`, each stepped range then cast into the shard file (`ShardStream`).

Checkpoints stream it: `checkpoint_master` hands the writer a lazy source over the master's file
region (``dstrain.checkpoint.SwapRegions``, read after this store's master writes in flight), and
`master_span` tells an async save which bytes each sub-group's step rewrites, so the step waits
until the save has read them (``dstrain.checkpoint.gate``): the master is never read into memory.

A mixin of `dstrain.offload.param.shards.OffloadedShards` (its state is declared below), kept apart
so that the store's module stays about the shards.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

import torch

from dstrain.checkpoint.sources import SwapRegions
from dstrain.offload.param.master_file import MasterFile, ShardStream
from dstrain.offload.param.read_ahead import TraceReadAhead
from dstrain.offload.swap.swapper import ALIGN, Lease, Swapper

if TYPE_CHECKING:
    from dsio.checkpoint import FileSpan
    from dstrain.zero.stage3 import ShardGroup

__all__ = ["SwappedMaster"]


class SwappedMaster:
    """The master-access half of `OffloadedShards` (see the module's docstring)."""

    # the store's state this half uses (set by OffloadedShards.__init__ / expect / place)
    dtype: torch.dtype
    holds_master: bool
    buffer_bytes: int
    _swapper: Swapper | None
    _mfile: MasterFile | None
    _ahead: TraceReadAhead
    _groups: dict[int, ShardGroup]
    _base: dict[int, int]
    _streams: dict[int, ShardStream]
    _master_reads: int
    _master_writes: int
    _shard_writes: int
    _master_stores: list[concurrent.futures.Future[None]]

    def _span(self, group: ShardGroup, start: int, numel: int) -> tuple[int, int, int]:
        raise NotImplementedError

    def _cancel_queue(self) -> None:
        raise NotImplementedError

    # -- the master, for OffloadAdam (holds_master) ---------------------------------------------

    @property
    def max_master_numel(self) -> int:
        """The most master elements one `fetch_master` can hold (a multiple of 1024)."""
        if self._mfile is not None:
            return self._mfile.max_numel
        return (self.buffer_bytes - ALIGN) // 4 // 1024 * 1024

    def fetch_master(
        self, group: int, start: int, numel: int
    ) -> concurrent.futures.Future[tuple[Lease, torch.Tensor]]:
        """A buffer with master elements ``[start, start + numel)`` of ``group`` and the fp32 view of
        them (after any write of those pages in flight)."""
        assert self._swapper is not None and self.holds_master
        self._ahead.end_pass()
        if self._ahead.queued:
            self._cancel_queue()  # the step owns the pool now: read-ahead of shards restarts in forward
        if self._mfile is not None:
            self._master_reads += 1
            return self._mfile.fetch(group, start, numel)
        g = self._groups[group]
        off, nbytes, at = self._span(g, start, numel)
        fut = self._swapper.fetch_view(off, nbytes, at, numel, key=(g.index, off, nbytes))
        self._master_reads += 1
        return fut

    def store_master(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Write a stepped master range back (once per step) and return its buffer."""
        assert self._swapper is not None
        self._master_writes += 1
        if self._mfile is not None:
            fut = self._mfile.store(lease)  # and the half-precision shard, via `_stream_shard`
        else:
            key: Any = lease.key  # (group, file offset, bytes), set by fetch_master
            fut = self._swapper.store_range(lease, int(key[1]), int(key[2]))
        # a checkpoint reads the master's region after these (`checkpoint_master`)
        self._master_stores = [f for f in self._master_stores if not f.done()]
        self._master_stores.append(fut)
        return fut

    def discard_master(self, lease: Lease) -> concurrent.futures.Future[None]:
        """Hand a master buffer back unwritten."""
        assert self._swapper is not None
        if self._mfile is not None:
            return self._mfile.discard(lease)
        return self._swapper.discard(lease)

    def _stream_shard(self, group: int, start: int, values: torch.Tensor) -> None:
        """A stepped master range, cast into the shard file (`ShardStream`)."""
        assert self._swapper is not None
        stream = self._streams.get(group)
        if stream is None:
            g = self._groups[group]
            stream = ShardStream(self._swapper, self._base[group], g.total, self.dtype)
            self._streams[group] = stream
        self._shard_writes += stream.write(start, values)
        if stream.done:
            del self._streams[group]

    # -- checkpoints ------------------------------------------------------------------------------

    def master_span(self, group: int, start: int, numel: int) -> FileSpan:
        """The file bytes `store_master` rewrites for master elements ``[start, start + numel)`` of
        ``group`` (a touch span of the step: an async save that streams the master must have read
        them before the step writes them)."""
        from dsio.checkpoint import FileSpan

        assert self._swapper is not None and self.holds_master
        if self._mfile is not None:
            off, nbytes = self._mfile.written_span(group, start, numel)
            return FileSpan(self._mfile.path, off, nbytes)
        off, nbytes, _ = self._span(self._groups[group], start, numel)
        return FileSpan(self._swapper.path, off, nbytes)

    def checkpoint_master(self, group: ShardGroup) -> torch.Tensor | SwapRegions:
        """``group``'s fp32 master for a checkpoint: with `holds_master`, a lazy source over its
        region of the shard file (fp32: the master is the shard) or of the master file (bf16/fp16),
        read by the checkpoint writer a window at a time once this store's master writes in flight
        are done, never materialized. The region must not change until the save has read it: the
        optimizer's step waits per sub-group (`master_span`), any other change waits for staging."""
        if not self.holds_master:
            return group.master.detach()
        assert self._swapper is not None
        self._master_stores = [f for f in self._master_stores if not f.done()]
        if self._mfile is not None:
            path, off, nbytes = self._mfile.region(group.index)
        else:
            path, off, nbytes = self._swapper.path, self._base[group.index], group.total * 4
        return SwapRegions([(path, off, nbytes)], torch.float32, (group.total,), after=self._master_stores)
