"""A plain dstrain training script, started by `accelerate launch --num_processes 2` in
tests/dstrain/integrations/test_accelerate_launch.py: accelerate is only the launcher (it sets RANK, WORLD_SIZE,
MASTER_ADDR, ... as torchrun does) and dstrain.initialize creates the process group itself."""

from __future__ import annotations

import json
import os
import sys

import torch

import dstrain

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}
engine, _, _, _ = dstrain.initialize(model=model, config=config)
rank, world = engine.comm.rank, engine.comm.world_size
losses = []
for step in range(3):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4 * world, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(engine(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump(
        {"world": world, "losses": losses, "weight": engine.full_state_dict()["0.weight"].sum().item()}, f
    )
engine.close()
