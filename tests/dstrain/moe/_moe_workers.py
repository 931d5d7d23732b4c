"""Pieces of the MoE tests: distinct-weight experts, a dense top-k reference, a wall-clock-bounded spawn of
real gloo ranks, and the scenarios those ranks run."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dstrain.moe import ExchangeMismatchError, MoE


def make_expert(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


def reference_layer(d: int, e: int, k: int, seed: int = 0, **kw: Any) -> MoE:
    """An ep_size=1 MoE whose experts all have different weights (MoE deep-copies one expert)."""
    torch.manual_seed(seed)
    layer = MoE(d, make_expert(d), num_experts=e, ep_size=1, k=k, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return layer


def copy_into(ep_layer: MoE, ref: MoE, ep_rank: int) -> None:
    """Load ``ref``'s gate and the global experts that ``ep_rank`` holds into ``ep_layer``."""
    n = ep_layer.num_local_experts
    ref_experts = ref.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        ep_layer.deepspeed_moe.gate.wg.weight.copy_(ref.deepspeed_moe.gate.wg.weight)
        for i, ex in enumerate(ep_layer.deepspeed_moe.experts.deepspeed_experts):
            ex.load_state_dict(ref_experts[ep_rank * n + i].state_dict())


def dense_topk(layer: MoE, x: torch.Tensor, k: int) -> torch.Tensor:
    """Every token through its top-k experts, no capacity (top-1: raw softmax weight; k>1 renormalised)."""
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    gates = F.softmax(x.float() @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    topv, topi = torch.topk(gates, k, dim=1)
    if k > 1:
        topv = topv / topv.sum(dim=1, keepdim=True)
    out = torch.zeros_like(x)
    for j in range(k):
        for e, ex in enumerate(experts):
            sel = topi[:, j] == e
            if sel.any():
                out[sel] += topv[sel, j : j + 1] * ex(x[sel])
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# -- scenarios run on each rank ---------------------------------------------------------------------


EP_CASES = [
    # (k, drop_tokens, capacity_factor, tokens per rank)
    (1, False, 1.0, 24),
    (2, False, 1.0, 24),
    (3, False, 1.0, 24),
    (1, True, 0.5, 24),  # tight capacity: tokens are dropped, still EP=2 == EP=1
    (2, True, 0.75, 24),
]
D, E = 8, 4


def ep_equivalence(device: str = "cpu") -> dict[str, Any]:
    """Per case: forward vs the dense reference (no drops) and EP=2 gradients vs the EP=1 layer's.

    ``device`` "cuda": everything on this rank's GPU (``cuda:rank``, the NCCL tests)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)
    out: dict[str, Any] = {}
    for k, drop, cf, s in EP_CASES:
        name = f"k{k}-{'drop' if drop else 'nodrop'}"
        kw = dict(
            capacity_factor=cf,
            min_capacity=0,
            drop_tokens=drop,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        ref = reference_layer(D, E, k, **kw).to(dev)
        torch.manual_seed(1)
        xs = [torch.randn(s, D).to(dev) for _ in range(world)]
        target = torch.randn(s, D).to(dev)
        layer = MoE(D, make_expert(D), num_experts=E, ep_size=world, k=k, **kw).to(dev)
        layer.set_expert_group(None)  # the whole world is the expert group here
        copy_into(layer, ref, rank)
        x = xs[rank].clone().requires_grad_(True)
        y, l_aux, counts = layer(x)
        loss = ((y - target) ** 2).mean() + 0.1 * l_aux
        loss.backward()
        # the EP=1 reference: every rank's tokens through the same layer, separately (routing is per rank)
        xr = [t.clone().requires_grad_(True) for t in xs]
        total = torch.zeros((), device=dev)
        for r in range(world):
            yr, la, _ = ref(xr[r])
            if r == rank:
                ref_y, ref_aux = yr.detach(), la.detach()
            total = total + ((yr - target) ** 2).mean() + 0.1 * la
        total.backward()
        n = layer.num_local_experts
        mine = [p.grad for p in layer.deepspeed_moe.experts.parameters()]
        theirs = [
            p.grad
            for i in range(n)
            for p in ref.deepspeed_moe.experts.deepspeed_experts[rank * n + i].parameters()
        ]
        gate_grad = layer.deepspeed_moe.gate.wg.weight.grad.clone()
        dist.all_reduce(gate_grad)  # the data-parallel sum of the gate's gradient
        out[name] = {
            "fwd_vs_ep1": rel_err(y.detach(), ref_y),
            "fwd_vs_dense": None if drop else rel_err(y.detach(), dense_topk(ref, xs[rank], k)),
            "l_aux": abs(l_aux.item() - ref_aux.item()),
            "expert_grad": max(rel_err(a, b) for a, b in zip(mine, theirs, strict=True)),
            "gate_grad": rel_err(gate_grad, ref.deepspeed_moe.gate.wg.weight.grad),
            "input_grad": rel_err(x.grad, xr[rank].grad),
            "dropped": layer.statistics().dropped_routes,
            "counts": counts.tolist(),
            "stats": layer.statistics(),
        }
    return out


def mismatch() -> dict[str, Any]:
    """Rank 1 routes more tokens than rank 0 with drop_tokens=True: every rank must raise, and the group
    must still work afterwards (no rank is left inside a collective)."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    layer = MoE(D, make_expert(D), num_experts=E, ep_size=2, k=2, min_capacity=0, use_rts=False)
    layer.set_expert_group(None)
    start = time.monotonic()
    try:
        layer(torch.randn(16 + 8 * rank, D))
        out["raised"] = None
    except ExchangeMismatchError as e:
        out["raised"] = {"type": type(e).__name__, "values": e.values}
    out["seconds"] = time.monotonic() - start
    # hidden size differing is also caught (layers of different width on the two ranks)
    wide = MoE(D + 8 * rank, make_expert(D + 8 * rank), num_experts=E, ep_size=2, min_capacity=0)
    wide.set_expert_group(None)
    try:
        wide(torch.randn(16, D + 8 * rank))
        out["hidden"] = None
    except ExchangeMismatchError as e:
        out["hidden"] = type(e).__name__
    # different token counts are fine without dropping: the capacity is agreed upward
    free = MoE(D, make_expert(D), num_experts=E, ep_size=2, k=2, drop_tokens=False, use_rts=False)
    free.set_expert_group(None)
    y, _, _ = free(torch.randn(16 + 8 * rank, D))
    out["nodrop_shape"] = tuple(y.shape)
    out["nodrop_capacity"] = free.statistics().capacity
    dist.barrier()
    return out


def layer_scenarios() -> dict[str, Any]:
    """Both scenarios in one pair of processes (process start dominates on a loaded 2-core machine)."""
    return {"ep": ep_equivalence(), "mismatch": mismatch()}


# -- engine scenarios (the model of fixtures/moe_model.py, shared with the DeepSpeed recorder) ----

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
import moe_model as mm  # noqa: E402


def _engine(k: int, ep: int, stage: int, clip: float = 0.0, bf16: bool = False) -> Any:
    import dstrain

    world, rank = dist.get_world_size(), dist.get_rank()
    net = mm.Net(MoE, k, ep)
    mm.init_(net, rank % ep, ep)
    config = mm.config(stage, world, clip)
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = dstrain.initialize(model=net, config=config)
    return engine


def _train(engine: Any, start: int, steps: int) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    device = next(engine.module.parameters()).device  # cuda:rank on NCCL (the engine placed the model)
    losses = []
    for step in range(start, start + steps):
        x, y = (t.to(device) for t in mm.batch(step, rank, world))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def engine_scenarios(root: str) -> dict[str, Any]:
    """DeepSpeed's scenarios plus stage 3, then a checkpoint round trip at EP=2."""
    out: dict[str, Any] = {"losses": {}, "norms": {}}
    for name, k, ep, stage, clip in mm.SCENARIOS + [("k2_ep2_s3", 2, 2, 3, 0.0)]:
        engine = _engine(k, ep, stage, clip)
        out["losses"][name] = _train(engine, 0, mm.STEPS)
        out["norms"][name] = engine.statistics().last_grad_norm
        if name == "k2_ep2_s2":
            st = engine.module.moe.statistics()
            out["routes"] = (st.routes, st.dropped_routes, st.exchange.all_to_all_calls)
            out["groups"] = [(bool(g.get("moe")), len(g["params"])) for g in engine.optimizer.param_groups]
        engine.close()
    # checkpoint round trip at EP=2, ZeRO 2: 5 steps, save, 5 steps; a fresh engine loads and redoes them
    engine = _engine(2, 2, 2)
    first = _train(engine, 0, 5)
    engine.save_checkpoint(root, tag="t5")
    out["ckpt_continued"] = first + _train(engine, 5, 5)
    engine.close()
    engine = _engine(2, 2, 2)
    engine.load_checkpoint(root, tag="t5")
    out["ckpt_resumed"] = _train(engine, 5, 5)
    out["ckpt_weights"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    # loading it with another ep_size: a typed error on every rank, nothing loaded
    engine = _engine(2, 1, 2)
    try:
        engine.load_checkpoint(root, tag="t5")
        out["other_ep"] = None
    except Exception as e:  # noqa: BLE001 - the type is the result
        out["other_ep"] = type(e).__name__
    engine.close()
    return out


# name, k, ep_size, zero stage, bf16: the curves the NCCL tests compare (fp32 ones also to DeepSpeed's)
DEVICE_SCENARIOS = [
    ("k2_ep2_s1", 2, 2, 1, False),
    ("k2_ep1_s1", 2, 1, 1, False),
    ("k2_ep2_s2", 2, 2, 2, False),
    ("k1_ep2_s0", 1, 2, 0, False),
    ("k1_ep1_s0", 1, 1, 0, False),
    ("k2_ep2_s1_bf16", 2, 2, 1, True),
    ("k2_ep1_s1_bf16", 2, 1, 1, True),
]


def engine_curves() -> dict[str, Any]:
    """`DEVICE_SCENARIOS` trained ``mm.STEPS`` steps on whatever the group's backend implies (NCCL: the
    engine puts the model on cuda:rank); per scenario the loss curve, the parameters' device and dtype
    and the all-to-all count (the exchange really ran on that backend)."""
    out: dict[str, Any] = {}
    for name, k, ep, stage, bf16 in DEVICE_SCENARIOS:
        engine = _engine(k, ep, stage, bf16=bf16)
        p = next(engine.module.moe.parameters())
        out[name] = {
            "losses": _train(engine, 0, mm.STEPS),
            "device": str(p.device),
            "dtype": str(p.dtype),
            "a2a": engine.module.moe.statistics().exchange.all_to_all_calls,
        }
        engine.close()
    return out
