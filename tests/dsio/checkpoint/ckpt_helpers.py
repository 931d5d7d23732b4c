"""Shared helpers: a realistic training state and an exact, type-strict comparison."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def make_training(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=100)
    for _ in range(steps):
        idx = torch.randint(0, 97, (2, 8))
        loss = model(idx).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def make_state(seed: int = 0, steps: int = 2) -> dict[str, Any]:
    """What a training loop really saves: model, AdamW, scheduler, RNG states, counters."""
    model, opt, sched = make_training(seed, steps)
    random.seed(seed)
    np.random.seed(seed)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        "step": steps,
        "tokens_seen": 2 * 8 * steps,
        "loss_ema": 3.25,
        "best": float("inf"),
        "extra": OrderedDict([("tags", ("a", "b")), ("none", None), ("flag", True), ("raw", b"\x00\x01")]),
        "dtype": torch.bfloat16,
    }


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Equal values of exactly the same types, recursively; tensors bit-identical."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(
            a.view(torch.uint8) if a.numel() and a.dim() else a,
            b.view(torch.uint8) if b.numel() and b.dim() else b,
        ), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# -- multi-process: real torch.distributed groups (gloo) on this machine ------------------------


def _entry(rank: int, world: int, port: int, fn: Any, args: tuple, out_dir: str, env: dict[str, str]) -> None:
    import os
    import traceback

    import torch.distributed as dist

    os.environ.clear()  # the caller's environment (a forked child has the fork server's)
    os.environ.update(env)
    torch.seed()  # a seed of its own, as a new interpreter has (a fork copies the server's RNG)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def spawn(fn: Any, *args: Any, world: int = 2) -> list[Any]:
    """Run ``fn(*args)`` in ``world`` fresh processes forming a gloo group; each rank's result.

    The ranks are forked from the session's fork server (tests/_forkserver.py: torch and dsio already
    imported, ~0.1 s per rank instead of an interpreter start), with the caller's environment."""
    import os
    import tempfile

    import _forkserver
    import torch.multiprocessing as mp
    from _ports import free_port  # tests/_ports.py: a rendezvous port no concurrent launch picks

    _forkserver.context()  # fixes the one fork server's preload list before torch starts it
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world, free_port(), fn, args, out_dir, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        try:
            while not ctx.join():
                pass
        except Exception:
            pass
        results, errors = [], []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank} died without a result")
                continue
            data = torch.load(path, weights_only=False)
            if "error" in data:
                errors.append(f"rank {rank} failed:\n{data['error']}")
            else:
                results.append(data["ok"])
        if errors:
            raise RuntimeError("\n".join(errors))
        return results


def flip_byte(path: str, pos: int, mask: int = 0x01) -> None:
    """XOR the byte at file offset ``pos`` of ``path`` with ``mask`` (a corrupted file)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))
