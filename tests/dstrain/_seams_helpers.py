"""Workers for the seam tests (topology, reducer): run inside spawned gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

from dstrain.dist import Layout, Topology


def topology_run(pp: int, ep: int) -> dict[str, Any]:
    """Build the topology on the real world and sum each rank's global rank over each of its groups."""
    topo = Topology.from_world(pp=pp, ep=ep)
    out: dict[str, Any] = {"coords": topo.coords, "sizes": {}, "sums": {}}
    for kind in ("dp", "pp", "ep", "edp"):
        comm = getattr(topo, kind)
        t = torch.tensor([float(topo.world.rank)])
        comm.all_reduce(t)
        out["sizes"][kind] = comm.world_size
        out["sums"][kind] = t.item()
        out[f"{kind}_rank"] = comm.rank
    # broadcast from group rank 0 goes to the right global source
    b = torch.tensor([float(topo.world.rank) + 10])
    topo.dp.broadcast(b, src=0)
    out["dp_bcast"] = b.item()
    out["layout_dp"] = Layout(world=topo.world.world_size, pp=pp, ep=ep).dp
    return out


# -- reducer ------------------------------------------------------------------------------------


class RecordingReducer:
    """Delegates to the default reducer and records each call."""

    def __init__(self) -> None:
        from dstrain.zero.reduce import DefaultReducer

        self.inner = DefaultReducer()
        self.calls: list[tuple[int, bool]] = []  # (numel, reduce-scatter?)

    def reduce(self, flat: Any, comm: Any, *, out: Any = None, async_op: bool = True) -> Any:
        self.calls.append((flat.numel(), out is not None))
        return self.inner.reduce(flat, comm, out=out, async_op=async_op)


class _Now:
    def wait(self) -> bool:
        return True


class DroppingReducer:
    """Replaces every gradient by zero: the params it routes must never move (plain SGD)."""

    def __init__(self) -> None:
        self.calls = 0

    def reduce(self, flat: Any, comm: Any, *, out: Any = None, async_op: bool = True) -> Any:
        self.calls += 1
        (flat if out is None else out).zero_()
        return _Now()


def reducer_run(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per config: losses with the default routes, with recording routes, and with group 1 dropped."""
    import importlib

    from _dstrain_helpers import engine_losses, make_model

    import dstrain
    from dstrain.zero.reduce import Route

    init = importlib.import_module("dstrain.initialize")  # the module (dstrain.initialize is the function)
    original = init.build_routes
    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        res: dict[str, Any] = {}
        for mode in ("default", "recording", "dropping"):
            reducers: list[Any] = []

            def routes(
                groups: Any, topo: Any, *rest: Any, mode: str = mode, reducers: list[Any] = reducers
            ) -> Any:
                if mode == "default":
                    return original(groups, topo, *rest)  # build_routes may take more (the config)
                reducers.extend(
                    [RecordingReducer(), RecordingReducer() if mode == "recording" else DroppingReducer()]
                )
                return [Route(r, topo.dp) for r in reducers]

            init.build_routes = routes
            try:
                model = make_model()
                second = [model.block[0].weight, model.block[0].bias]  # group 1: the first linear layer
                first = [p for p in model.parameters() if all(p is not q for q in second)]
                before = [t.detach().clone() for t in second]
                engine, _, _, _ = dstrain.initialize(
                    model=model, model_parameters=[{"params": first}, {"params": second}], config=cfg
                )
                losses = engine_losses(engine, 3)
                full = engine.full_state_dict()
                engine.close()
            finally:
                init.build_routes = original
            res[mode] = {
                "losses": losses,
                "group1_unchanged": all(
                    torch.equal(b, full[k])
                    for b, k in zip(before, ("block.0.weight", "block.0.bias"), strict=True)
                ),
                "calls": [r.calls if isinstance(r.calls, int) else len(r.calls) for r in reducers],
            }
        out[name] = res
    return out


# -- clipping -----------------------------------------------------------------------------------


def clip_run() -> dict[str, Any]:
    """Two sets on 2 ranks: a slice partitioned over the world and a replicated tensor."""
    import math

    from dstrain.dist.comm import Comm
    from dstrain.optim.clip import GradSet, clip_grads_, global_grad_norm

    world = Comm()
    r = world.rank
    part = [torch.full((3,), float(r + 1))]  # rank 0: 1,1,1  rank 1: 2,2,2
    repl = [torch.tensor([4.0])]  # the same on both ranks: counted once
    norm = global_grad_norm([GradSet(part, world), GradSet(repl, None)])
    expected = math.sqrt(3 * 1 + 3 * 4 + 16)
    coef = clip_grads_(part + repl, 1.0, norm)
    after = global_grad_norm([GradSet(part, world), GradSet(repl, None)])
    # an overflow on one rank reaches every rank through ``agree`` (a MAX would drop a NaN)
    bad = [torch.tensor([float("nan") if r == 1 else 1.0])]
    local_only = global_grad_norm([GradSet(bad, None)], agree=world)
    return {"norm": norm, "expected": expected, "coef": coef, "after": after, "overflow": local_only}
