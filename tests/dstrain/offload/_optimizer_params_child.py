"""Run in a child process by test_offload_optimizer_params.py: reads the optimizer's parameters (and
their ``.grad``) every way a user does (a Trainer's logging, a clipping utility) in each offload
setting, after initialize and after training, and prints one JSON line per setting. A read of storage
that holds no bytes kills this process (SIGSEGV), which the parent sees as the child's exit status."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch
from _dstrain_helpers import TanhStack
from _offload_helpers import param_config
from test_offload_grads import DEPTH, WIDTH  # 10 x Linear(256, 256): 2.6 MB of fp32 gradients

import dstrain

SMALL_BUDGET = 1 << 20  # below the 2.6 MB of fp32 gradient shards: they go to NVMe too
# ~80 master views (sub-groups) over the 658k-element master: several per parameter, as the default 1024
# gives (~640), at an eighth of the swap requests (the reads cover every view whatever their number)
SUB_GROUP = 8192

SETTINGS: dict[str, dict[str, Any]] = {
    # parameters + optimizer state on NVMe: the store holds the fp32 master (and the gradients)
    "paramopt-fp32": {"param": "nvme", "optimizer": "nvme"},
    "paramopt-bf16": {"param": "nvme", "optimizer": "nvme", "bf16": True},
    "paramopt-fp32-grads": {"param": "nvme", "optimizer": "nvme", "budget": SMALL_BUDGET},
    "paramopt-bf16-grads": {"param": "nvme", "optimizer": "nvme", "bf16": True, "budget": SMALL_BUDGET},
    # the master stays in memory: the optimizer's parameters hold its values
    "param-nvme-opt-cpu": {"param": "nvme", "optimizer": "cpu"},
    "param-cpu-opt-cpu": {"param": "cpu", "optimizer": "cpu"},
    "opt-nvme": {"optimizer": "nvme"},
}


def _train(engine: Any, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, WIDTH, generator=g), torch.randn(2, WIDTH, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _reads(optimizer: Any) -> dict[str, Any]:
    """What every read of the optimizer's parameters gives (never a crash)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out: dict[str, Any] = {"numel": [], "sum": [], "clone": [], "tolist": [], "repr": [], "grad": []}
    for p in params:
        out["numel"].append(p.numel())
        out["sum"].append(float(p.detach().sum()))
        out["clone"].append(p.detach().clone().numel())
        out["tolist"].append(len(p.tolist()))
        out["repr"].append(len(repr(p)) > 0)
        out["grad"].append(None if p.grad is None else float(p.grad.detach().sum()))
    out["ds_numel"] = [getattr(p, "ds_numel", None) for p in params]
    out["ds_shape"] = [list(getattr(p, "ds_shape", ())) for p in params]
    # what a Trainer's clipping does over the optimizer's parameters
    out["clip_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm=1e9))
    state = optimizer.state_dict()["state"]
    out["state_shapes"] = [list(state[i]["exp_avg"].shape) for i in sorted(state)]
    return out


def run(root: str) -> None:
    for name, setting in SETTINGS.items():
        print(f"# {name}", file=sys.stderr, flush=True)  # where a crash happened, for the parent
        cfg = param_config(root, sub_group=SUB_GROUP, **setting)
        torch.manual_seed(0)
        engine, optimizer, _, _ = dstrain.initialize(model=TanhStack(WIDTH, DEPTH), config=cfg)
        res: dict[str, Any] = {"initialized": _reads(optimizer)}
        res["losses"] = _train(engine, 2)
        res["trained"] = _reads(optimizer)
        res["loss_after"] = _train(engine, 1, start=2)[0]  # training goes on after the reads
        res["grads_on_nvme"] = engine.zero.store.grads is not None
        res["master_numel"] = sum(g.total for g in engine.zero.groups)
        res["finite"] = all(math.isfinite(v) for v in res["losses"] + [res["loss_after"]])
        engine.close()
        optimizer.close()
        print(json.dumps({"name": name, **res}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1])
