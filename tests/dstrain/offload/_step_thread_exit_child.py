"""Child of test_offload_step_thread's exit tests: train with the step thread, hand it the sub-group
steps of one more boundary backward, then leave without `step()` or `close()`.

``root``: scratch folder; a second argument ``paramopt``: parameters and optimizer state on NVMe (the
master and the gradients in swap files, whose buffers the thread's steps hold), each step on the thread
slowed down so that some are still queued or running when the interpreter exits."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch
from _dstrain_helpers import engine_losses, global_batch, make_model
from _offload_helpers import offload_config

import dstrain
import dstrain.offload.compose as compose
from dstrain.offload.param.host_master import HostMasterShards

root = sys.argv[1]
paramopt = sys.argv[2:] == ["paramopt"]
if paramopt:
    from test_offload_step_thread import _paramopt_config, _paramopt_engine, _paramopt_steps

    cfg = _paramopt_config(root, bf16=False, budget=2 << 20, thread=True)
    # (reads not made complete when asked: that would wait for the thread's buffers during backward)
    engine, opt = _paramopt_engine(cfg, complete_reads=False)
    _paramopt_steps(engine, opt, 2)
else:
    cfg = offload_config(3, "cpu", root, sub_group=1024, bf16=False)
    cfg["zero_optimization"]["offload_optimizer"]["step_thread"] = True
    compose.build_param_store = lambda *a, **k: HostMasterShards(separate=True, pin_memory=False)
    engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    engine_losses(engine, 2)
before = opt.statistics().stepped_on_thread
started = [0]
if paramopt:  # the steps on the thread take a while: the interpreter exits with some in flight
    real = torch._fused_adamw_

    def slow(*args: object, **kwargs: object) -> object:
        if threading.current_thread().name == "dstrain-offload-step":
            started[0] += 1
            time.sleep(1.0)
        return real(*args, **kwargs)

    torch._fused_adamw_ = slow
print("# backward", file=sys.stderr, flush=True)
if paramopt:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 256, generator=g), torch.randn(2, 256, generator=g).tanh()
    for _ in range(5):  # until the interpreter exits with a step on the thread (the first time, mostly)
        opt.drain()
        engine.backward(engine(x, y))  # its sub-group steps go to the thread
        # the thread may not have reached a step's kernel yet when backward returns (a loaded
        # machine: the root fresh-clone run of 2026-12-02 01:30 left 5 passes with none in flight):
        # give it up to 3 s to start one (each then takes 1 s)
        deadline = time.monotonic() + 3.0
        while started[0] <= opt.statistics().stepped_on_thread - before and time.monotonic() < deadline:
            time.sleep(0.005)
        if started[0] > opt.statistics().stepped_on_thread - before:
            break
        engine.step()
else:
    idx, targets = global_batch(2, engine.config.train_batch_size)
    mb = engine.config.train_micro_batch_size_per_gpu
    engine.backward(engine(idx[:mb], targets[:mb]))  # its sub-group steps go to the thread
done = opt.statistics().stepped_on_thread - before
out = {"name": "handed", "before": before, "in_flight": started[0] - done, "t": time.time()}
print(json.dumps(out), flush=True)
# no engine.step(), no engine.close(): the interpreter exits with the thread's jobs handed over
