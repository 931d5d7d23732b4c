"""1-bit Adam and 0/1 Adam side by side with DeepSpeed 0.16.5's OnebitAdam / ZeroOneAdam: per-step
losses of one small training run.

Run under torchrun with 2 ranks, once per implementation, and compare the JSON they print:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 ONEBIT_SRC=<the 0.16.5 files, below> \\
        <a DeepSpeed venv>/bin/torchrun --standalone --nproc_per_node 2 bench/onebit_anchor.py deepspeed 40 10
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/onebit_anchor.py dstrain 40 10

A fourth argument ``lamb`` runs 1-bit LAMB (DeepSpeed's ``runtime/fp16/onebit/lamb.py``, unmodified, same
shims; ``tests/dstrain/fixtures/onebit_lamb_deepspeed_0.16.5.json`` is ``... deepspeed 40 10 lamb``; put
``deepspeed-0.16.5/deepspeed/runtime/fp16/onebit/lamb.py`` from the same source distribution into ONEBIT_SRC
next to the other two).
A fourth argument ``zeroone`` runs 0/1 Adam instead (DeepSpeed's ``runtime/fp16/onebit/zoadam.py``,
unmodified, with the same shims); the third argument is then ``var_freeze_step``, and the scalers are
small enough that 40 steps see every schedule: ``var_update_scaler=4`` (the variance interval doubles
1 -> 2 -> 4), ``local_step_scaler=4`` and ``local_step_clipper=4`` (local intervals 1 -> 2 -> 4):

    ... bench/onebit_anchor.py deepspeed 40 20 zeroone     (tests/dstrain/fixtures/onebit_zeroone_deepspeed_0.16.5.json)

ONEBIT_SRC holds DeepSpeed 0.16.5's ``runtime/fp16/onebit/adam.py`` (``lamb.py``, ``zoadam.py``) and ``runtime/comm/compressed.py``
from its source distribution (deepspeed-0.16.5.tar.gz; DeepSpeed removed them after 0.16.5),
loaded unmodified, with the anchor's two shims: a CPU ``PackbitsBuilder`` (numpy packbits) and an
all-gather that gives gloo the receive buffers' shape. Both runs: the same model (seed 0), the same
per-rank data, lr 1e-2, gradients averaged by an all-reduce while the optimizer asks for it (what
DeepSpeed's engine does until ``freeze_step``). dstrain runs with ``deepspeed_compat=True, fused=False``
(DeepSpeed's first-step and bias-correction behaviour, per-tensor compression).

``tests/dstrain/fixtures/onebit_deepspeed_0.16.5.json`` was produced by the first command.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

ZEROONE = {"var_update_scaler": 4, "local_step_scaler": 4, "local_step_clipper": 4}
"""0/1 Adam's schedule parameters in the anchor run (besides ``var_freeze_step``)."""


def _deepspeed_optimizer(params, freeze: int, kind: str = "onebit"):
    import deepspeed
    import deepspeed.ops.op_builder as ob

    class _Packer:
        @staticmethod
        def packbits(t, numel, rank):
            return torch.from_numpy(np.packbits((~torch.signbit(t.reshape(-1)[:numel])).numpy()))

        @staticmethod
        def unpackbits(buf, numel, rank):
            return torch.from_numpy(np.unpackbits(buf.reshape(-1)[:numel].numpy())).float().mul_(2).sub_(1)

    class PackbitsBuilder:
        def load(self):
            return _Packer()

    ob.PackbitsBuilder = PackbitsBuilder
    src = os.environ["ONEBIT_SRC"]

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    import deepspeed.comm as dscomm

    compressed = load("deepspeed.runtime.comm.compressed", os.path.join(src, "compressed.py"))

    class _GlooShapes:
        def __getattr__(self, name):
            return getattr(dscomm, name)

        def all_gather(self, tensor_list, tensor, group=None, async_op=False):
            return dscomm.all_gather(
                tensor_list, tensor.reshape(tensor_list[0].shape), group=group, async_op=async_op
            )

    compressed.dist = _GlooShapes()
    onebit = load("deepspeed_onebit_adam_0165", os.path.join(src, "adam.py"))
    deepspeed.init_distributed(dist_backend="gloo")

    class Engine:
        mpu, local_rank = None, 0
        enable_backward_allreduce = True

    eng = Engine()
    if kind == "lamb":
        lamb = load("deepspeed_onebit_lamb_0165", os.path.join(src, "lamb.py"))
        opt = lamb.OnebitLamb(
            params, deepspeed=eng, lr=1e-2, freeze_step=freeze, comm_backend_name="compressed"
        )
    elif kind == "zeroone":
        zoadam = load("deepspeed_zoadam_0165", os.path.join(src, "zoadam.py"))
        opt = zoadam.ZeroOneAdam(
            params, deepspeed=eng, lr=1e-2, var_freeze_step=freeze, comm_backend_name="compressed", **ZEROONE
        )
    else:
        opt = onebit.OnebitAdam(
            params, deepspeed=eng, lr=1e-2, freeze_step=freeze, comm_backend_name="compressed"
        )
    return opt, lambda: eng.enable_backward_allreduce


def _dstrain_optimizer(params, freeze: int, kind: str = "onebit"):
    from dstrain.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

    dist.init_process_group("gloo")
    if kind == "lamb":
        opt = OneBitLamb(params, lr=1e-2, freeze_step=freeze)
    elif kind == "zeroone":
        opt = ZeroOneAdam(
            params, lr=1e-2, var_freeze_step=freeze, deepspeed_compat=True, fused=False, **ZEROONE
        )
    else:
        opt = OneBitAdam(params, lr=1e-2, freeze_step=freeze, deepspeed_compat=True, fused=False)
    return opt, opt.reduces_gradients


def main() -> None:
    impl, steps, freeze = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "onebit"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    build = _deepspeed_optimizer if impl == "deepspeed" else _dstrain_optimizer
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        opt, reduce_grads = build(model.parameters(), freeze, kind)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))
    losses, reduced = [], []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        loss = (model(x) - x @ w).pow(2).mean()
        loss.backward()
        reduced.append(bool(reduce_grads()))
        if reduced[-1]:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.mul_(1 / world)
        with contextlib.redirect_stdout(io.StringIO()):
            opt.step()
        opt.zero_grad()
        l_ = loss.detach().clone()
        dist.all_reduce(l_)
        losses.append(l_.item() / world)
    if rank == 0:
        out = {"impl": impl, "steps": steps, "freeze_step": freeze, "losses": losses}
        if kind == "zeroone":
            out.update(optimizer="ZeroOneAdam", var_freeze_step=freeze, **ZEROONE, reduced=reduced)
        if kind == "lamb":
            out.update(optimizer="OneBitLamb", reduced=reduced, lamb_coeffs=opt.get_lamb_coeffs())
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
