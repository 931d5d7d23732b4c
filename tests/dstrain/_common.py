"""Shared pieces of the dstrain tests: a tiny model, deterministic data, a plain PyTorch reference loop,
an engine loop, and a helper that runs a function on a real multi-process gloo group."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM = 32, 8, 16


class Tiny(nn.Module):
    """Embedding, a root-level parameter, an MLP block, LayerNorm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.block = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]  # (B, T, C)
        x = x + self.block(x)  # (B, T, C)
        logits = self.head(self.ln(x))  # (B, T, V)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (size, SEQ) token batch for ``step`` on every rank and in the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = (idx * 7 + 3) % VOCAB  # learnable
    return idx, targets


def base_config(stage: int, *, world: int, micro: int = 4, gas: int = 1, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    cfg.update(extra)
    return cfg


def reference_losses(steps: int, batch: int, *, lr: float = 1e-2, clip: float = 0.0) -> list[float]:
    """A plain single-process PyTorch loop on the global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        idx, targets = global_batch(step, batch)
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def engine_losses(engine: Any, steps: int, *, start: int = 0, hook: Callable[[int, int], None] | None = None) -> list[float]:
    """Train ``steps`` optimizer steps; returns the mean loss over the global batch of each step."""
    cfg = engine.config
    world, rank = engine.comm.world_size, engine.comm.rank
    mb, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    losses = []
    for step in range(start, start + steps):
        idx, targets = global_batch(step, cfg.train_batch_size)
        total = torch.zeros(())
        for micro in range(gas):
            lo = (micro * world + rank) * mb
            loss = engine(idx[lo : lo + mb], targets[lo : lo + mb])
            if hook is not None:
                hook(step, micro)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], *args: Any, world: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` fresh processes forming a gloo group; returns each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=False, start_method="spawn"
        )
        try:
            while not ctx.join():
                pass
        except Exception:
            pass
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} died without a result")
            data = torch.load(path, weights_only=False)
            if "error" in data:
                raise RuntimeError(f"rank {rank} failed:\n{data['error']}")
            results.append(data["ok"])
        return results
