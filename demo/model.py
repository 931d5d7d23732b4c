"""The demo's model and data: a small byte-level GPT trained on text that ships with Python itself.

Nothing is downloaded: the corpus is the standard library's own ``*.py`` sources (a few MB of real
text), read in a fixed order, so every run on one machine sees the same bytes. Batches are a pure
function of (step, rank): a run resumed from a checkpoint at step ``s`` sees exactly the batches an
uninterrupted run sees from step ``s`` on, which is what makes the bitwise comparison meaningful.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "GPTShape", "batch", "corpus"]

VOCAB = 256  # bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTShape:
    """The model's size. ``layers * 12 * dim**2`` is roughly its parameter count."""

    dim: int = 512
    """Width of the residual stream."""
    layers: int = 6
    """Transformer blocks."""
    heads: int = 8
    """Attention heads (must divide ``dim``)."""
    seq: int = 64
    """Tokens (bytes) per sequence."""

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTShape.{name} must be a positive int, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"GPTShape.heads ({self.heads}) must divide GPTShape.dim ({self.dim})")


class Block(nn.Module):
    """Pre-norm attention + MLP (also bench/train.py's block, in the DeepSpeed venv too: torch only)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # each (B, T, C)
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-shaped byte-level language model; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, shape.dim)
        self.wpe = nn.Embedding(shape.seq, shape.dim)
        self.blocks = nn.ModuleList(Block(shape.dim, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, VOCAB, bias=False)
        for m in self.modules():  # GPT-2 initialisation
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's Python sources, as a uint8 tensor (sorted file order)."""
    root = os.path.dirname(os.__file__)
    chunks: list[bytes] = []
    total = 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 4096:
        raise RuntimeError(
            f"the standard library at {root} has too little text for the demo ({len(text)} bytes)"
        )
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def batch(text: torch.Tensor, step: int, rank: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (size, seq) int64: random windows chosen by (step, rank) alone."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, text.numel() - seq - 1, (size,), generator=g)
    rows = torch.stack([text[s : s + seq + 1] for s in starts.tolist()]).long()  # (size, seq + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
