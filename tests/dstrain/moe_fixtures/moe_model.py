"""The MoE model both sides of the loss-curve comparison train (imports only torch: DeepSpeed's venv loads
it by path with DeepSpeed's MoE class, dstrain's tests with dstrain's). Identical initialisation on both
sides: every parameter is drawn from its own seeded generator, keyed by its name and, for experts, by the
*global* expert id, so the same weights result whatever the ep_size."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D, E, TOKENS, STEPS, AUX = 16, 4, 32, 10, 0.01
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."

# name, k, ep_size, zero stage, gradient_clipping (DeepSpeed clips at 1.0 unless told: always explicit)
SCENARIOS = [
    ("k1_ep2_s0", 1, 2, 0, 0.0),
    ("k2_ep2_s0", 2, 2, 0, 0.0),
    ("k2_ep1_s0", 2, 1, 0, 0.0),
    ("k2_ep2_s2", 2, 2, 2, 0.0),
    ("k2_ep1_s1", 2, 1, 1, 0.0),
    ("k2_ep2_s0_clip", 2, 2, 0, 0.05),
    ("k2_ep2_s1_clip", 2, 2, 1, 0.05),
    ("k2_ep1_s1_clip", 2, 1, 1, 0.05),
]


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


class Net(nn.Module):
    def __init__(self, moe_cls: Any, k: int, ep_size: int) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = moe_cls(
            D,
            expert(),
            num_experts=E,
            ep_size=ep_size,
            k=k,
            capacity_factor=1.0,
            min_capacity=0,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (T, D)
        m, l_aux, _ = self.moe(h)
        return F.mse_loss(self.out(h + m), y) + AUX * l_aux


def init_(net: Net, ep_rank: int, ep_size: int) -> None:
    """Deterministic weights by global name (local expert i on ep_rank r is global expert r * E/ep + i)."""
    n_local = E // ep_size
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith(PREFIX):
                local, rest = name[len(PREFIX) :].split(".", 1)
                name = f"{PREFIX}{ep_rank * n_local + int(local)}.{rest}"
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(world, TOKENS, D, generator=g), torch.randn(world, TOKENS, D, generator=g)
    return x[rank], y[rank]


def config(stage: int, world: int, clip: float = 0.0) -> dict[str, Any]:
    return {
        "gradient_clipping": clip,
        "train_micro_batch_size_per_gpu": TOKENS,
        "gradient_accumulation_steps": 1,
        "train_batch_size": TOKENS * world,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
