"""Shared 2-rank set-up of the 1-bit Adam / 0/1 Adam tests (test_onebit*.py).

Every test module registers its workers (`register`) at import; the first module fixture that asks for
its results (`shared_runs`) starts ONE 2-rank gloo group that runs every registered worker in turn, so
the whole family pays for one process start instead of one per module. A worker that fails on a rank
stops that rank (its peers then fail in their next collective): its tests fail with the traceback, the
workers registered after it fail as not run.

The training harnesses the workers share live here too: `anchor_train` (the plain loop the DeepSpeed
0.16.5 anchors used: gradients all-reduced when the optimizer asks), `anchor_resume` (the same with a
save/load of model and optimizer state in the middle) and `engine_run` (dstrain.initialize, train,
checkpoint, resume).
"""

from __future__ import annotations

import copy
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from _dstrain_helpers import engine_losses, make_model, scratch_dir, spawn
from torch import nn

__all__ = [
    "anchor_resume",
    "anchor_train",
    "engine_run",
    "regression_batches",
    "regression_model",
    "register",
    "shared_runs",
    "summary",
]

_PARTS: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
_RESULTS: dict[str, list[dict[str, Any]]] = {}


def register(name: str, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(root, *args)`` on every rank of the shared group (``root``: a directory of its own)."""
    _PARTS[name] = (fn, args)


def _run_parts(root: str, parts: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (fn, args) in parts.items():
        os.makedirs(os.path.join(root, name), exist_ok=True)
        start = time.perf_counter()
        try:
            out[name] = {"ok": fn(os.path.join(root, name), *args), "seconds": time.perf_counter() - start}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            break  # the peers may wait in a collective of this worker: stop, they fail when we leave
    return out


def shared_runs(name: str) -> list[Any]:
    """Each rank's result of the worker registered as ``name`` (all registered workers run once)."""
    if name not in _PARTS:
        raise KeyError(f"no 1-bit worker registered as {name!r}")
    if name not in _RESULTS:
        pending = {k: v for k, v in _PARTS.items() if k not in _RESULTS}
        with scratch_dir("dstrain-onebit-") as root:  # results come back in memory: the files can go
            ranks = spawn(_run_parts, root, pending, world=2, start_method="forkserver")
        for key in pending:
            _RESULTS[key] = [r.get(key, {"error": "not run: an earlier worker failed"}) for r in ranks]
    results = _RESULTS[name]
    if os.environ.get("DSTRAIN_ONEBIT_TIMES"):
        print(f"1-bit worker {name}: " + ", ".join(f"{r.get('seconds', 0.0):.1f} s" for r in results))
    for rank, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"worker {name!r} failed on rank {rank}:\n{res['error']}")
    return [res["ok"] for res in results]


# -- in-process behaviours every optimizer of the family has ---------------------------------------------


def check_first_step(make_opt: Callable[[list[nn.Parameter], bool], torch.optim.Optimizer]) -> None:
    """``make_opt(params, deepspeed_compat)`` at lr 0.1: by default the first step moves every weight by
    ~lr (bias-corrected Adam); with DeepSpeed's behaviour (``deepspeed_compat=True``) it only fills the
    moments (counts), so nothing moves."""
    for compat, moved in ((False, True), (True, False)):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        before = lin.weight.detach().clone()
        opt = make_opt(list(lin.parameters()), compat)
        lin(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
        delta = (lin.weight.detach() - before).abs()
        if moved:
            assert torch.allclose(delta, torch.full_like(delta, 0.1), rtol=1e-3), (compat, delta)
        else:
            assert torch.equal(delta, torch.zeros_like(delta)), (compat, delta)


# -- the anchors' harness (bench/onebit_anchor.py ran DeepSpeed 0.16.5 through the same loop) ----------


def regression_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def regression_batches(
    device: torch.device, noise: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own stream of (64, 32) inputs of one linear map; ``noise``: a loss floor of ~1."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))
    while True:
        x = torch.randn(64, 32, generator=g)
        y = x @ w + (torch.randn(64, 4, generator=g) if noise else 0.0)
        yield x.to(device), y.to(device)


def anchor_train(
    opt_fn: Callable[[Any], Any] | None,
    steps: int,
    *,
    noise: bool = False,
    device: str = "cpu",
    model: nn.Module | None = None,
    opt: Any = None,
    data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The anchors' loop: gradients all-reduced (mean) when the optimizer asks for it (always, for an
    optimizer that does not ask). Returns the mean losses, what was reduced, the weights and the
    model, optimizer and data stream (to go on training)."""
    dev = torch.device(device)
    model = model if model is not None else regression_model().to(dev)
    if opt is None:
        assert opt_fn is not None
        opt = opt_fn(model.parameters())
    data = data if data is not None else regression_batches(dev, noise)
    world = dist.get_world_size() if dist.is_initialized() else 1
    reduced, sums = [], []
    for _ in range(steps):
        x, y = next(data)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        ask = opt.reduces_gradients() if hasattr(opt, "reduces_gradients") else True
        reduced.append(ask)
        if ask and world > 1:
            # one all-reduce of all gradients (flattened), not one a parameter (a small collective costs ~1 ms
            # of CPU per rank on the loaded 2-core machine): at world 2 each element is the same a + b
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(summed.view_as(g))
                g.mul_(1 / world)
        opt.step()
        opt.zero_grad()
        sums.append(loss.detach().clone())
    losses_t = torch.stack(sums) if sums else torch.zeros(0)  # (steps,): the ranks' sums in one all-reduce
    if world > 1 and sums:
        dist.all_reduce(losses_t)
    losses = [v / world for v in losses_t.tolist()]
    return {
        "losses": losses,
        "reduced": reduced,
        "params": [p.detach().cpu().clone() for p in model.parameters()],
        "model": model,
        "opt": opt,
        "data": data,
    }


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """What a test needs of an `anchor_train` run (no model or generator to send back)."""
    opt = run["opt"]
    return {
        "losses": run["losses"],
        "reduced": run["reduced"],
        "params": run["params"],
        "state": opt.state_dict(),
        "stats": opt.backend.statistics() if hasattr(opt, "backend") else None,
        "syncs": getattr(opt, "local_syncs", None),
        "skipped": getattr(opt, "local_steps_skipped", None),
    }


def anchor_resume(opt_fn: Callable[[Any], Any], split: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` straight, and again with model + optimizer state saved at ``split`` and loaded
    into fresh ones (the data stream goes on where it was)."""
    straight = anchor_train(opt_fn, steps)
    first = anchor_train(opt_fn, split)
    saved_model = {k: v.clone() for k, v in first["model"].state_dict().items()}
    saved_opt = copy.deepcopy(first["opt"].state_dict())
    model = regression_model()
    model.load_state_dict(saved_model)
    opt = opt_fn(model.parameters())
    opt.load_state_dict(copy.deepcopy(saved_opt))  # torch keeps the loaded tensors: give it copies
    restored = copy.deepcopy(opt.state_dict())
    rest = anchor_train(None, steps - split, model=model, opt=opt, data=first["data"])
    return {
        "straight": straight["params"],
        "straight_losses": straight["losses"][split:],
        "resumed": rest["params"],
        "resumed_losses": rest["losses"],
        "saved": saved_opt,
        "restored": restored,
    }


# -- the engine ----------------------------------------------------------------------------------------


def engine_run(
    config: dict[str, Any],
    steps: int,
    *,
    root: str | None = None,
    split: int = 5,
    inject: tuple[tuple[int, int], ...] = (),
    model_fn: Callable[[], nn.Module] = make_model,
) -> dict[str, Any]:
    """``dstrain.initialize`` on the tiny model, ``steps`` steps. With ``root``: a checkpoint after step
    ``split`` and a fresh engine (other initial weights) resumed from it for the remaining steps.
    ``inject``: (step, rank) pairs whose loss is made inf on that rank only (an fp16 overflow)."""
    import dstrain

    engine, _, _, _ = dstrain.initialize(model=model_fn(), config=config)
    _inject(engine, inject)
    first = engine_losses(engine, split if root is not None else steps)
    out: dict[str, Any] = {}
    if root is not None:
        engine.save_checkpoint(os.path.join(root, "ck"))
        out["saved"] = copy.deepcopy(engine.stepper.state_dict())
        first += engine_losses(engine, steps - split, start=split)
    out.update(
        losses=first,
        params=[p.detach().float().clone() for p in engine.module.parameters()],
        stats=engine.stepper.statistics(),
        engine_stats=engine.statistics(),
        state=engine.stepper.state_dict()["state"],
        skipped=engine.skipped_steps,
        loss_scale=engine.loss_scale,
        lr=engine.get_lr(),
    )
    engine.close()
    if root is None:
        return out
    resumed, _, _, _ = dstrain.initialize(model=make_model(seed=7), config=config)
    resumed.load_checkpoint(os.path.join(root, "ck"))
    _inject(resumed, inject)
    out["restored"] = copy.deepcopy(resumed.stepper.state_dict())
    out["again"] = engine_losses(resumed, steps - split, start=split)
    out["resumed_params"] = [p.detach().float().clone() for p in resumed.module.parameters()]
    resumed.close()
    return out


def _inject(engine: Any, inject: tuple[tuple[int, int], ...]) -> None:
    rank = engine.comm.rank
    steps = {step for step, r in inject if r == rank}
    if steps:  # the module returns the loss: make it inf in the forward of those steps on this rank
        engine.module.register_forward_hook(
            lambda _m, _i, out: out * float("inf") if engine.global_steps in steps else None
        )
