"""One (shape, method) run of the offload benchmark inside a torchrun rank (see bench/offload.py).

Launched by ``bench/offload.py`` as ``torchrun ... bench/offload_worker.py --shape S --method M ...``
with dstrain's interpreter or DeepSpeed's. Builds the shape's model (the anchors' MLP, or the GPT of
bench/train.py, imported from there), the same DeepSpeed-style config for both libraries, trains
``--steps`` steps on the same per-rank data and prints one ``RESULT <json>`` line on rank 0 with every
rank's numbers: step times, peak RSS after two warm-up steps, per-step loss, the storage bytes the rank
process moved (/proc/self/io) and, for dstrain, the offload counters (swap bytes by kind, stall,
prefetch hits, in total and by kind: the gathers' shard reads, the optimizer's sub-group reads) read
from its ``statistics()`` snapshots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import reset_peak, rss  # noqa: E402
from bench.offload_methods import METHODS, SHAPES, Method, Shape  # noqa: E402

WARMUP = 2
"""Steps before the timed ones: the first allocates optimizer state, the second primes read-ahead."""


def _proc_io() -> dict[str, int]:
    """Bytes this process (all its threads) made the storage layer read and write (/proc/self/io)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


# -- dstrain's offload counters, wherever the snapshots keep them -------------------------------


def _walk(obj: Any, swappers: dict[str, Any], steppers: dict[tuple[Any, ...], Any], depth: int = 0) -> None:
    """Collect swapper snapshots (by swap file) and read-ahead counters (by value) from a snapshot tree."""
    if depth > 6 or obj is None:
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = {f.name for f in dataclasses.fields(obj)}
        if {"read_bytes", "written_bytes", "kind", "path"} <= names:
            swappers[str(obj.path)] = obj
        if {"stall_seconds", "prefetch_hits", "prefetch_misses"} <= names:
            key = (type(obj).__name__,) + tuple(
                getattr(obj, n) for n in sorted(names) if isinstance(getattr(obj, n), int | float | str)
            )
            steppers[key] = obj
        for name in names:
            _walk(getattr(obj, name), swappers, steppers, depth + 1)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _walk(x, swappers, steppers, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _walk(x, swappers, steppers, depth + 1)


def offload_counters(*sources: Any) -> dict[str, float] | None:
    """Summed offload counters of every ``statistics()`` snapshot reachable from ``sources``.

    Swap bytes by kind (``param_read_bytes``, ``optimizer_written_bytes``, ...), stall seconds,
    prefetch hits and misses, pinned bytes. None when no source has offload counters (DeepSpeed, or
    dstrain without offload)."""
    swappers: dict[str, Any] = {}
    steppers: dict[tuple[Any, ...], Any] = {}
    for src in sources:
        st = getattr(src, "statistics", None)
        if st is None:
            continue
        try:
            snap = st()
        except Exception:  # a part without counters at this moment is not an error of the bench
            continue
        _walk(snap, swappers, steppers)
    if not swappers and not steppers:
        return None
    out: dict[str, float] = {"stall_s": 0.0, "hits": 0, "misses": 0, "pinned_bytes": 0}
    for sw in swappers.values():
        kind = str(sw.kind) if str(sw.kind) in ("param", "grad", "master") else "optimizer"
        out[f"{kind}_read_bytes"] = out.get(f"{kind}_read_bytes", 0) + sw.read_bytes
        out[f"{kind}_written_bytes"] = out.get(f"{kind}_written_bytes", 0) + sw.written_bytes
        out["pinned_bytes"] += getattr(sw, "pinned_bytes", 0)
    for s in steppers.values():
        out["stall_s"] += float(s.stall_seconds)
        out["hits"] += int(s.prefetch_hits)
        out["misses"] += int(s.prefetch_misses)
        # and by kind: a gather's shard read and a sub-group's state read are different things to count
        kind = _stepper_kind(s)
        out[f"stall_s_{kind}"] = out.get(f"stall_s_{kind}", 0.0) + float(s.stall_seconds)
        out[f"hits_{kind}"] = out.get(f"hits_{kind}", 0) + int(s.prefetch_hits)
        out[f"misses_{kind}"] = out.get(f"misses_{kind}", 0) + int(s.prefetch_misses)
        if kind == "param" and s.holds_master:  # master ranges assembled from the gathers' shards
            out["master_from_gathers_bytes"] = out.get("master_from_gathers_bytes", 0) + int(
                s.master_from_gathers_bytes
            )
            # and the pass's first shard, copied from the master ranges the step stored
            out["gather_from_step_bytes"] = out.get("gather_from_step_bytes", 0) + int(
                s.gathers_from_step_bytes
            )
            # and the backward gathers served by the buffers their unit's forward gather kept
            out["gather_reused_bytes"] = out.get("gather_reused_bytes", 0) + int(s.gathers_reused_bytes)
        if hasattr(s, "stepped_in_backward"):  # sub-groups stepped during backward (early_step)
            out["in_backward"] = out.get("in_backward", 0) + int(s.stepped_in_backward)
    return out


def _stepper_kind(snap: Any) -> str:
    """Which reads a snapshot's prefetch counters count: ``optimizer`` (sub-group state, with the
    master and gradient ranges it steps), ``param`` (the gathers' shard reads), ``grad`` (gradient
    ranges), else ``other``. Told apart by their fields, as the walk finds them."""
    names = {f.name for f in dataclasses.fields(snap)}
    if "stepped_in_backward" in names:
        return "optimizer"
    if "holds_master" in names:
        return "param"
    if "accumulations" in names:
        return "grad"
    return "other"


def _delta(a: dict[str, float] | None, b: dict[str, float] | None, k: int) -> dict[str, float]:
    if a is None or b is None:
        return {}
    per_step = {
        key: (b.get(key, 0) - a.get(key, 0)) / k
        for key in b
        if key.endswith("_bytes") and key != "pinned_bytes"
    }
    by_kind = {key: b[key] - a.get(key, 0) for key in b if key.startswith(("hits_", "misses_"))}
    stall_by_kind = {
        f"{key}_per_step": (b[key] - a.get(key, 0.0)) / k for key in b if key.startswith("stall_s_")
    }
    return {
        **{f"{key}_per_step": v for key, v in per_step.items()},
        **by_kind,
        **stall_by_kind,
        "stall_s_per_step": (b["stall_s"] - a["stall_s"]) / k,
        "hits": b["hits"] - a["hits"],
        "misses": b["misses"] - a["misses"],
        "stepped_in_backward": b.get("in_backward", 0) - a.get("in_backward", 0),
        "pinned_bytes": b["pinned_bytes"],
    }


# -- the run ------------------------------------------------------------------------------------


def ds_config(shape: Shape, method: Method, nvme_dir: str, pinned: int) -> dict[str, Any]:
    """The DeepSpeed-style config both libraries get (dstrain adds its pinned-budget key)."""
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": shape.sub_group}
    if method.optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif method.optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 4}
    if method.impl == "dstrain" and not method.step_in_backward:
        zero["offload_optimizer"]["step_in_backward"] = False
    if method.impl == "dstrain" and not method.step_thread:
        zero["offload_optimizer"]["step_thread"] = False
    if method.param == "cpu":
        zero["offload_param"] = {"device": "cpu"}
    elif method.param == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 5}
    if method.impl == "dstrain" and method.swaps:
        zero["offload_pinned_bytes"] = pinned
    cfg: dict[str, Any] = {
        "train_batch_size": 2 * shape.micro_batch,
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "steps_per_print": 10**9,
        # written out: DeepSpeed clips at 1.0 when the key is absent, dstrain does not clip (0.0); without it
        # DeepSpeed's GPT losses parted from dstrain's at the second step (train-deepspeed-divergence-2026-11-30)
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
            "intra_op_parallelism": 1,
        },
    }
    if method.impl == "deepspeed" and method.optimizer == "none":
        cfg["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW, as dstrain steps without offload
    return cfg


def _drain(optimizer: Any) -> None:
    """Let dstrain's optimizer swap I/O in flight finish (outside the timed steps), so the swap
    counters between two such points count exactly the steps between them: the transfers are
    counted when they complete, and stepping during backward moves when they complete."""
    drain = getattr(optimizer, "drain", None)
    if callable(drain):
        drain()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape, method = SHAPES[args.shape], METHODS[args.method]
    if args.tiny:
        shape = shape.tiny()
    model, make_batch, loss_of = shape.build()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = ds_config(shape, method, args.nvme_dir, args.pinned)
    if method.impl == "dstrain":
        from bench.train import import_dstrain

        lib = import_dstrain()
    else:
        import deepspeed as lib  # type: ignore[import-not-found,no-redef]
    t0 = time.perf_counter()
    engine, optimizer, _, _ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1 + rank)
    batches = [make_batch(g) for _ in range(args.steps)]
    times: list[float] = []
    losses: list[float] = []
    c0 = io0 = None
    # the offloaded optimizer, the engine, and stage 3's shard store (parameter offload) report counters
    sources = (optimizer, engine, getattr(getattr(engine, "zero", None), "store", None))
    for i, batch in enumerate(batches):
        if i == WARMUP:
            reset_peak(required=True)  # peak RSS of the training phase, after the warm-up steps
            _drain(optimizer)
            c0, io0 = offload_counters(*sources), _proc_io()
        dist.barrier()
        t = time.perf_counter()
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.item()))
    _drain(optimizer)
    c1, io1 = offload_counters(*sources), _proc_io()
    tail = times[WARMUP:] or times
    k = len(tail)
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "median_step_s": statistics.median(tail),
        "steps_s": times,
        "peak_rss_mib": rss()[1] / 2**20,
        "init_s": init_s,
        "params": n_params,
        "losses": losses,
        **_delta(c0, c1, k),
    }
    if io0 and io1:
        result["disk_read_bytes_per_step"] = (io1.get("read_bytes", 0) - io0.get("read_bytes", 0)) / k
        result["disk_written_bytes_per_step"] = (io1.get("write_bytes", 0) - io0.get("write_bytes", 0)) / k
    if method.swaps:
        result["swap_file_bytes_total"] = sum(
            os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(args.nvme_dir) for f in fs
        )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    for obj in (engine, optimizer):
        close = getattr(obj, "close", None)
        if close is not None:
            close()
    # Both ranks tear gloo down together: in the two quiet runs 4 of 56 runs (dstrain's and DeepSpeed's
    # alike) died at exit with SIGABRT ("terminate called without an active exception": a joinable gloo
    # thread destroyed) after printing their results; the suspect (not proven) is one rank tearing
    # down while the other is still in the last collective.
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--method", required=True, choices=sorted(METHODS))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--pinned", type=int, required=True, help="dstrain offload_pinned_bytes per rank")
    p.add_argument("--tiny", action="store_true")
    worker(p.parse_args())


if __name__ == "__main__":
    main()
