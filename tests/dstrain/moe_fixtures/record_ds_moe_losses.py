"""Record DeepSpeed MoE's loss curves (the reference for tests/dstrain/test_moe_engine.py).

    cd tests/dstrain/moe_fixtures && DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
        TORCH_EXTENSIONS_DIR=/work/ds-venv/torch_extensions \
        /work/ds-venv/bin/torchrun --standalone --nproc_per_node 2 record_ds_moe_losses.py ds_moe_losses.json

deepspeed 0.19.8 (torch 2.13.0 CPU, gloo, 2 ranks) trains moe_model.Net with deepspeed.moe.layer.MoE for
moe_model.STEPS steps per scenario (k, ep_size, ZeRO stage, gradient clipping), sampling off, and saves every step's loss
(averaged over the ranks) and rank 0's routing counts. Nothing here is computed by dstrain.
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

sys.path.insert(0, ".")
import moe_model as mm  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "world": world, "scenarios": {}}
for name, k, ep, stage, clip in mm.SCENARIOS:
    net = mm.Net(MoE, k, ep)
    mm.init_(net, rank % ep, ep)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "p"}
    )
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=params, config=mm.config(stage, world, clip)
    )
    losses = []
    for step in range(mm.STEPS):
        x, y = mm.batch(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    out["scenarios"][name] = {"k": k, "ep_size": ep, "stage": stage, "clip": clip, "losses": losses}
    if rank == 0:
        print(name, [f"{v:.6f}" for v in losses], flush=True)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
