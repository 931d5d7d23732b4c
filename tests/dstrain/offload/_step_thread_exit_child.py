"""Child of test_offload_step_thread's exit test: train with the step thread, hand it the sub-group
steps of one more boundary backward, then leave without `step()` or `close()`."""

from __future__ import annotations

import json
import sys

from _dstrain_helpers import engine_losses, global_batch, make_model
from _offload_helpers import offload_config

import dstrain
import dstrain.offload.compose as compose
from dstrain.offload.param.host_master import HostMasterShards

root = sys.argv[1]
cfg = offload_config(3, "cpu", root, sub_group=1024, bf16=False)
cfg["zero_optimization"]["offload_optimizer"]["step_thread"] = True
compose.build_param_store = lambda *a, **k: HostMasterShards(separate=True, pin_memory=False)
engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
engine_losses(engine, 2)
before = opt.statistics().stepped_on_thread
idx, targets = global_batch(2, engine.config.train_batch_size)
mb = engine.config.train_micro_batch_size_per_gpu
print("# backward", file=sys.stderr, flush=True)
engine.backward(engine(idx[:mb], targets[:mb]))  # its sub-group steps go to the thread
print(json.dumps({"name": "handed", "before": before}), flush=True)
# no engine.step(), no engine.close(): the interpreter exits with the thread's jobs handed over
