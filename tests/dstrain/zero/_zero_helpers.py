"""Workers of the zero tests (the reducer seam): run inside spawned gloo ranks (once _seams_helpers.py)."""

from __future__ import annotations

from typing import Any

import torch


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
