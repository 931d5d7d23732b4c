"""ZeRO stages 0, 1 and 2: parameters replicated, optimizer state (1) and gradients (2) partitioned.

Every param group's trainable parameters become views into one flat buffer (``FlatLayout``), so
reductions and gathers are a few large collectives. fp32 training aliases the master weights to the
flat buffer itself (no copy); fp16/bf16 keep an fp32 master copy of this rank's range.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dstrain.config_sections import ZeroConfig
from dstrain.dist.comm import Comm
from dstrain.optim.clip import GradSet
from dstrain.zero.base import MasterPiece, ZeroStatistics, ZeroStrategy
from dstrain.zero.buckets import BoundaryBuckets, Stage2Buckets
from dstrain.zero.flat import STEP_CHUNK, FlatGroup
from dstrain.zero.reduce import ReductionQueue, Route, default_routes

__all__ = ["DataParallelZero"]


def _shares(t: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """True when ``t`` lies in the storage of one of ``others`` (so zeroing those zeroed it)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o is not None and o.untyped_storage().data_ptr() == ptr for o in others)


class DataParallelZero(ZeroStrategy):
    """Stages 0-2 over ``comm`` (the data-parallel group); ``groups`` are optimizer param groups of
    trainable parameters, each reduced (and partitioned) along its `Route` (default: over ``comm``)."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        stage: int,
        config: ZeroConfig,
        comm: Comm,
        dtype: torch.dtype,
        routes: list[Route] | None = None,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"DataParallelZero handles stages 0-2, not {stage}")
        routes = routes if routes is not None else default_routes(groups, comm)
        if len(routes) != len(groups):
            raise ValueError(f"{len(routes)} routes for {len(groups)} param groups")
        self.stage = stage
        self.comm = comm
        self.config = config
        self.dtype = dtype
        self.groups = [
            FlatGroup(
                {k: v for k, v in g.items() if k != "params"},
                list(g["params"]),
                stage,
                route,
                dtype,
                min(config.sub_group_size, STEP_CHUNK),
                # a true reduce-scatter only where it beats an all-reduce (not on gloo, see Comm)
                reduce_scatter=stage == 1
                and not route.full_grad
                and config.reduce_scatter
                and not config.overlap_comm
                and route.comm.world_size > 1
                and not route.comm.emulate,
            )
            for g, route in zip(groups, routes, strict=True)
        ]
        self._hooks: list[Any] = []
        self._buckets: Stage2Buckets | None = None
        self._boundary: list[BoundaryBuckets] = []
        if stage == 2:
            self._buckets = Stage2Buckets(self.groups, config, comm.world_size, dtype)
            for gi, group in enumerate(self.groups):
                for pi, p in enumerate(group.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._buckets.hook(gi, pi)))
        elif config.overlap_comm and any(g.route.comm.world_size > 1 for g in self.groups):
            # like DDP: all-reduce each bucket of the flat gradient as soon as backward has filled it
            for group in self.groups:
                assert group.flat_grad is not None
                buckets = BoundaryBuckets(
                    group.layout, group.flat_grad, config.reduce_bucket_size, group.route
                )
                self._boundary.append(buckets)
                for pi, p in enumerate(group.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(buckets.hook(pi)))

    @property
    def loss_prescale(self) -> float:
        # stages 0-1 sum gradients in place; dividing the loss instead saves a pass over them
        return 1.0 / self.comm.world_size if self.stage < 2 else 1.0

    @property
    def partitioned(self) -> bool:
        return self.stage > 0 and any(g.route.comm.world_size > 1 for g in self.groups)

    def grad_sets(self) -> list[GradSet]:
        # stage 0: every rank holds the whole (all-reduced) gradient; 1-2: its slice over the route
        # expert groups: each ep rank holds other experts, so squares add over ep too (over dp once partitioned)
        return [
            GradSet(
                [g.master_grad],
                (g.route.comm if g.route.expert_comm is None else self.comm)
                if self.stage > 0 and not g.route.full_grad  # full_grad: whole on every rank, as stage 0
                else g.route.expert_comm,
            )
            for g in self.groups
        ]

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": g.views, **g.options} for g in self.groups]

    def before_backward(self, boundary: bool) -> None:
        if self.stage < 2:
            for g in self.groups:
                g.attach_grads()
        for buckets in self._boundary:
            buckets.armed = boundary  # gradients are complete only in the last micro-step's backward

    def after_backward(self, boundary: bool) -> None:
        if self._buckets is not None:
            self._buckets.drain()

    def reduce_gradients(self) -> None:
        if self.stage == 2:
            return  # reduced during backward, every micro-step
        # the loss was pre-scaled by 1/world (`loss_prescale`): summing over ranks averages
        for gi, g in enumerate(self.groups):
            assert g.flat_grad is not None
            if self._boundary:
                self._boundary[gi].finish()  # (padded,) summed over ranks
            elif g.part_grad is not None:
                g.route.reducer.reduce(g.flat_grad, g.route.comm, out=g.part_grad, async_op=False).wait()
            else:
                self._all_reduce_bucketed(g.flat_grad, g.route)
            glo, ghi = g.grad_range
            src = g.part_grad if g.part_grad is not None else g.flat_grad[glo:ghi]
            if g.master_grad.data_ptr() != src.data_ptr():
                g.master_grad.copy_(src)

    def _all_reduce_bucketed(self, flat: torch.Tensor, route: Route) -> None:
        if route.comm.world_size == 1:
            return
        size = self.config.reduce_bucket_size or flat.numel()  # 0: no bucketing (HF's ZeRO test configs)
        queue = ReductionQueue()  # every bucket in flight at once, then wait for all
        for i in range(0, flat.numel(), size):
            queue.push(route.reducer.reduce(flat[i : i + size], route.comm))
        queue.drain()

    def master_grads(self) -> list[torch.Tensor]:
        return [g.master_grad for g in self.groups]

    def after_step(self, stepped: bool) -> None:
        if not stepped:
            return
        for g in self.groups:
            lo, hi = g.range
            if not g.alias:
                g.flat[lo:hi].copy_(g.master.detach())
            if self.stage > 0 and not g.replicated:
                g.route.comm.all_gather(g.flat, g.flat[lo:hi])

    def zero_grad(self) -> None:
        for g in self.groups:
            if g.flat_grad is not None:
                g.flat_grad.zero_()
            if g.part_grad is not None:
                g.part_grad.zero_()
            if g.flat_grad is None or not _shares(g.master_grad, g.flat_grad, g.part_grad):
                g.master_grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "world_size": self.comm.world_size,
            "numels": [g.layout.total for g in self.groups],
            "master": [g.master.detach() for g in self.groups],
        }

    def gathered_units(self) -> Iterator[list[torch.nn.Parameter]]:
        yield [p for g in self.groups for p in g.params]  # replicated: every parameter is whole

    def master_pieces(self) -> list[list[MasterPiece]]:
        return [g.layout.pieces(g.params, *g.range, 0) for g in self.groups]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for g, master in zip(self.groups, state["master"], strict=True):
            with torch.no_grad():
                g.master.copy_(master)
                lo, hi = g.range
                if not g.alias:
                    g.flat[lo:hi].copy_(master)
            if self.stage > 0:
                g.route.comm.all_gather(g.flat, g.flat[lo:hi])

    def statistics(self) -> ZeroStatistics:
        resident = sum(g.layout.padded for g in self.groups)
        return ZeroStatistics(
            stage=self.stage,
            world_size=self.comm.world_size,
            model_numel=sum(g.layout.total for g in self.groups),
            master_numel=sum(g.master.numel() for g in self.groups),
            resident_param_numel=resident,
            peak_resident_param_numel=resident,
            gathers=0,
            prefetches=0,
        )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
