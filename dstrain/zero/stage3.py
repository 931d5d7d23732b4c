"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned over ranks.

Each rank keeps only its shard of every parameter (`Unit`); `GatherScheduler` hooks gather a
module's parameters just before it runs and release them after, forward and backward. Gradients
are reduce-scattered per unit as soon as autograd has produced all of them, into fp32 shards the
optimizer steps. A model built under ``dstrain.zero.Init`` arrives partitioned: each unit adopts the
shard Init kept (`dstrain.zero.init.adopt`), nothing is re-materialized. A module whose forward uses
another module's parameter gathers it too when registered (``register_external_parameter``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dsio.checkpoint import LazyTensor
from dstrain.checkpoint.sources import read_lazy
from dstrain.config_sections import ZeroConfig
from dstrain.dist.comm import DONE, All, Comm
from dstrain.errors import NotImplementedConfigError
from dstrain.optim.clip import GradSet
from dstrain.zero import init as zero_init
from dstrain.zero.base import MasterPiece, ZeroStatistics, ZeroStrategy
from dstrain.zero.flat import STEP_CHUNK
from dstrain.zero.gather import GatherScheduler
from dstrain.zero.reduce import DefaultReducer, Handle, ReductionQueue, Route, default_routes
from dstrain.zero.units import ShardGroup, ShardStore, Unit

__all__ = ["Stage3Zero", "master_fill"]


MasterFill = Callable[[torch.Tensor, int], None]
"""``fill(out, start)``: master elements ``[start, start + out.numel())`` into ``out``."""

#: Elements of a stored master read per window when its destination is not host memory.
_FILL_WINDOW = 4 << 20


def master_fill(master: torch.Tensor | LazyTensor, total: int) -> MasterFill:
    """``fill(out, start)`` writing master elements ``[start, start + out.numel())`` into ``out``,
    from a tensor or from a checkpoint's stored tensor (read, not materialized: each call reads just
    that range). Stores call it with ranges in element order, so a stored tensor's checksum is
    checked as it is read."""
    if isinstance(master, torch.Tensor):
        if master.numel() != total:
            raise ValueError(f"master partition has {master.numel()} elements, expected {total}")
        flat = master.reshape(-1)

        def copy(out: torch.Tensor, start: int) -> None:
            out.copy_(flat[start : start + out.numel()])

        return copy
    if not isinstance(master, LazyTensor):
        raise TypeError(f"master partition must be a tensor, got {type(master).__name__}")
    numel = math.prod(master.shape)
    if master.dtype != torch.float32 or numel != total:
        raise ValueError(
            f"stored master partition is {master.dtype} with {numel} elements, "
            f"expected torch.float32 with {total}"
        )
    src = master

    def read(out: torch.Tensor, start: int) -> None:
        if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
            read_lazy(src, start * 4, out)  # straight into the destination (a swap buffer)
            return
        window = torch.empty(min(_FILL_WINDOW, out.numel()), dtype=torch.float32)
        for lo in range(0, out.numel(), window.numel()):
            n = min(window.numel(), out.numel() - lo)
            read_lazy(src, (start + lo) * 4, window[:n])
            out[lo : lo + n].copy_(window[:n])

    return read


class Stage3Zero(ZeroStrategy):
    """Stage 3 for ``module`` over ``comm`` (the data-parallel group); ``groups`` are optimizer param
    groups of trainable parameters, each sharded over and reduced along its `Route` (default: ``comm``)."""

    stage = 3

    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[dict[str, Any]],
        *,
        config: ZeroConfig,
        comm: Comm,
        dtype: torch.dtype,
        routes: list[Route] | None = None,
        store: ShardStore | None = None,
    ) -> None:
        routes = routes if routes is not None else default_routes(groups, comm)
        if len(routes) != len(groups):
            raise ValueError(f"{len(routes)} routes for {len(groups)} param groups")
        self.comm = comm
        self.config = config
        self.dtype = dtype
        self.device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        owner: dict[int, Unit] = {}
        units: list[Unit] = []
        per_group: list[list[Unit]] = [[] for _ in groups]
        module_units: dict[torch.nn.Module, list[Unit]] = {}
        self.store = store if store is not None else ShardStore()
        lazy = self.store.streams_initial_shards  # shards read from the parameters when placed
        directs: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]] = []
        for sub in module.modules():
            direct = [p for p in sub.parameters(recurse=False) if id(p) in group_of]
            for gi in range(len(groups)):
                mine = [p for p in direct if group_of[id(p)] == gi and id(p) not in owner]
                if mine:
                    adopted = zero_init.adopt(mine, routes[gi].comm, dtype)  # built under zero.Init
                    unit = Unit(len(units), mine, routes[gi].comm, dtype, keep_origin=lazy, adopted=adopted)
                    unit.persistent = unit.layout.total < config.stage3_param_persistence_threshold
                    unit.release()  # only its shard stays: the model is never held twice
                    units.append(unit)
                    per_group[gi].append(unit)
                    for p in mine:
                        owner[id(p)] = unit
            directs.append((sub, direct))
        zero_init.materialize(module, dtype)  # parameters no unit adopted (frozen ones): whole again
        for sub, direct in directs:
            external = [p for p in zero_init.external_parameters(sub) if id(p) in owner]
            # tied weights and registered external parameters: their owner's unit
            needed = list(dict.fromkeys(owner[id(p)] for p in direct + external))
            if needed:
                module_units[sub] = needed
        self.units = units
        self.store.expect(units)
        self.groups = [
            ShardGroup(
                gi,
                {k: v for k, v in g.items() if k != "params"},
                per_group[gi],
                routes[gi],
                dtype,
                self.device,
                min(config.sub_group_size, STEP_CHUNK),
                self.store,
            )
            for gi, g in enumerate(groups)
        ]
        for unit in units:
            unit.release()
        self.scheduler = GatherScheduler(module, module_units, units, config, self.store)
        self._unit_group = {u.index: g for g in self.groups for u in g.units}
        # overlap: up to three units in flight, then finish down to one; else each finishes at once
        self._queue = ReductionQueue(limit=2, keep=1) if config.overlap_comm else ReductionQueue(limit=0)
        # world size 1 with plain collectives: the reduction is the identity, so each parameter's
        # gradient goes into its range of the master gradient as autograd made it (`_reduce_in_place`)
        self._identity = {
            g.index: g.route.comm.world_size == 1 and isinstance(g.route.reducer, DefaultReducer)
            for g in self.groups
        }
        # units whose master-gradient range holds a gradient of this accumulation window: the first
        # one is put there (`ShardStore.put_grad`: the zeros are not read), later ones are added
        self._written: set[int] = set()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_hook(unit)) for unit in units for p in unit.params
        ]
        self._reduced_listeners: list[Callable[[int, int, int], None]] = []

    def on_unit_reduced(self, listener: Callable[[int, int, int], None]) -> None:
        """Call ``listener(group, offset, numel)`` each time a unit's reduced gradient has been added
        into master gradient ``[offset, offset + numel)`` of param group ``group`` (during backward, in
        the order reductions finish; the last ones at `after_backward`). On the accumulation boundary's
        backward that range is then final unless the unit is reduced again in the same pass (a
        parameter used across reentrant checkpoints): `dstrain.offload.optimizer.early_step` steps on it."""
        self._reduced_listeners.append(listener)

    def _reduced(self, group: int, offset: int, numel: int) -> None:
        for listener in self._reduced_listeners:
            listener(group, offset, numel)

    @property
    def partitioned(self) -> bool:
        return any(g.route.comm.world_size > 1 for g in self.groups)

    def grad_sets(self) -> list[GradSet]:
        if self.store.grads is not None:
            raise NotImplementedConfigError(
                "gradient_clipping",
                "gradients are offloaded to NVMe (offload_pinned_bytes cannot hold them): the global "
                "norm that clipping and fp16's overflow check need is not computed over swapped "
                "gradients; raise zero_optimization.offload_pinned_bytes above the gradient shards or "
                "turn clipping off",
            )
        # expert groups: slices over edp of different experts on every ep rank: their squares add over dp
        return [
            GradSet([g.master_grad], g.route.comm if g.route.expert_comm is None else self.comm)
            for g in self.groups
        ]

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": g.views, **g.options} for g in self.groups]

    # -- gradients ---------------------------------------------------------------------------

    def _grad_hook(self, unit: Unit):
        # Held weakly: the hook lives in the parameter's hook dict, which torch's garbage collector
        # does not traverse, so a strong reference here would keep this strategy, its units, the store
        # (and what listens to it: an offloading optimizer, its pinned buffers and step thread) alive
        # for good once an engine is dropped without close().
        zero, of = weakref.ref(self), weakref.ref(unit)

        def hook(p: torch.Tensor) -> None:
            me, u = zero(), of()
            if me is None or u is None:  # dropped: its hooks go with it
                return
            u.grads_ready += 1
            if u.grads_ready == len(u.params):
                me._reduce(u)
                u.release()

        return hook

    def _into(self, target: torch.Tensor, grad: torch.Tensor, alpha: float, first: bool) -> Handle:
        """``target += alpha * grad`` through the store: put where ``target`` still holds zeros."""
        if first:
            return self.store.put_grad(target, grad, alpha)
        self.store.add_grad(target, grad, alpha)
        return DONE

    def _reduce_in_place(self, unit: Unit, group: ShardGroup) -> None:
        """World size 1: no flat copy of the unit's gradients and no reduce-scatter output (a copy of
        it): each parameter's gradient goes into its range as it is, and what the queue keeps for
        overlap is the copies' handles (on a GPU, copies into host memory still in flight), not the
        gradients: their memory goes as soon as the copies are queued."""
        off, n = group.offsets[unit.index], unit.layout.shard
        target = group.master_grad[off : off + n]  # (shard,) = every element of the unit here
        first = unit.index not in self._written
        self._written.add(unit.index)
        landed: list[Handle] = []
        for p, start, numel in zip(unit.params, unit.layout.offsets, unit.layout.numels, strict=True):
            if p.grad is None:  # unused this pass: its range keeps its zeros (or earlier micro-steps')
                continue
            grad, p.grad = p.grad.reshape(-1), None  # (numel,) in the compute dtype
            # the mean over the data-parallel group (an expert route of one rank may sit in a bigger one)
            landed.append(self._into(target[start : start + numel], grad, 1.0 / self.comm.world_size, first))
        unit.grads_ready = 0
        self._queue.push(All(landed), lambda: self._reduced(group.index, off, n))

    def _reduce(self, unit: Unit) -> None:
        group = self._unit_group[unit.index]
        if self.store.grads is None and self._identity[group.index]:
            self._reduce_in_place(unit, group)
            return
        flat = unit.pop_flat_grad(self.dtype)  # (padded,)
        out = torch.empty(unit.layout.shard, dtype=self.dtype, device=flat.device)
        handle = group.route.reducer.reduce(
            flat, group.route.comm, out=out, async_op=self.config.overlap_comm
        )
        del flat  # the pending handle keeps the input alive inside the process group
        off = group.offsets[unit.index]
        dp = self.comm.world_size  # mean over the data-parallel group (see dstrain.zero.reduce)
        grads = self.store.grads
        n = unit.layout.shard
        if grads is not None:  # on NVMe: the same add_, on a unit-sized buffer read from the file

            def add_swapped() -> None:
                grads.accumulate(group.index, off, out, 1.0 / dp)
                self._reduced(group.index, off, n)

            self._queue.push(handle, add_swapped)
            return
        target = group.master_grad[off : off + n]
        first = unit.index not in self._written
        self._written.add(unit.index)

        def add() -> None:
            # the gradient partition may live in host memory (ZeRO-Offload): the store copies it out
            # as it is reduced; on the same device the same add_
            self._into(target, out, 1.0 / dp, first).wait()
            self._reduced(group.index, off, n)

        self._queue.push(handle, add)

    def after_backward(self, boundary: bool) -> None:
        for unit in self.units:
            if unit.grads_ready:  # some parameters of the unit were unused this pass
                self._reduce(unit)
        self._queue.drain()
        for unit in self.units:
            unit.release()

    def reduce_gradients(self) -> None:
        return  # reduce-scattered during backward, every micro-step

    def master_grads(self) -> list[torch.Tensor]:
        return [g.master_grad for g in self.groups]

    # -- weights -----------------------------------------------------------------------------

    def after_step(self, stepped: bool) -> None:
        if not stepped:
            return
        for g in self.groups:
            self.store.after_step(g)
        self.store.step_done()
        for unit in self.units:
            unit.regather()  # persistent units stay gathered: refresh them

    def zero_grad(self) -> None:
        """A new accumulation window: the gradient partitions are zeros again (users read them so
        after a step: tests/dstrain/offload/test_offload_optimizer_params.py), and each unit's first
        gradient of the window is put over its range (`ShardStore.put_grad`), later ones added."""
        self._written.clear()
        if self.store.grads is not None:
            self.store.grads.zero()
            return
        for g in self.groups:
            g.master_grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's master partitions, in memory (read from the swap files where they live there)."""
        return {**self._meta(), "master": [self.store.read_master(g) for g in self.groups]}

    def checkpoint_state(self) -> dict[str, Any]:
        """`state_dict` for a checkpoint: a master the store keeps in a swap file (parameters and
        optimizer state on NVMe) is a lazy source over that file (``dstrain.checkpoint.SwapRegions``),
        streamed by the checkpoint writer a window at a time, never read into memory. The optimizer's
        next step rewrites it sub-group by sub-group after the save has read each one (its touch
        order names the master's file spans: ``dstrain.checkpoint.gate``)."""
        return {**self._meta(), "master": [self.store.checkpoint_master(g) for g in self.groups]}

    def _meta(self) -> dict[str, Any]:
        """The state's entries other than the masters."""
        return {
            "stage": 3,
            "world_size": self.comm.world_size,
            "numels": [[u.layout.total for u in g.units] for g in self.groups],
        }

    def gathered_units(self) -> Iterator[list[torch.nn.Parameter]]:
        for unit in self.units:
            held = unit.gathered
            unit.finish_gather(private=True)
            try:
                yield unit.params
            finally:
                if not held:
                    unit.release(between_steps=True)

    def master_pieces(self) -> list[list[MasterPiece]]:
        return [
            [
                piece
                for u in g.units
                for piece in u.layout.pieces(u.params, u.layout.lo, u.layout.hi, g.offsets[u.index])
            ]
            for g in self.groups
        ]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state resharded for this engine (dstrain.checkpoint.reshape) records no units of its own
        if "numels" in state and state["numels"] != [[u.layout.total for u in g.units] for g in self.groups]:
            raise ValueError("checkpoint was saved from a model with different parameters")
        masters = state["master"]
        if len(masters) != len(self.groups):
            raise ValueError(f"checkpoint has {len(masters)} master partitions, this rank {len(self.groups)}")
        with torch.no_grad():
            for g, master in zip(self.groups, masters, strict=True):
                self.store.load_master(g, master_fill(master, g.total))
        for unit in self.units:
            unit.regather()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """`load_state_dict` with masters that may still be in the checkpoint file
        (``dsio.checkpoint.StoredTensor``): the store reads each range straight where it keeps the
        master (offloaded: a swap buffer at a time, into the shard or master file), so no whole
        master is read into memory. Checksums are checked as the ranges are read, in order."""
        self.load_state_dict(state)

    def gathered_module(self) -> None:
        """Gather every unit (for evaluation or export); `release_all` undoes it."""
        for unit in self.units:
            unit.finish_gather(private=True)

    def release_all(self) -> None:
        for unit in self.units:
            unit.release(between_steps=True)  # what the caller took from the gathered module stays valid

    def statistics(self) -> ZeroStatistics:
        return ZeroStatistics(
            stage=3,
            world_size=self.comm.world_size,
            model_numel=sum(u.layout.total for u in self.units),
            master_numel=sum(g.total for g in self.groups),
            resident_param_numel=sum(u.resident_numel() for u in self.units),
            peak_resident_param_numel=max(
                self.scheduler.peak_resident, sum(u.resident_numel() for u in self.units)
            ),
            gathers=self.scheduler.gathers,
            prefetches=self.scheduler.prefetches,
        )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._reduced_listeners.clear()
        self.scheduler.close()
        self.store.close()
