"""Workers for the reshape tests: save at one (world, stage, offload), load at another; run inside
fork-server gloo ranks (or in-process at world size 1)."""

from __future__ import annotations

import os
from typing import Any

import torch
from _dstrain_helpers import base_config, engine_losses, make_model, world_rank

GLOBAL_BATCH = 4
BEFORE, AFTER = 4, 4
"""Steps trained before the save, and after it (by the uninterrupted run and by each resumed one)."""


def shape_config(stage: int, offload: str, nvme_root: str, **extra: Any) -> dict[str, Any]:
    """The tiny model at ``stage`` with optimizer state on ``offload`` (none, cpu, nvme), the same global
    batch at every world size."""
    world, _ = world_rank()
    cfg = base_config(stage, world=world, micro=GLOBAL_BATCH // world, **extra)
    z = cfg["zero_optimization"]
    if offload != "none":
        z["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            os.makedirs(nvme_root, exist_ok=True)
            z["offload_optimizer"].update(nvme_path=nvme_root, buffer_count=2)
    return cfg


def save_run(ckpt: str, stage: int, offload: str, nvme_root: str, **extra: Any) -> dict[str, Any]:
    """Train BEFORE steps, save into ``ckpt``, train AFTER more: all the losses."""
    import dstrain

    engine, _, _, _ = dstrain.initialize(
        model=make_model(), config=shape_config(stage, offload, nvme_root, **extra)
    )
    losses = engine_losses(engine, BEFORE)
    engine.save_checkpoint(ckpt, client_state={"data_position": BEFORE * GLOBAL_BATCH})
    losses += engine_losses(engine, AFTER, start=BEFORE)
    engine.close()
    return {"losses": losses}


def resume_run(ckpt: str, stage: int, offload: str, nvme_root: str, **extra: Any) -> dict[str, Any]:
    """A differently initialised model loads ``ckpt`` and trains AFTER steps; also the bytes this rank
    read from the checkpoint's stored tensors (dsio byte-range reads) and what the state totals."""
    import dstrain
    from dsio.checkpoint import StoredTensor

    read = [0]
    original = StoredTensor.read_into

    async def counting(self: StoredTensor, io: Any, offset: int, out: torch.Tensor) -> None:
        read[0] += out.numel()
        await original(self, io, offset, out)

    engine, _, _, _ = dstrain.initialize(
        model=make_model(seed=77), config=shape_config(stage, offload, nvme_root, **extra)
    )
    StoredTensor.read_into = counting  # type: ignore[method-assign]
    try:
        _, client = engine.load_checkpoint(ckpt)
    finally:
        StoredTensor.read_into = original  # type: ignore[method-assign]
    out = {
        "global_steps": engine.global_steps,
        "client": client,
        "lr": engine.get_lr(),
        "bytes_read": read[0],
        "losses": engine_losses(engine, AFTER, start=BEFORE),
    }
    engine.close()
    return out


def save_many(root: str, scenarios: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """`save_run` for each ``name: (stage, offload)`` into ``root/name``."""
    return {
        n: save_run(os.path.join(root, n), s, o, os.path.join(root, "nvme", n))
        for n, (s, o) in scenarios.items()
    }


def resume_many(root: str, scenarios: list[tuple[str, int, str]]) -> dict[str, Any]:
    """`resume_run` of checkpoint ``root/saved`` at each ``(saved, stage, offload)``."""
    world, _ = world_rank()
    return {
        f"{saved}->w{world}s{stage}{offload}": resume_run(
            os.path.join(root, saved),
            stage,
            offload,
            os.path.join(root, "nvme-resume", f"{saved}{stage}{offload}"),
        )
        for saved, stage, offload in scenarios
    }


class Untied(torch.nn.Module):
    """A small model without tied weights (loads with ``load_state_dict(strict=True)``), with a buffer."""

    def __init__(self, dim: int = 16, vocab: int = 32, depth: int = 1) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(self.ln(x)) * self.scale[1]  # (B, T, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )


def make_untied(seed: int = 0, **kw: Any) -> Untied:
    torch.manual_seed(seed)
    return Untied(**kw)


def train_and_save(ckpt: str, stage: int, steps: int = 3, tied: bool = False, **model: Any) -> dict[str, Any]:
    """Train ``steps`` steps of the untied (or the tied Tiny) model, save; the whole weights (gathered)."""
    import dstrain

    net = make_model() if tied else make_untied(**model)
    world, _ = world_rank()
    engine, _, _, _ = dstrain.initialize(
        model=net, config=base_config(stage, world=world, micro=GLOBAL_BATCH // world)
    )
    engine_losses(engine, steps)
    engine.save_checkpoint(ckpt)
    full = engine.full_state_dict()
    engine.close()
    return {"state": full}


def online_export(out: str, stage: int, gather: bool, bf16: bool = False) -> dict[str, Any]:
    """Train the untied model 2 steps, `save_16bit_model` into ``out``; what it returned, the weights."""
    import dstrain

    world, _ = world_rank()
    cfg = base_config(stage, world=world, micro=GLOBAL_BATCH // world)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = dstrain.initialize(model=make_untied(), config=cfg)
    engine_losses(engine, 2)
    saved = engine.save_16bit_model(out)
    full = engine.full_state_dict()
    flag = engine.zero_gather_16bit_weights_on_model_save()
    engine.close()
    return {"saved": saved, "state": full, "flag": flag}


def online_exports(root: str, stage: int) -> dict[str, Any]:
    """`online_export` with the gather flag on (into ``root/on``), then off (``root/off``), in the same
    ranks (one group start for both; each builds its own engine)."""
    return {flag: online_export(os.path.join(root, flag), stage, flag == "on") for flag in ("on", "off")}


def node_local_run(root: str, node_local: bool, phase: str) -> dict[str, Any]:
    """Two 'hosts': each rank checkpoints into ``root/host<rank>``. ``phase`` "save": train 4 steps,
    save at 2 and 4 (a failing save between: rank 1 cannot store its client state), train 2 more;
    "load": a fresh model loads the latest and trains 2 steps. Errors come back as (type, message, step, rank)."""
    import dstrain

    world, rank = world_rank()
    cfg = base_config(
        1, world=world, micro=GLOBAL_BATCH // world, checkpoint={"use_node_local_storage": node_local}
    )
    d = os.path.join(root, f"host{rank}")
    engine, _, _, _ = dstrain.initialize(model=make_model(seed=0 if phase == "save" else 8), config=cfg)
    out: dict[str, Any] = {}
    try:
        if phase == "save":
            losses = engine_losses(engine, 2)
            engine.save_checkpoint(d, client_state={"at": 2})
            losses += engine_losses(engine, 2, start=2)
            bad = {"at": 4, "x": (i for i in range(1))} if rank == 1 else {"at": 4}
            try:
                engine.save_checkpoint(d, client_state=bad)
            except Exception as e:
                out["failed_save"] = type(e).__name__
            out["after_failed"] = sorted(os.listdir(d))
            engine.save_checkpoint(d, client_state={"at": 4})
            out["losses"] = losses + engine_losses(engine, 2, start=4)
        else:
            _, client = engine.load_checkpoint(d)
            out["client"] = client
            out["losses"] = engine_losses(engine, 2, start=engine.global_steps)
    except dstrain.DstrainError as e:
        out["error"] = (type(e).__name__, str(e), getattr(e, "step", None), getattr(e, "rank", None))
    finally:
        engine.close()
    return out


def damaged_load(ckpt: str, stage: int) -> dict[str, Any]:
    """A fresh engine at ``stage`` loads the damaged ``ckpt``: the error's type, and whether anything of
    this rank's state (counters, parameters, Adam's state) changed meanwhile."""
    import dstrain

    world, _ = world_rank()
    engine, _, _, _ = dstrain.initialize(
        model=make_model(seed=9), config=base_config(stage, world=world, micro=GLOBAL_BATCH // world)
    )
    engine_losses(engine, 1)  # an Adam state of its own to keep
    params = [p.detach().clone() for p in engine.module.parameters()]
    opt = repr(engine.stepper.state_dict())
    out: dict[str, Any] = {"error": None}
    try:
        engine.load_checkpoint(ckpt)
    except Exception as e:  # the test checks the type
        out["error"] = type(e).__name__
    out["global_steps"] = engine.global_steps
    out["params_unchanged"] = all(
        torch.equal(a, p) for a, p in zip(params, engine.module.parameters(), strict=True)
    )
    out["optimizer_unchanged"] = repr(engine.stepper.state_dict()) == opt
    engine.close()
    return out
