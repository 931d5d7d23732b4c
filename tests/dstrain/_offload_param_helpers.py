"""Workers for the parameter-offload tests: run inside spawned gloo ranks (or in-process at world 1)."""

from __future__ import annotations

import os
from typing import Any

from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import final_params, offload_config


def param_config(
    root: str,
    *,
    param: str = "none",
    optimizer: str = "none",
    clip: float = 0.0,
    bf16: bool = False,
    budget: int | None = None,
    sub_group: int = 1024,
) -> dict[str, Any]:
    """Stage 3 of the tiny model with parameter shards on ``param`` and optimizer state on ``optimizer``."""
    cfg = offload_config(3, optimizer, root, clip=clip, sub_group=sub_group, bf16=bf16)
    z = cfg["zero_optimization"]
    if param != "none":
        z["offload_param"] = {"device": param, "buffer_count": 3, "buffer_size": 1 << 20}
        if param == "nvme":
            z["offload_param"]["nvme_path"] = root
    if budget is not None:
        z["offload_pinned_bytes"] = budget
    return cfg


def param_parity_run(scenarios: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per scenario: losses, final parameters, last grad norm, parameter-store and optimizer statistics,
    and whether the shard file existed while training and is gone after close."""
    import dstrain

    out: dict[str, Any] = {}
    for name, cfg in scenarios.items():
        engine, optimizer, _, _ = dstrain.initialize(model=make_model(), config=cfg)
        store = engine.zero.store
        losses = engine_losses(engine, steps)
        pstats = store.statistics()
        path = getattr(getattr(pstats, "swapper", None), "path", None)
        out[name] = {
            "losses": losses,
            "params": final_params(engine),
            "grad_norm": engine.statistics().last_grad_norm,
            "file_existed": path is not None and os.path.exists(path),
            "master_numel_resident": sum(g.master.untyped_storage().nbytes() for g in engine.zero.groups)
            // 4,
            "shard_numel_resident": sum(store.shard_numel(u) for u in engine.zero.units),
        }
        engine.close()
        if hasattr(optimizer, "close"):
            optimizer.close()
        out[name]["param"] = store.statistics()
        out[name]["optimizer"] = optimizer.statistics() if hasattr(optimizer, "statistics") else None
        out[name]["dir_after_close"] = path is not None and os.path.exists(os.path.dirname(path))
    return out
