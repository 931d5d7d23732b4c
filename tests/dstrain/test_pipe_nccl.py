"""The pipeline on NCCL with one GPU per stage (run on a 2-GPU machine; skipped without two CUDA devices).

A small GPT (token + position embedding, pre-LN transformer blocks, LayerNorm, a head) split over 2 stages:

- fp32: PP=2 equals single-GPU gradient accumulation over the same micro-batches (losses and weights within
  1e-6: the same kernels on the same shapes, but each stage's GPU runs them in its own process, and cuBLAS /
  the fused attention may pick other algorithms for the reference's whole-model run; bitwise is recorded).
- bf16: it trains (loss falls every step), tracks the fp32 curve within 2%, both stages report the same loss.

Needs the pipeline's p2p to run over NCCL worlds (tagged CPU headers: a gloo group of the pipeline's ranks,
payloads staged through host memory, the batch status reduced on the GPU); without that every rank fails at
the first ``irecv`` with "No backend type associated with device type cpu".
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _moe_workers import spawn_bounded
from torch import nn

from dstrain.pipe.module import LayerSpec, PipelineModule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group"),
]

VOCAB, SEQ, DIM, HEADS, LAYERS, MB, GAS, STEPS = 64, 16, 64, 4, 4, 4, 4, 6


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN causal self-attention + MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        )  # (B, H, T, D)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(c // HEADS)
        att = att.masked_fill(torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # (B, T, V)


def layers() -> list[Any]:
    return [LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(LAYERS)] + [LayerSpec(Head)]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def data(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        idx = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        out.append((idx.to(device), ((idx * 5 + 1) % VOCAB).to(device)))
    return out


def config(bf16: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "steps_per_print": 10**6,
        "pipeline": {"p2p_timeout": 60},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference(batches: list[Any], device: torch.device) -> dict[str, Any]:
    """The whole model on one GPU: gradient accumulation over the same micro-batches, same SGD."""
    model = PipelineModule(layers(), num_stages=1, loss_fn=lm_loss, seed_layers=True, stage_id=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for m in range(GAS):
            x, y = batches[s * GAS + m]
            loss = lm_loss(model(x), y)
            (loss.float() * (1.0 / GAS)).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(float(torch.tensor(total / GAS, dtype=torch.float32)))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train(bf16: bool) -> dict[str, Any]:
    import dstrain

    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    module = PipelineModule(
        layers(), num_stages=2, loss_fn=lm_loss, partition_method="uniform", seed_layers=True
    )
    engine, _, _, _ = dstrain.initialize(model=module, config=config(bf16))
    batches = data(GAS * STEPS, device)
    it = iter(batches)
    losses = [float(engine.train_batch(it).float().item()) for _ in range(STEPS)]
    out: dict[str, Any] = {
        "losses": losses,
        "device": str(next(module.parameters()).device),
        "dtype": str(next(module.parameters()).dtype),
    }
    if not bf16:
        ref = reference(batches, device)
        state = module.state_dict()
        out["ref_losses"] = ref["losses"]
        out["max_param_diff"] = max((state[k].float() - ref["state"][k]).abs().max().item() for k in state)
        out["bitwise"] = all(torch.equal(state[k], ref["state"][k]) for k in state)
    engine.close()
    return out


def _run() -> dict[str, Any]:
    return {"fp32": _train(False), "bf16": _train(True)}


@pytest.fixture(scope="module")
def nccl() -> list[dict[str, Any]]:
    return spawn_bounded(_run, timeout=300, backend="nccl")


def test_nccl_pp2_equals_single_gpu_gradient_accumulation(nccl: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(nccl):
        res = r["fp32"]
        assert res["device"] == f"cuda:{rank}"
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-6, abs=1e-6), res
        assert res["max_param_diff"] <= 1e-6, res
    assert nccl[0]["fp32"]["losses"] == nccl[1]["fp32"]["losses"]  # both stages report the same loss


def test_nccl_pp2_bf16_trains_and_stages_agree(nccl: list[dict[str, Any]]) -> None:
    a, b = nccl[0]["bf16"], nccl[1]["bf16"]
    assert a["losses"] == b["losses"]
    assert a["dtype"] == "torch.bfloat16" and b["device"] == "cuda:1"
    assert all(y < x for x, y in zip(a["losses"], a["losses"][1:])), a["losses"]  # falls every step
    assert a["losses"][-1] < 0.95 * a["losses"][0], a["losses"]
    fp32 = nccl[0]["fp32"]["losses"]
    assert max(abs(x - y) for x, y in zip(a["losses"], fp32, strict=True)) <= 0.02 * fp32[0]  # bf16 rounding
