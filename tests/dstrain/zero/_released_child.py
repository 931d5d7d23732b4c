"""Run in a child process by test_released_parameters.py: reads every way a user reads a released
ZeRO-3 parameter (outside forward and outside `GatheredParameters`) in each offload setting, and
prints one JSON line per setting. A read of memory the engine gave back kills this process (SIGSEGV),
which the parent sees as the child's exit status: the test survives it."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import param_config

import dstrain
from dstrain.checkpoint.layout import trainable_shapes
from dstrain.profiling import FlopsProfiler
from dstrain.zero import GatheredParameters, Init


def _scenarios(root: str) -> dict[str, tuple[dict[str, Any], bool]]:
    """name -> (config, built under zero.Init)."""
    return {
        "none-fp32": (param_config(root), False),
        "none-bf16": (param_config(root, bf16=True), False),
        "cpu-fp32": (param_config(root, param="cpu", optimizer="cpu"), False),
        "cpu-bf16": (param_config(root, param="cpu", optimizer="cpu", bf16=True), False),
        "nvme-fp32": (param_config(root, param="nvme", optimizer="nvme"), False),
        "nvme-bf16": (param_config(root, param="nvme", optimizer="nvme", bf16=True), False),
        "init-none": (param_config(root), True),
        "init-nvme": (param_config(root, param="nvme", optimizer="nvme"), True),
    }


def _reads(engine: Any) -> dict[str, Any]:
    """Every read of every released parameter: what it gives (never a crash)."""
    module = engine.module
    out: dict[str, Any] = {"numel": [], "data": [], "sum": [], "tolist": [], "clone": [], "repr": []}
    for p in module.parameters():
        out["numel"].append(p.numel())
        out["data"].append(p.data.numel())
        out["sum"].append(float(p.detach().float().sum()))
        out["tolist"].append(p.tolist())
        out["clone"].append(p.clone().numel())
        out["repr"].append("[]" in repr(p))
    out["state_dict"] = [t.numel() for t in module.state_dict().values() if t.is_floating_point()]
    out["grads"] = [p.grad is None for p in module.parameters()]
    return out


def run(root: str) -> None:
    for name, (cfg, under_init) in _scenarios(root).items():
        print(f"# {name}", file=sys.stderr, flush=True)  # where a crash happened, for the parent
        torch.manual_seed(0)
        whole = {n: tuple(p.shape) for n, p in make_model().named_parameters()}
        if under_init:
            with Init(config_dict_or_path=cfg):
                model = make_model()
            # partitioned before initialize: reads are of Init's placeholders (never freed memory)
            before = [float(p.detach().float().sum()) for p in model.parameters()]
            assert all(math.isfinite(s) for s in before)
        else:
            model = make_model()
        engine, optimizer, _, _ = dstrain.initialize(model=model, config=cfg)
        res: dict[str, Any] = {"initialized": _reads(engine)}
        engine_losses(engine, 2)
        res["trained"] = _reads(engine)
        params = list(engine.module.parameters())
        res["ds_shape"] = [tuple(p.ds_shape) for p in params]
        res["ds_numel"] = [p.ds_numel for p in params]
        res["whole"] = [whole[n] for n, _ in engine.module.named_parameters()]
        res["trainable_shapes"] = {n: list(s) for n, s in trainable_shapes(engine.module).items()}
        res["profiled_params"] = FlopsProfiler(engine.module).get_total_params()
        with GatheredParameters(params):
            res["gathered_shapes"] = [tuple(p.shape) for p in params]
            res["gathered_sums"] = [float(p.detach().float().sum()) for p in params]
            ref = [p.detach().clone() for p in params]
            # tensors that share the gathered memory, read after the block released it
            taken = {
                "data": [p.data for p in params],
                "cpu": [p.detach().cpu() for p in params],  # the same memory on the CPU
                "view": [p.view(-1)[:3] for p in params],
                "state_dict": list(engine.module.state_dict().values()),
            }
            res["state_dict_gathered"] = sum(t.numel() for t in taken["state_dict"])
        res["after_gather"] = _reads(engine)
        res["taken_after_block"] = {
            "data": [torch.equal(t, r) for t, r in zip(taken["data"], ref, strict=True)],
            "cpu": [torch.equal(t, r) for t, r in zip(taken["cpu"], ref, strict=True)],
            "view": [torch.equal(t, r.view(-1)[:3]) for t, r in zip(taken["view"], ref, strict=True)],
            "state_dict": [float(t.float().sum()) for t in taken["state_dict"]],
        }
        res["ref_sums"] = [float(r.float().sum()) for r in ref]
        # engine.full_state_dict's way: the whole module gathered, then every unit released at once
        engine.zero.gathered_module()
        whole_sd = engine.module.state_dict()
        engine.empty_partition_cache()
        res["taken_after_release_all"] = sorted(float(t.float().sum()) for t in whole_sd.values())
        res["full_state_dict"] = sorted(float(t.float().sum()) for t in engine.full_state_dict().values())
        res["loss_after"] = engine_losses(engine, 1, start=2)[0]  # training goes on from the gathers
        engine.close()
        if hasattr(optimizer, "close"):
            optimizer.close()
        print(json.dumps({"name": name, **res}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1])
