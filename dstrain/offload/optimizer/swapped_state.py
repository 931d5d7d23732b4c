"""`SwappedState`: where `OffloadAdam`'s Adam state lives, and torch's state-dict format over it.

`SwappedState` is the state an `OffloadAdam` holds apart from torch's ``param_groups``: the
sub-groups (with their host m, v for ``device="cpu"``), the per-group step counters, the swapper of
the m, v slots (``device="nvme"``), the parameter store holding the master (stage 3, both on NVMe),
the read-ahead and the last step's writes. The optimizer steps it; the checkpoint side reads it
through its public members:

- `swapped_state`: the state with ``exp_avg`` / ``exp_avg_sq`` as lazy sources over the swap file's
  slots (``dstrain.checkpoint.SwapRegions``), streamed by the checkpoint writer, never materialized;
- `touch_order`: what the next step changes, sub-group by sub-group (an async save reads in that
  order and lets each sub-group step once it has read that sub-group's bytes);
- `load_adam_state`: torch's format (from any offload setting, or torch's own Adam) into the
  sub-groups; tensors left in the checkpoint file are read range by range straight into place.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from dstrain.checkpoint.sources import Snapshot, SwapRegions, read_lazy
from dstrain.offload.optimizer.state_reads import StateReads
from dstrain.offload.optimizer.sub_groups import SubGroup
from dstrain.offload.swap.swapper import Lease, Swapper, align_up

__all__ = [
    "SwappedState",
    "groups_state",
    "load_adam_state",
    "swapped_state",
    "torch_keys",
    "touch_order",
]

_F32 = 4


class SwappedState:
    """`OffloadAdam`'s Adam state: sub-groups, step counters, and where m and v live.

    ``swapper`` is None for ``device="cpu"`` (each sub-group's ``m``, ``v`` are host tensors);
    ``master`` is the parameter store that holds the fp32 master (else the masters are in memory);
    ``reads`` reads ahead of the swapped slots (None without a swapper).
    """

    def __init__(
        self,
        subs: list[SubGroup],
        steps: list[torch.Tensor],
        swapper: Swapper | None = None,
        master: Any = None,
        grads: Any = None,
    ) -> None:
        self.subs = subs
        self.steps = steps
        """Per param group: the step count the fused kernel reads (on the masters' device)."""
        self.swapper = swapper
        self.master = master
        self.reads = StateReads(swapper, master, grads) if swapper is not None else None
        self.stores: list[concurrent.futures.Future[None]] = []
        """The last step's swap (and master) writes: a checkpoint reads the slots after them."""
        self.count = 0
        """Optimizer steps taken (or loaded: at least 1 once a state with steps is loaded)."""

    @property
    def streams(self) -> bool:
        """Whether a checkpoint streams m, v from the swap file (there is one and a step has run)."""
        return self.swapper is not None and self.count > 0

    def views(self, lease: Lease, sg: SubGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """``sg``'s m and v inside its swap buffer ``lease``."""
        v_at = align_up(sg.numel * _F32)
        return lease.view(torch.float32, 0, sg.numel), lease.view(torch.float32, v_at, sg.numel)

    def cancel_ahead(self) -> None:
        """Hand back read-ahead buffers unused (before state is replaced or read another way)."""
        if self.reads is not None:
            self.reads.cancel()


def swapped_state(st: SwappedState, param_groups: list[dict[str, Any]], adamw: bool) -> dict[str, Any]:
    """`state_dict` for a checkpoint: with ``device="nvme"`` each ``exp_avg`` / ``exp_avg_sq``
    is a lazy source over its slots of the swap file (``dstrain.checkpoint.SwapRegions``), read
    piecewise by the checkpoint writer once this step's swap writes are done, never
    materialized. With the swapper's ``copy_on_write`` (the default) the sources hold a pin of
    the slots' current versions: the next steps write around them, and the saver releases the
    pin when its staging ends (``dstrain.checkpoint.sources.release_sources``). Without it, the
    slots must not change until the save has read them (the step waits: `touch_order`).
    Only for a state that `streams`."""
    assert st.swapper is not None and st.streams
    after = list(st.stores)
    pin = st.swapper.pin() if st.swapper.copy_on_write else None
    params = [p for g in param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    pieces: dict[int, tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]] = {}
    for sg in st.subs:  # sub-groups of a tensor are consecutive, in element order
        m, v = pieces.setdefault(index[id(sg.param)], ([], []))
        path, offset, _ = pin.region(sg.index) if pin is not None else st.swapper.region(sg.index)
        m.append((path, offset, sg.numel * _F32))
        v.append((path, offset + align_up(sg.numel * _F32), sg.numel * _F32))
    state: dict[int, dict[str, Any]] = {}
    for sg in st.subs:
        i = index[id(sg.param)]
        if i not in state:
            m, v = pieces[i]
            shape = tuple(sg.shape)
            step = st.steps[sg.group]
            state[i] = {
                # a stable copy beside the pinned m, v (an in-memory one would make the save's
                # window around it, mostly swapped bytes, one the next step waits for)
                "step": Snapshot(step) if pin is not None else step.clone().cpu(),
                "exp_avg": SwapRegions(m, torch.float32, shape, after=after, pin=pin),
                "exp_avg_sq": SwapRegions(v, torch.float32, shape, after=after, pin=pin),
            }
    return {"state": state, "param_groups": groups_state(param_groups, adamw, index)}


def touch_order(st: SwappedState) -> list[list[Any]]:
    """What the next `step` changes, sub-group by sub-group in its order
    (``dsio.checkpoint.MemorySpan`` / ``FileSpan`` sets): the master range (in memory, or in the
    parameter store's file), the host m, v (``device="cpu"``) and, with ``device="nvme"`` but no
    copy-on-write, the m, v slot of the swap file (copy-on-write writes around the version a
    save reads)."""
    from dsio.checkpoint import FileSpan, MemorySpan

    out = []
    for sg in st.subs:
        spans: list[Any] = []
        if st.master is None:
            spans.append(MemorySpan.of(sg.param.detach().view(-1)[sg.start : sg.start + sg.numel]))
        else:  # the master range in the parameter store's swap file (stage 3, params on NVMe)
            spans.append(st.master.master_span(sg.group, sg.master_start, sg.numel))
        if st.swapper is not None:
            if not st.swapper.copy_on_write:
                spans.append(FileSpan(*st.swapper.region(sg.index)))
        elif sg.m is not None and sg.v is not None:
            spans += [MemorySpan.of(sg.m), MemorySpan.of(sg.v)]
        out.append(spans)
    return out


def groups_state(
    param_groups: list[dict[str, Any]], adamw: bool, index: dict[int, int]
) -> list[dict[str, Any]]:
    """``param_groups`` of torch's Adam state-dict format (``index``: id(param) -> position)."""
    groups = []
    for g in param_groups:
        # torch's own Adam(W) group keys too: loaded into a torch optimizer, it must keep
        # stepping with the fused kernel (a group without "fused" falls back to another loop)
        packed = {**torch_keys(adamw), **{k: v for k, v in g.items() if k != "params"}}
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
    return groups


def torch_keys(adamw: bool) -> dict[str, Any]:
    return {
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": True,
        "decoupled_weight_decay": adamw,
    }


def load_adam_state(st: SwappedState, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Load torch's Adam format (from this optimizer or a non-offloaded one) into ``st`` and
    ``param_groups``; ``exp_avg`` and ``exp_avg_sq`` may also be lazy sources
    (`OffloadAdam.load_checkpoint_state`)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, param_groups, strict=True)
    ):
        raise ValueError("optimizer state has a different number of param groups or tensors")
    params = [p for g in param_groups for p in g["params"]]
    saved_ids = [i for g in groups for i in g["params"]]
    by_param = {id(p): state_dict["state"].get(i) for p, i in zip(params, saved_ids, strict=True)}
    for g, saved in zip(param_groups, groups, strict=True):
        for k, v in saved.items():
            if k != "params":
                g[k] = tuple(v) if k == "betas" else v
    steps: list[float | None] = [None] * len(param_groups)
    st.cancel_ahead()
    for sg in st.subs:
        entry = by_param[id(sg.param)]
        if entry is not None:
            steps[sg.group] = float(entry["step"])
        lease = None
        if st.swapper is None:
            assert sg.m is not None and sg.v is not None
            vm, vv = sg.m, sg.v
        else:
            lease = st.swapper.acquire(sg.index).result()
            lease.tensor[: 2 * align_up(sg.numel * _F32)].zero_()
            vm, vv = st.views(lease, sg)
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
            assert st.swapper is not None
            st.swapper.store(lease)
    for step, s in zip(st.steps, steps, strict=True):
        step.fill_(s or 0.0)
    st.count = max(st.count, 1 if any(steps) else 0)
    if st.swapper is not None:
        st.swapper.drain()
