"""Worker for the device-parameterised offload parity test (in-process at world 1, or in spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch
from _dstrain_helpers import engine_losses, make_model, world_rank
from _offload_helpers import final_params, offload_config
from _offload_param_helpers import param_config


def device_scenarios(root: str, bf16: bool) -> dict[str, dict[str, Any]]:
    """No offload (the reference) and every optimizer / parameter offload pairing the GPU run uses."""
    out: dict[str, dict[str, Any]] = {}
    for stage in (2, 3):
        out[f"s{stage}_none"] = offload_config(stage, "none", root, sub_group=1024, bf16=bf16)
        for opt in ("cpu", "nvme"):
            out[f"s{stage}_opt_{opt}"] = offload_config(stage, opt, root, sub_group=1024, bf16=bf16)
    for opt in ("none", "cpu", "nvme"):
        out[f"s3_param_nvme_opt_{opt}"] = param_config(root, param="nvme", optimizer=opt, bf16=bf16)
    return out


def device_parity_run(root: str, device: str, bf16: bool, steps: int = 5) -> dict[str, Any]:
    """Per scenario: the losses, the final parameters (CPU copies), the optimizer's host<->device copy
    bytes and the master device, training the tiny model on ``device`` ("cuda": this rank's GPU)."""
    import dstrain

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    _, rank = world_rank()
    out: dict[str, Any] = {}
    for name, cfg in device_scenarios(os.path.join(root, f"rank{rank}"), bf16).items():
        os.makedirs(os.path.join(root, f"rank{rank}"), exist_ok=True)
        engine, optimizer, _, _ = dstrain.initialize(model=make_model().to(device), config=cfg)
        losses = engine_losses(engine, steps)
        stager = getattr(optimizer, "_stager", None)
        masters = [p for g in optimizer.param_groups for p in g["params"]]
        out[name] = {
            "losses": losses,
            "params": [t.detach().cpu() for t in final_params(engine)],
            "copied": stager.copied_bytes if stager is not None else None,
            "master_device": str(masters[0].device),
            "offloaded": type(optimizer).__name__ == "OffloadAdam",
        }
        engine.close()
        if hasattr(optimizer, "close"):
            optimizer.close()
    return out
