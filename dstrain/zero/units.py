"""Stage 3 storage: a `Unit` is one module's trainable parameters of one param group, sharded; a
`ShardGroup` is one param group's units with their master; a `ShardStore` keeps the shards.

Each unit keeps this rank's shard (a view into its group's shard buffer) and one full-size buffer
whose *storage* is resized to zero when released and back when gathered, so tensors autograd saved in
forward (e.g. ``weight.t()``, a view of the buffer) see the re-gathered values in backward, and
releasing really frees the memory. While gathered, parameters are views of that buffer; while
released, each holds an empty tensor of its own (numel 0, as DeepSpeed's released parameters;
`whole_shape` and ``p.ds_shape`` / ``p.ds_numel`` give the real shape): a view of the freed storage
would let ``p.sum()``, ``print(p)`` or ``module.state_dict()`` outside a gather read memory that was
given back (a segfault), where an empty tensor reads as empty.

The optimizer's views over a group's master (``ShardGroup.views``) follow the same rule when a store
holds the master (`ShardStore.holds_master`: its storage is 0 bytes) or the gradients (`ShardStore.grads`):
each view then holds an empty tensor of its own and no ``.grad`` (`stored_view` keeps where it was),
so a caller reading the optimizer's parameters (clipping utilities, logging, a Trainer) reads empty
tensors, never storage that holds no bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dstrain.dist.comm import DONE, Comm
from dstrain.zero.flat import FlatLayout, optimizer_views

if TYPE_CHECKING:
    from dstrain.zero.reduce import Handle, Route

__all__ = [
    "HoldsShards",
    "InitialShard",
    "ShardGroup",
    "ShardStore",
    "StoredView",
    "Unit",
    "stored_view",
    "unit_of",
    "whole_shape",
]

# Parameter -> (a weak reference to) the Unit it is a view of: a Unit holds its parameters, so a strong
# value would keep its key, and so the unit, its store and shards, alive for good
_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()
_shape: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> its whole shape (empty while released)
_stored: WeakIdKeyDictionary = WeakIdKeyDictionary()  # emptied optimizer view -> its StoredView


def unit_of(param: torch.Tensor) -> Unit | None:
    """The stage-3 `Unit` that holds ``param`` (None for a parameter no engine partitioned)."""
    ref = _owner.get(param)
    return ref() if ref is not None else None


def whole_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s shape as the model defines it: a stage-3 parameter's whole shape even while it is
    released (then ``param.shape`` is ``(0,)``); any other tensor's own shape."""
    shape = _shape.get(param)
    return param.shape if shape is None else shape


@dataclass(frozen=True, slots=True)
class StoredView:
    """Where an optimizer view over a group's master was before its group emptied it (the values or
    gradients it viewed are held by a `ShardStore`, not in memory): what its optimizer steps from."""

    offset: int
    """Its first element's offset in its group's master storage (``storage_offset()`` of the view)."""
    grad: torch.Tensor
    """Its range of the group's fp32 gradient, ``(numel,)``: in memory, or storage-less when the
    store keeps the gradients on NVMe (then the optimizer reads them from the store)."""


def stored_view(view: torch.Tensor) -> StoredView | None:
    """Where ``view`` (a stage-3 optimizer view its `ShardGroup` emptied) was; None for any other
    tensor (its own ``storage_offset()`` and ``.grad`` say)."""
    return _stored.get(view)


class ShardStore:
    """Where a stage-3 rank's shards live between uses. This default keeps them resident: every unit's
    shard is a view of its group's one shard buffer, which (at fp32) is also the master the optimizer
    steps. Parameter offload (`dstrain.offload.param.shards`) replaces it with shards on CPU or NVMe."""

    holds_master = False
    """True when the fp32 master is not resident but read and written through this store by the
    optimizer (offloaded Adam at fp32 with parameters on NVMe)."""

    streams_initial_shards = False
    """True when `place` reads each unit's initial shard with `Unit.initial_shard` (one unit at a
    time, from the model's own parameter memory) instead of ``unit.shard``: then no unit copies its
    shard at construction, and initialization allocates no second copy of every shard."""

    grads: Any = None
    """Where the fp32 gradient shards live when not in memory (an `OffloadedGrads`, set by `expect`
    when the offload budget cannot hold them); None: in `ShardGroup.master_grad`."""

    master: Any = None
    """With `holds_master`: what the optimizer reads and writes the fp32 master through (a
    `dstrain.offload.param.swapped_master.SwappedMaster`); None: the master is resident."""

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes this store allocated (they come out of the offload budget)."""
        return 0

    def expect(self, units: Sequence[Unit]) -> None:
        """Every unit of the strategy, before the first `place` (to size buffers)."""
        return None

    def place(self, group: ShardGroup) -> None:
        """Take ``group``'s units' initial shards (``unit.shard``) and set ``group.master``."""
        total = sum(u.layout.shard for u in group.units)
        group.shards = torch.zeros(total, dtype=group.dtype, device=group.device)  # (sum of shards,)
        for u in group.units:
            off = group.offsets[u.index]
            u.bind_shard(group.shards[off : off + u.layout.shard])
        group.master = group.shards if group.alias else group.shards.float()

    def new_master_grad(self, group: ShardGroup) -> torch.Tensor:
        """``group``'s fp32 gradient partition (zeros), where this store keeps it: on the group's
        device here; in host memory with ZeRO-Offload (`dstrain.offload.param.host_master`)."""
        return torch.zeros(group.total, dtype=torch.float32, device=group.device)

    def placed(self, group: ShardGroup) -> None:
        """``group``'s optimizer views over its master exist now."""
        return None

    def input_for(self, unit: Unit) -> torch.Tensor:
        """The tensor ``unit``'s all-gather sends (this rank's shard); valid until the gather is waited."""
        return unit.shard

    def shard_numel(self, unit: Unit) -> int:
        """Elements of ``unit``'s shard held in the training device's memory."""
        return unit.shard.numel()

    def begin_pass(self) -> None:
        """A forward pass starts: its gathers will ask for shards (`input_for`) in the same order as
        the last pass did, unless the model's control flow changed (a store may read ahead)."""
        return None

    def add_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
        """``target += alpha * grad``: a unit's reduce-scattered gradient ``grad`` (the compute dtype,
        on the training device) into its range ``target`` of a group's fp32 gradient partition
        (`new_master_grad`'s, which a store may keep elsewhere: `HostMasterShards` stages the copy)."""
        target.add_(grad.to(target.device), alpha=alpha)

    def put_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> Handle:
        """``target = alpha * grad``: the first gradient into ``target`` in an accumulation window
        (``target`` holds zeros: nothing to add to, so a store need not read it), the values
        `add_grad` gives onto zeros (the upcast is exact, then one rounding of ``alpha * g``).
        `HostMasterShards` copies it straight into page-locked host memory; the copy may still be in
        flight: ``target`` holds the values once the returned handle's ``wait()`` has returned."""
        target.copy_(grad)  # (the upcast to fp32)
        if alpha != 1.0:
            target.mul_(alpha)
        return DONE

    def after_step(self, group: ShardGroup) -> None:
        """The optimizer updated ``group.master``: make the shards match."""
        if not group.alias:
            assert group.shards is not None  # set by `place`
            group.shards.copy_(group.master.detach())

    def step_done(self) -> None:
        """Every group's `after_step` of this optimizer step has been called: the shards must be whole
        before anything reads them (a store whose copies are asynchronous waits here, once a step)."""
        return None

    def read_master(self, group: ShardGroup) -> torch.Tensor:
        """``group``'s fp32 master (for checkpoints)."""
        return group.master.detach()

    def checkpoint_master(self, group: ShardGroup) -> Any:
        """``group``'s fp32 master for a checkpoint: a tensor, or a lazy source over a file
        (``dsio.checkpoint.LazyTensor``) that the checkpoint writer streams (an offloading store)."""
        return self.read_master(group)

    def load_master(self, group: ShardGroup, fill: Callable[[torch.Tensor, int], None]) -> None:
        """Replace ``group``'s master and shards with the values ``fill(out, start)`` puts into
        ``out`` (master elements ``[start, start + out.numel())``; called with ranges in element
        order, see `dstrain.zero.stage3.master_fill`)."""
        fill(group.master.detach(), 0)
        if not group.alias:
            assert group.shards is not None  # set by `place`
            group.shards.copy_(group.master.detach())

    def write_shard(self, group: ShardGroup, unit: Unit, values: torch.Tensor) -> None:
        """Replace ``unit``'s shard, and its range of ``group``'s fp32 master, with ``values``
        (``(unit.layout.shard,)`` in the unit's dtype, upcast for the master): the whole-parameter
        changes `dstrain.zero.GatheredParameters` writes back between steps, so the next gather
        and the next optimizer step both start from them."""
        start, n = group.offsets[unit.index], unit.layout.shard
        group.master.detach()[start : start + n].copy_(values)
        if not group.alias:  # the shards are a tensor of their own (bf16/fp16, or a host master)
            assert group.shards is not None  # set by `place`
            group.shards[start : start + n].copy_(values)

    def statistics(self) -> Any:
        return None

    def close(self) -> None:
        return None


class InitialShard(Protocol):
    """A shard that exists before its `Unit` (``dstrain.zero.init.AdoptedShard``: built under
    zero.Init): `read` it as often as the store needs, then `release` it."""

    def read(self) -> torch.Tensor: ...

    def release(self) -> None: ...


@runtime_checkable
class HoldsShards(Protocol):
    """A strategy whose parameter shards live in a `dstrain.zero.units.ShardStore` between uses
    (stage 3): the offload room builds the store (`dstrain.offload.param.shards.OffloadedShards`)
    and reads the master and gradients it may hold."""

    store: ShardStore


class Unit:
    """Parameters gathered and released together."""

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        comm: Comm,
        dtype: torch.dtype,
        keep_origin: bool = False,
        adopted: InitialShard | None = None,
    ) -> None:
        self.index = index
        self.params = params
        self.comm = comm
        self.dtype = dtype
        self.layout = FlatLayout(params, comm.world_size, comm.rank)
        self._adopted = adopted
        if adopted is not None:
            # built under zero.Init: the shard exists already (``adopted()`` reads it); the full
            # buffer is allocated untouched (no pages) and released at once below
            self.full = torch.empty(self.layout.padded, dtype=dtype, device=params[0].device)
        else:
            self.full = self.layout.flatten(params, dtype)  # (padded,) full values, freed when released
        self._nbytes = self.full.untyped_storage().nbytes()
        self._own = self.full  # the unit's own full buffer (`full` is the shard while aliased)
        # world size 1 with the shard resident where the unit computes: the shard is every element
        # of the unit, so a pass's gather binds the parameters to it (set by `bind_shard`)
        self._alias: torch.Tensor | None = None
        # keep_origin: the parameters' own tensors stay (until `drop_origin`) and the shard is read
        # from them when the store places it; else a copy of the shard now, replaced by a view later
        self._origin = [p.detach() for p in params] if keep_origin and adopted is None else None
        if keep_origin:
            self.shard: torch.Tensor = torch.empty(0, dtype=dtype, device=self.full.device)
        elif adopted is not None:
            self.shard = adopted.read()
            adopted.release()
            self._adopted = None
        else:
            self.shard = self.full[self.layout.lo : self.layout.hi].clone()
        for p, shape, numel in zip(params, self.layout.shapes, self.layout.numels, strict=True):
            _owner[p] = weakref.ref(self)
            _shape[p] = shape
            # DeepSpeed's names for the whole shape of a partitioned parameter (users' code reads them)
            setattr(p, "ds_shape", shape)  # noqa: B010 (Parameter declares no such attribute)
            setattr(p, "ds_numel", numel)  # noqa: B010
        self._bind()
        self.gathered = True
        if adopted is not None:
            self._unbind()
            self.full.untyped_storage().resize_(0)
            self.gathered = False
        self.persistent = False
        self.handle: Any = None  # pending asynchronous all-gather
        self.grads_ready = 0
        self.store: ShardStore = ShardStore()
        self.group: ShardGroup | None = None  # set by the ShardGroup the unit joins

    @property
    def numel(self) -> int:
        return self.layout.padded

    def _bind(self) -> None:
        """Make the parameters views of the full buffer (it holds their values now)."""
        for p, view in zip(self.params, self.layout.views(self.full), strict=True):
            p.data = view

    def _unbind(self) -> None:
        """Give each parameter an empty tensor of its own before the full buffer's storage is freed:
        no parameter may stay a view of memory that was given back."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def initial_shard(self) -> torch.Tensor:
        """This rank's initial shard, ``(shard,)``: a new tensor built from the parameters' original
        tensors (``keep_origin``), with the values and zero padding `FlatLayout.flatten` gives; for a
        unit built under zero.Init, the shard Init kept (read from where it is)."""
        if self._adopted is not None:
            return self._adopted.read()
        if self._origin is None:
            return self.shard
        lay = self.layout
        out = torch.zeros(lay.shard, dtype=self.dtype, device=self.full.device)
        for i, t in enumerate(self._origin):
            span = lay.overlap(i)
            if span is not None:
                start, end = span
                off = lay.offsets[i]
                out[start - lay.lo : end - lay.lo].copy_(t.reshape(-1)[start - off : end - off])
        return out

    def drop_origin(self) -> None:
        """Forget the parameters' original tensors (the store has the shard now)."""
        self._origin = None
        if self._adopted is not None:  # zero.Init's copy of the shard goes now
            self._adopted.release()
            self._adopted = None
        if self._adopted is not None:
            self._adopted.release()
            self._adopted = None

    def bind_shard(self, shard: torch.Tensor) -> None:
        """Move this rank's shard into ``shard`` (a view of the group's shard buffer, resident: it
        stays where it is between steps).

        At world size 1 the shard holds every element of the unit, so from here on a gather in a
        pass binds the parameters to the shard itself, as DeepSpeed's world-1 gather does
        (``_no_gather_coalesced``): no gathered copy (with prefetching up to
        ``stage3_max_live_parameters``, 1e9 elements by default, those copies could reach 1.9 bytes
        a parameter of GPU memory on the 1.07B GPT of bench/offload_gpu.py), nothing to free at release. Between steps (`finish_gather` with ``private``) a copy of its own."""
        shard.copy_(self.shard)
        self.shard = shard
        if (
            self.comm.world_size == 1
            and shard.numel() == self.layout.padded
            and shard.dtype == self.dtype
            and shard.device == self.full.device
        ):
            held = self.gathered  # (a persistent unit stays gathered: onto the shard now)
            if self.handle is not None:
                self.finish_gather()
            if held:
                self._unbind()
                self.gathered = False
            self._own.untyped_storage().resize_(0)
            self.full = self._own
            self._alias = shard
            if held:
                self.finish_gather()

    def resident_numel(self) -> int:
        """Elements of parameter storage this unit holds now: shard plus the full buffer if allocated
        (nothing more while the parameters are views of the shard itself, world size 1)."""
        if self.full is self._alias:
            return self.store.shard_numel(self)
        return self.store.shard_numel(self) + self.full.untyped_storage().nbytes() // self.full.element_size()

    @property
    def holds_shard(self) -> bool:
        """Whether ``full[layout.lo:layout.hi]`` holds this rank's shard now: gathered, or its gather
        launched (the store filled that slot, the all-gather's input, before it started)."""
        return self.gathered or self.handle is not None

    def start_gather(self, *, private: bool = False) -> bool:
        """Allocate the full buffer and launch the all-gather asynchronously; False if nothing to do.
        At world size 1 (`bind_shard`) the full buffer is the shard itself, unless ``private``."""
        if self.gathered or self.handle is not None:
            return False
        if self._alias is not None and not private:
            self.full = self._alias
            self.handle = DONE  # nothing in flight
            return True
        self.full = self._own
        self.full.untyped_storage().resize_(self._nbytes)
        self.handle = self.comm.all_gather(self.full, self.store.input_for(self), async_op=True)
        return True

    def finish_gather(self, *, private: bool = False) -> None:
        """Make the parameters usable (waits for an in-flight gather). ``private``: views of a buffer
        of the unit's own even at world size 1, where a pass binds them to the shard: what a caller
        takes from them between steps (`dstrain.zero.GatheredParameters`, exports) keeps the values
        of now, and a change the block discards does not reach the shard."""
        if private and self.full is self._alias and (self.gathered or self.handle is not None):
            self._unbind()
            self.gathered, self.handle, self.full = False, None, self._own
        if self.gathered:
            return
        if self.handle is None:
            self.start_gather(private=private)
        self.handle.wait()
        self.handle = None
        self._bind()
        self.gathered = True

    def regather(self) -> None:
        """Refresh a gathered unit from the (updated) shards (views of the shard itself see them: a
        private copy a persistent unit kept at world size 1 is let go and the views go back to it)."""
        if not self.gathered:
            return
        if self._alias is None:
            self.comm.all_gather(self.full, self.store.input_for(self))
        elif self.full is not self._alias:
            self._unbind()
            self._new_own()  # tensors a caller took from the copy keep it
            self.full = self._alias
            self._bind()

    def _new_own(self) -> None:
        """Let go of the own full buffer (freed when the last tensor a caller took from it goes, at
        once when there is none) and take a new one, unallocated."""
        device = self._own.device
        self.full = self._own = torch.empty(0, dtype=self.dtype, device=device)  # the old buffer goes first
        self.full = self._own = torch.empty(self.layout.padded, dtype=self.dtype, device=device)
        self._own.untyped_storage().resize_(0)

    def commit(self, src: int) -> None:
        """Make the gathered values of group rank ``src`` this unit's values on every rank (a
        collective over ``comm``): ``src``'s full buffer is broadcast and each rank writes its part
        of it where its store keeps the shard and the fp32 master (`ShardStore.write_shard`)."""
        if not self.gathered:
            raise RuntimeError("Unit.commit needs the unit gathered")
        if self.group is None:
            raise RuntimeError("Unit.commit before the unit joined a ShardGroup")
        self.comm.broadcast(self.full, src)
        with torch.no_grad():
            self.store.write_shard(self.group, self, self.full[self.layout.lo : self.layout.hi])

    def release(self, force: bool = False, *, between_steps: bool = False) -> None:
        """Free the full buffer unless persistent (or pending: a gather in flight is finished first).

        In a pass (the gather hooks) the buffer's storage is freed in place: tensors autograd saved
        in forward are views of it and see the values gathered again in backward. ``between_steps``
        (`dstrain.zero.GatheredParameters`' exit, `Stage3Zero.release_all`): tensors a caller took
        from the gathered parameters (``p.data``, ``module.state_dict()``'s values, ``p.cpu()`` on
        the CPU, views) may outlive the gather, so the unit lets go of its buffer (freed when the
        last of those tensors goes, at once when there is none) and takes a new one, unallocated."""
        if self.persistent and not force:
            return
        if self.handle is not None:
            self.finish_gather()
        if not self.gathered:
            return
        self._unbind()
        self.gathered = False
        if self.full is self._alias:  # views of the shard (world size 1): the shard stays, nothing to free
            self.full = self._own
            return
        if between_steps:
            self._new_own()
        self.full.untyped_storage().resize_(0)

    def pop_flat_grad(self, dtype: torch.dtype) -> torch.Tensor:
        """This unit's gradients flattened into a new (padded,) buffer; parameters' ``.grad`` cleared."""
        buf = torch.zeros(self.layout.padded, dtype=dtype, device=self.full.device)
        for p, off, n in zip(self.params, self.layout.offsets, self.layout.numels, strict=True):
            if p.grad is not None:
                buf[off : off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        self.grads_ready = 0
        return buf


class ShardGroup:
    """A param group's units, their shards laid end to end (``offsets``), and the fp32 master the
    optimizer steps. Where the shards live is the `ShardStore`'s business (resident by default: views
    of one buffer that, at fp32, is the master itself)."""

    def __init__(
        self,
        index: int,
        options: dict[str, Any],
        units: list[Unit],
        route: Route,
        dtype: torch.dtype,
        device: torch.device,
        chunk: int,
        store: ShardStore,
    ) -> None:
        self.index = index
        self.options = options
        self.units = units
        self.route = route
        self.dtype = dtype
        self.device = device
        self.total = sum(u.layout.shard for u in units)
        self.offsets: dict[int, int] = {}
        off = 0
        for u in units:
            self.offsets[u.index] = off
            u.store = store
            u.group = self
            off += u.layout.shard
        self.alias = dtype == torch.float32
        self.shards: torch.Tensor | None = None  # the resident store's buffer (else None)
        self.master: torch.Tensor = torch.empty(0)
        store.place(self)  # sets master (and shards where they stay resident)
        if store.grads is None:
            self.master_grad = store.new_master_grad(self)
        else:  # gradients on NVMe: the views keep shapes and offsets, the values are in the file
            self.master_grad = torch.empty(self.total, dtype=torch.float32, device=device)
            store.grads.place(index, self.total)
        self.views = optimizer_views(self.master, self.master_grad, chunk)
        if store.grads is not None:
            self.master_grad.untyped_storage().resize_(0)
        store.placed(self)
        if store.holds_master or store.grads is not None:
            self._empty_views(values=store.holds_master)

    def _empty_views(self, *, values: bool) -> None:
        """The store holds the master's values (``values``) or the gradients: no view may stay over
        storage of 0 bytes, where reading it (``p.sum()``, ``p.grad.norm()``) reads no memory (a
        segfault). Each view's ``.grad`` goes (`stored_view` keeps its range); with ``values`` the
        view itself holds an empty tensor of its own (``ds_shape`` / ``ds_numel``, `whole_shape`
        keep its shape), as a released parameter does."""
        for view in self.views:
            grad = view.grad
            assert grad is not None  # set by optimizer_views
            _stored[view] = StoredView(int(view.storage_offset()), grad)
            view.grad = None
            if values:
                shape = view.shape
                _shape[view] = shape
                setattr(view, "ds_shape", shape)  # noqa: B010 (Tensor declares no such attribute)
                setattr(view, "ds_numel", view.numel())  # noqa: B010
                view.data = torch.empty(0, dtype=view.dtype, device=view.device)
