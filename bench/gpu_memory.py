"""Where a training step's GPU memory is at its peak: bench/offload_gpu.py's breakdown (issue 32).

Two views, both in the result JSON (``gpu_memory``):

- ``known``: bytes of what the ZeRO-3 engine holds by design, read from its own objects: the shards,
  the fp32 master and gradient partitions where they are on the GPU, and the gathered parameters at
  their peak beyond the shards (`ZeroStatistics.peak_resident_param_numel` less the shards' elements,
  at the compute dtype's size; 0 at world size 1, where a pass binds the parameters to the shards);
- ``at_peak``: torch's allocator history replayed (`peak_breakdown`): the blocks live when the
  recorded step's allocated bytes peaked, summed by the code that allocated them (the innermost frame
  in dstrain/, bench/ or the model, else torch's own), and by coarse category (``category``).

The history is recorded while ``initialize`` runs (so the shards and buffers made there carry their
allocation site) and during one extra step after the timed ones (so recording costs the timed steps
nothing); blocks allocated in between have no site ("unrecorded").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["category", "known_bytes", "memory_lines", "peak_breakdown", "site"]

UNRECORDED = "unrecorded (allocated while history was off)"

_CATEGORIES = (
    ("dstrain/offload/param/host_master", "host-master staging"),
    ("dstrain/offload/", "offload buffers"),
    ("dstrain/zero/gather", "gathered parameters"),
    ("dstrain/zero/reduce", "gradient reduce-scatter"),
    ("dstrain/zero/stage3", "gradient reduce-scatter"),
    ("dstrain/zero/buckets", "flat gradient buffers"),
    ("dstrain/zero/flat", "flat buffers"),
    ("dstrain/zero/units", "shards, gathered units, flat gradients (zero/units.py)"),
    ("dstrain/", "other dstrain"),
    ("bench/", "model activations (bench/train.py's GPT)"),
)


def site(frames: Iterable[Mapping[str, Any]] | None) -> str:
    """``file:function`` of the innermost frame in dstrain/ or bench/ (torch's snapshots list frames
    innermost first), else of the innermost Python frame, else `UNRECORDED`."""
    frames = list(frames or [])
    for fr in frames:
        name = str(fr.get("filename", ""))
        for root in ("dstrain/", "bench/"):
            at = name.rfind(root)
            if at >= 0:
                return f"{name[at:]}:{fr.get('name', '?')}"
    for fr in frames:
        name = str(fr.get("filename", ""))
        if name.endswith(".py"):
            return f"{name.rsplit('/', 2)[-2:][0]}/{name.rsplit('/', 1)[-1]}:{fr.get('name', '?')}"
    return UNRECORDED if not frames else "torch (no Python frame)"


def category(where: str) -> str:
    """The coarse category of an allocation `site`."""
    for prefix, name in _CATEGORIES:
        if where.startswith(prefix):
            return name
    if where == UNRECORDED:
        return UNRECORDED
    return "autograd and other torch (activations, gradients in flight)"


def peak_breakdown(
    snapshot: Mapping[str, Any], baseline: Mapping[str, Any], *, top: int = 15
) -> dict[str, Any]:
    """Replay the device trace of ``snapshot`` (``torch.cuda.memory._snapshot()`` after the recorded
    step) from the blocks live in ``baseline`` (the snapshot taken just before it): the allocated
    bytes at the trace's peak, by `site` (the ``top`` largest, the rest summed) and by `category`."""
    live: dict[int, tuple[int, str]] = {}
    for seg in baseline.get("segments", []):
        for b in seg.get("blocks", []):
            # (awaiting free: released by its tensor, its stream not done yet; allocated until the
            # trace's free_completed for it, which the replay then counts)
            if b.get("state") in ("active_allocated", "active_awaiting_free"):
                live[int(b["address"])] = (int(b["size"]), site(b.get("frames")))
    traces = snapshot.get("device_traces") or [[]]
    events = [e for dev in traces for e in dev]
    total = sum(size for size, _ in live.values())
    start, peak, peak_at = total, total, -1
    known = {addr: size for addr, (size, _) in live.items()}  # a free counts for a block seen live
    for i, e in enumerate(events):
        if e.get("action") == "alloc":
            known[int(e["addr"])] = int(e["size"])
            total += int(e["size"])
        elif e.get("action") == "free_completed":
            total -= known.pop(int(e["addr"]), 0)
        if total > peak:
            peak, peak_at = total, i
    # the live set at the peak: the baseline, then the events up to it
    at: dict[int, tuple[int, str]] = dict(live)
    for e in events[: peak_at + 1]:
        if e.get("action") == "alloc":
            at[int(e["addr"])] = (int(e["size"]), site(e.get("frames")))
        elif e.get("action") == "free_completed":
            at.pop(int(e["addr"]), None)
    by_site: dict[str, int] = defaultdict(int)
    for size, where in at.values():
        by_site[where] += size
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])
    sites = dict(ranked[:top])
    if len(ranked) > top:
        sites["(the rest)"] = sum(v for _, v in ranked[top:])
    by_category: dict[str, int] = defaultdict(int)
    for where, size in by_site.items():
        by_category[category(where)] += size
    return {
        "start_bytes": start,
        "peak_bytes": peak,
        "events": len(events),
        "by_site": sites,
        "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
    }


def known_bytes(engine: Any) -> dict[str, int]:
    """Bytes on the GPU of what a ZeRO-3 engine holds by design (see the module's docstring)."""
    import torch

    zero = engine.zero
    groups = zero.groups

    def on_gpu(ts: Iterable[Any]) -> int:
        return sum(
            t.untyped_storage().nbytes()
            for t in {id(t): t for t in ts if isinstance(t, torch.Tensor)}.values()
            if t.device.type == "cuda"
        )

    # (shards may be None or storage-less where a store keeps them in a file)
    master_is_shards = all(
        isinstance(g.shards, torch.Tensor) and g.master.data_ptr() == g.shards.data_ptr() for g in groups
    )
    stats = zero.statistics()
    elem = torch.empty((), dtype=zero.dtype).element_size()
    # (peak resident elements count the shards too: the gathered peak is what lay beyond them; 0 at
    # world size 1, where a pass binds the parameters to the shards themselves)
    shard_elems = sum(u.store.shard_numel(u) for u in zero.units)
    return {
        "shards": on_gpu(g.shards for g in groups),
        "fp32_master": 0 if master_is_shards else on_gpu(g.master for g in groups),
        "gradient_partitions": on_gpu(g.master_grad for g in groups) if zero.store.grads is None else 0,
        "gathered_parameters_peak": max(0, int(stats.peak_resident_param_numel) - shard_elems) * elem,
    }


def memory_lines(mem: dict[str, Any], params: int) -> list[str]:
    """A run's ``gpu_memory`` as report lines (GiB with bytes per parameter beside), each after a blank."""

    def b(n: float) -> str:
        return f"{n / 2**30:.2f} GiB ({n / params:.2f} B/param)"

    out = []
    if mem.get("known"):
        out += [
            "",
            "GPU memory held by design: "
            + ", ".join(f"{k.replace('_', ' ')} {b(v)}" for k, v in mem["known"].items())
            + ".",
        ]
    at = mem.get("at_peak")
    if at:
        out += [
            "",
            f"GPU memory at the peak of one recorded step after the timed ones ({b(at['peak_bytes'])}; "
            f"{b(at['start_bytes'])} live when it began), by category: "
            + ", ".join(f"{k} {b(v)}" for k, v in at["by_category"].items())
            + "; by allocation site: "
            + ", ".join(f"`{k}` {b(v)}" for k, v in at["by_site"].items())
            + ".",
        ]
    if mem.get("error"):
        out += ["", f"GPU memory breakdown failed: `{mem['error']}`"]
    return out
