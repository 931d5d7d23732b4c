"""Workers for the offload tests: run inside spawned gloo ranks (or in-process at world size 1)."""

from __future__ import annotations

import os
from typing import Any

import torch
from _dstrain_helpers import base_config, engine_losses, make_model, world_rank


def offload_config(
    stage: int,
    device: str,
    nvme_root: str,
    *,
    clip: float = 0.0,
    sub_group: int | None = None,
    bf16: bool = False,
    **zero: Any,
) -> dict[str, Any]:
    """The tiny model's config at ``stage`` with optimizer state on ``device`` (none, cpu, nvme)."""
    world, _ = world_rank()
    cfg = base_config(stage, world=world, micro=2, gradient_clipping=clip)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    z = cfg["zero_optimization"]
    if device != "none":
        z["offload_optimizer"] = {"device": device}
        if device == "nvme":
            z["offload_optimizer"]["nvme_path"] = nvme_root
            z["offload_optimizer"]["buffer_count"] = 2
    if sub_group is not None:
        z["sub_group_size"] = sub_group
    z.update(zero)
    return cfg


def final_params(engine: Any) -> list[torch.Tensor]:
    """Every parameter of the whole model (gathered at stage 3), as CPU copies."""
    return [t for t in engine.full_state_dict().values()]


def parity_run(scenarios: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per scenario: losses of ``steps`` steps, the final parameters, grad norm, offload statistics."""
    import dstrain

    out: dict[str, Any] = {}
    for name, cfg in scenarios.items():
        engine, optimizer, _, _ = dstrain.initialize(model=make_model(), config=cfg)
        losses = engine_losses(engine, steps)
        stats = optimizer.statistics() if hasattr(optimizer, "statistics") else None
        swap_path = getattr(getattr(stats, "swapper", None), "path", None)
        out[name] = {
            "losses": losses,
            "params": final_params(engine),
            "grad_norm": engine.statistics().last_grad_norm,
            "swap_file_exists": swap_path is not None and os.path.exists(swap_path),
        }
        engine.close()  # closes the stepper too: its writes in flight drain first
        out[name]["offload"] = optimizer.statistics() if hasattr(optimizer, "statistics") else None
        if swap_path is not None:
            out[name]["swap_dir_after_close"] = os.path.exists(os.path.dirname(swap_path))
    return out


def resume_run(root: str, stage: int, save_device: str, load_device: str, steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` with optimizer state on ``save_device``, checkpoint; a fresh engine with state on
    ``load_device`` (and other initial weights) loads it and trains ``steps`` more. Returns the second
    half's losses and the final parameters, and the same from one uninterrupted no-offload run."""
    import dstrain

    ckpt = os.path.join(root, f"ckpt-s{stage}-{save_device}-{load_device}")
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    engine, opt, _, _ = dstrain.initialize(
        model=make_model(), config=offload_config(stage, save_device, swap)
    )
    engine_losses(engine, steps)
    engine.save_checkpoint(ckpt)
    _close(engine, opt)
    engine, opt, _, _ = dstrain.initialize(
        model=make_model(seed=7), config=offload_config(stage, load_device, swap)
    )
    engine.load_checkpoint(ckpt)
    resumed = engine_losses(engine, steps, start=steps)
    params = final_params(engine)
    _close(engine, opt)
    engine, opt, _, _ = dstrain.initialize(model=make_model(), config=offload_config(stage, "none", swap))
    whole = engine_losses(engine, 2 * steps)
    ref_params = final_params(engine)
    _close(engine, opt)
    return {"resumed": resumed, "params": params, "whole": whole[steps:], "ref_params": ref_params}


def _close(engine: Any, optimizer: Any) -> None:
    engine.close()
    if hasattr(optimizer, "close"):
        optimizer.close()


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def slow_swap_reads(monkeypatch: Any, delay: float, chunk_bytes: int = 16 << 10) -> None:
    """An async save's swap-file reads each take ``delay`` seconds more and its windows are
    ``chunk_bytes``, so its staging outlasts the forward and backward after it."""
    import asyncio

    from dsio.checkpoint import _stream
    from dstrain.checkpoint.sources import SwapRegions

    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", chunk_bytes)
    read = SwapRegions.read_into

    async def slow(self: SwapRegions, io: Any, offset: int, out: torch.Tensor) -> None:
        await asyncio.sleep(delay)
        await read(self, io, offset, out)

    monkeypatch.setattr(SwapRegions, "read_into", slow)
