"""Helpers of the offload tests: configs, and the workers run inside spawned gloo ranks (or in-process at
world size 1): optimizer offload, parameter offload (once _offload_param_helpers.py), the device-
parameterised parity run (once _offload_device_helpers.py)."""

from __future__ import annotations

import functools
import gc
import os
import signal
import sys
import time
from typing import Any

import torch
from _dstrain_helpers import base_config, engine_losses, make_model, world_rank


def kill_at(code: str, line: str, *, after: float = 0.0) -> None:
    """Run ``code`` as ``python -c`` would (OMP_NUM_THREADS=1, this environment otherwise) in a process
    forked from the fork server (tests/_forkserver.py: what is killed is the save, not a new interpreter's
    start), wait until it prints ``line``, SIGKILL it ``after`` seconds later, and check that the kill is
    what ended it."""
    import _forkserver  # here: the children import this module, with tests/ not on their path

    env = dict(os.environ, OMP_NUM_THREADS="1")
    call = functools.partial(_forkserver.code, code, [])
    child = _forkserver.popen(call, [sys.executable, "-c", code], env=env)
    try:
        got = child.stdout.readline()
        assert got.strip() == line, (
            f"the child printed {got!r}, not {line!r}; stderr:\n{child.stderr()[-3000:]}"
        )
        time.sleep(after)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.close()
    assert child.returncode == -signal.SIGKILL, f"the child ended with {child.returncode}, not the kill"


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


def train_drained(
    cfg: dict[str, Any], model: torch.nn.Module, steps: int, measure: Any = None
) -> dict[str, Any]:
    """Train ``model`` (on its device) ``steps`` optimizer steps under ``cfg``, the optimizer's reads
    ahead drained before each backward (with m, v on NVMe a sub-group steps during backward only if its
    state is in memory: this makes it so on a loaded machine too); the engine is closed after. Returns
    the losses, the final parameters, the sub-groups stepped during backward, the gradient partitions'
    devices, what ``measure(engine)`` adds, and on CUDA the GPU peak over the steps above what was
    allocated before ``initialize`` other than the model (after a collection: what earlier tests left,
    e.g. a failed test's traceback keeping its engine's tensors, goes first, and no collection between
    two runs compared moves either peak; param_host_grads[True-2] failed in the H200's whole -m gpu
    run at 2722f3b and passed alone, its reason not in the log)."""
    import dstrain

    cuda = next(model.parameters()).device.type == "cuda"
    base = 0
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        own = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values()  # (tied once)
        base = torch.cuda.memory_allocated() - sum(t.numel() * t.element_size() for t in own)
    engine, opt = dstrain.initialize(model=model, config=cfg)[:2]
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses = engine_losses(engine, steps, hook=lambda step, micro: opt.drain())
        out = {
            "losses": losses,
            "params": final_params(engine),
            "early": opt.statistics().stepped_in_backward,
            "grad_devices": {g.master_grad.device.type for g in engine.zero.groups},
            **(measure(engine) if measure is not None else {}),
        }
        if cuda:
            out["gpu_peak"] = torch.cuda.max_memory_allocated() - base
        return out
    finally:
        engine.close()


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


# -- parameter offload ----------------------------------------------------------------------------


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


# -- the device-parameterised parity run --------------------------------------------------------


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
