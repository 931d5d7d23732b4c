"""`OffloadAdam`'s checkpoint side: torch's Adam state-dict format over offloaded state.

- `swapped_state`: the state with ``exp_avg`` / ``exp_avg_sq`` as lazy sources over the swap file's
  slots (``dstrain.checkpoint.SwapRegions``), streamed by the checkpoint writer, never materialized;
- `touch_order`: what the next step changes, sub-group by sub-group (an async save reads in that
  order and lets each sub-group step once it has read that sub-group's bytes);
- `load_adam_state`: torch's format (from any offload setting, or torch's own Adam) into the
  sub-groups; tensors left in the checkpoint file are read range by range straight into place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dstrain.checkpoint.sources import Snapshot, SwapRegions, read_lazy
from dstrain.offload.swap.swapper import align_up

if TYPE_CHECKING:
    from dstrain.offload.optimizer.adam import OffloadAdam

__all__ = ["groups_state", "load_adam_state", "swapped_state", "torch_keys", "touch_order"]

_F32 = 4


def swapped_state(opt: OffloadAdam) -> dict[str, Any]:
    """`state_dict` for a checkpoint: with ``device="nvme"`` each ``exp_avg`` / ``exp_avg_sq``
    is a lazy source over its slots of the swap file (``dstrain.checkpoint.SwapRegions``), read
    piecewise by the checkpoint writer once this step's swap writes are done, never
    materialized. With the swapper's ``copy_on_write`` (the default) the sources hold a pin of
    the slots' current versions: the next steps write around them, and the saver releases the
    pin when its staging ends (``dstrain.checkpoint.sources.release_sources``). Without it, the
    slots must not change until the save has read them (the step waits: `touch_order`)."""
    if opt._swapper is None or not opt._count:
        return opt.state_dict()
    after = list(opt._stores)
    pin = opt._swapper.pin() if opt._swapper.copy_on_write else None
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    pieces: dict[int, tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]] = {}
    for sg in opt._subs:  # sub-groups of a tensor are consecutive, in element order
        m, v = pieces.setdefault(index[id(sg.param)], ([], []))
        path, offset, _ = pin.region(sg.index) if pin is not None else opt._swapper.region(sg.index)
        m.append((path, offset, sg.numel * _F32))
        v.append((path, offset + align_up(sg.numel * _F32), sg.numel * _F32))
    state: dict[int, dict[str, Any]] = {}
    for sg in opt._subs:
        i = index[id(sg.param)]
        if i not in state:
            m, v = pieces[i]
            shape = tuple(sg.param.shape)
            step = opt._steps[sg.group]
            state[i] = {
                # a stable copy beside the pinned m, v (an in-memory one would make the save's
                # window around it, mostly swapped bytes, one the next step waits for)
                "step": Snapshot(step) if pin is not None else step.clone().cpu(),
                "exp_avg": SwapRegions(m, torch.float32, shape, after=after, pin=pin),
                "exp_avg_sq": SwapRegions(v, torch.float32, shape, after=after, pin=pin),
            }
    return {"state": state, "param_groups": groups_state(opt, index)}


def touch_order(opt: OffloadAdam) -> list[list[Any]]:
    """What the next `step` changes, sub-group by sub-group in its order
    (``dsio.checkpoint.MemorySpan`` / ``FileSpan`` sets): the master range (in memory, or in the
    parameter store's file), the host m, v (``device="cpu"``) and, with ``device="nvme"`` but no
    copy-on-write, the m, v slot of the swap file (copy-on-write writes around the version a
    save reads)."""
    from dsio.checkpoint import FileSpan, MemorySpan

    out = []
    for sg in opt._subs:
        spans: list[Any] = []
        if opt._master is None:
            spans.append(MemorySpan.of(sg.param.detach().view(-1)[sg.start : sg.start + sg.numel]))
        else:  # the master range in the parameter store's swap file (stage 3, params on NVMe)
            spans.append(opt._master.master_span(sg.group, sg.master_start, sg.numel))
        if opt._swapper is not None:
            if not opt._swapper.copy_on_write:
                spans.append(FileSpan(*opt._swapper.region(sg.index)))
        elif sg.m is not None and sg.v is not None:
            spans += [MemorySpan.of(sg.m), MemorySpan.of(sg.v)]
        out.append(spans)
    return out


def groups_state(opt: OffloadAdam, index: dict[int, int]) -> list[dict[str, Any]]:
    """``param_groups`` of torch's Adam state-dict format (``index``: id(param) -> position)."""
    groups = []
    for g in opt.param_groups:
        # torch's own Adam(W) group keys too: loaded into a torch optimizer, it must keep
        # stepping with the fused kernel (a group without "fused" falls back to another loop)
        packed = {**torch_keys(opt), **{k: v for k, v in g.items() if k != "params"}}
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
    return groups


def torch_keys(opt: OffloadAdam) -> dict[str, Any]:
    return {
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": True,
        "decoupled_weight_decay": opt.adamw,
    }


def load_adam_state(opt: OffloadAdam, state_dict: dict[str, Any]) -> None:
    """Load torch's Adam format (from this optimizer or a non-offloaded one); ``exp_avg`` and
    ``exp_avg_sq`` may also be lazy sources (`load_checkpoint_state`)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, opt.param_groups, strict=True)
    ):
        raise ValueError("optimizer state has a different number of param groups or tensors")
    params = [p for g in opt.param_groups for p in g["params"]]
    saved_ids = [i for g in groups for i in g["params"]]
    by_param = {id(p): state_dict["state"].get(i) for p, i in zip(params, saved_ids, strict=True)}
    for g, saved in zip(opt.param_groups, groups, strict=True):
        for k, v in saved.items():
            if k != "params":
                g[k] = tuple(v) if k == "betas" else v
    steps: list[float | None] = [None] * len(opt.param_groups)
    if opt._swapper is not None:
        opt._cancel_ahead()
    for sg in opt._subs:
        entry = by_param[id(sg.param)]
        if entry is not None:
            steps[sg.group] = float(entry["step"])
        lease = None
        if opt._swapper is None:
            assert sg.m is not None and sg.v is not None
            vm, vv = sg.m, sg.v
        else:
            lease = opt._swapper.acquire(sg.index).result()
            lease.tensor[: 2 * align_up(sg.numel * _F32)].zero_()
            vm, vv = opt._views(lease, sg)
        for out, key in ((vm, "exp_avg"), (vv, "exp_avg_sq")):
            if entry is None:
                out.zero_()
                continue
            src = entry[key]
            if isinstance(src, torch.Tensor):
                out.copy_(src.reshape(-1)[sg.start : sg.start + sg.numel])
            else:  # left in the checkpoint file: this range, read straight into place
                read_lazy(src, sg.start * _F32, out)
        if lease is not None:
            assert opt._swapper is not None
            opt._swapper.store(lease)
    for st, s in zip(opt._steps, steps, strict=True):
        st.fill_(s or 0.0)
    opt._count = max(opt._count, 1 if any(steps) else 0)
    if opt._swapper is not None:
        opt._swapper.drain()
