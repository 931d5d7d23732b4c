"""How long an engine checkpoint blocks training: synchronous save vs async save, staged at the call
(the Checkpointer's old behaviour: the pinned memcpy holds the caller) vs staged in the background
while the next forward and backward run (the engine waits only if staging is unfinished at the next
optimizer step).

    .venv/bin/python bench/ckpt_blocked.py                      # 3 reps, offload none and nvme, ~4 min
    .venv/bin/python bench/ckpt_blocked.py --reps 1 --dim 512   # smoke run

One process (world size 1), ZeRO stage 1, an MLP of ``layers`` x Linear(dim, dim) trained with Adam;
the checkpoint holds the weights plus Adam's m and v. Per rep, every method runs once (interleaved):

- ``sync``: ``engine.save_checkpoint(d)``; blocked = its wall time (the reference).
- ``async, staged at call``: ``save_checkpoint(d, async_save=True)`` through a store whose save stages
  before returning (dsio's ``Checkpointer.save`` without ``background_staging``).
- ``async, background, whole-staging fence``: staged in the background, but the next optimizer step
  waits for the whole staging (no touch order: the file is streamed in file order; the engine's
  behaviour before per-sub-group gating).
- ``async, gate without copy-on-write`` (offload nvme only): the second session's engine: each
  sub-group's step waits until the save has read its master range *and its swap slot* (the swap
  file is read in place, so the step may not overwrite it before).
- ``async, staged in background``: ``save_checkpoint(d, async_save=True)`` as the engine does it now:
  an offloading stepper steps each sub-group as soon as the save has copied its in-memory bytes
  (the master range); the swapped m and v are pinned copy-on-write (the step writes its new
  versions around them), so no step waits for the save's reads of the swap file.

For async saves, blocked = ``EngineStatistics.checkpoint_blocked_seconds`` accumulated over the call
and the ``steps_after`` steps that follow (the fence before the next optimizer step); the commit wait
(``wait_checkpoint`` after those steps) is reported apart, as is the mean time of the steps that ran
during the save vs the steps before it. Results: bench/results/ckpt-blocked-<date>[-label].{json,md}.

``--stage3``: the same question for a ZeRO-3 run whose parameters *and* optimizer state are on NVMe (the
fp32 master lives only in the shard file, or at bf16 in its own master file), where the save streams the
master and Adam's m, v from their swap files while the next forward and backward run:

    .venv/bin/python bench/ckpt_blocked.py --stage3                      # 3 reps, fp32 and bf16, ~3 min
    .venv/bin/python bench/ckpt_blocked.py --stage3 --reps 1 --dim 512   # smoke run

- ``sync``: as above.
- ``async, whole-staging fence``: the next optimizer step waits for the whole staging (the engine's
  per-sub-group gate switched off).
- ``async``: as the engine does it: the step waits, sub-group by sub-group, only until the save has
  read the bytes that sub-group's step rewrites (its master range; m, v too unless the optimizer's
  swapper writes around a pinned version).

Results: bench/results/ckpt-blocked-stage3-<date>[-label].{json,md}. ``--quick`` (``make bench``): both
modes, tiny model, one rep, results under ``$DSIO_BENCH_RESULTS`` (see bench/_common.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import RESULTS, fmt, fs_of, machine, scratch_dir  # noqa: E402

METHODS = (
    "sync",
    "async, staged at call",
    "async, background, whole-staging fence",
    "async, gate without copy-on-write",
    "async, staged in background",
)
NVME_ONLY = ("async, gate without copy-on-write",)
#: The ``--stage3`` methods.
STAGE3_METHODS = ("sync", "async, whole-staging fence", "async")


def _model(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _config(offload: str, swap: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 1}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": swap, "buffer_count": 4}
        zero["sub_group_size"] = 1 << 22
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }


class _OlderStore:
    """dstrain's store as it was, through public pieces only: one ``dsio.checkpoint.Checkpointer`` of
    its own per directory (the store's ``keep_last`` and ``allow_pickle``; world size 1) and a
    `PendingSave` built as `DsioStore` builds it, but either staged at the call (``stage_at_call``:
    ``save`` returns once dsio staged the state, the memcpy blocks the caller) or staged in the
    background without a touch order or per-set capture (the next step waits for the whole
    staging, pinned bytes too: the engine's behaviour before per-sub-group gating)."""

    def __init__(self, inner: Any, *, stage_at_call: bool) -> None:
        self.inner = inner
        self.suffix = inner.suffix
        self.stage_at_call = stage_at_call
        self._ckpts: dict[str, Any] = {}

    def save(
        self,
        directory: Path,
        step: int,
        state: dict[str, Any],
        world: Any,
        *,
        background: bool,
        touch_order: Any = None,
    ) -> Any:
        import dsio.checkpoint
        from dsio import run_sync
        from dstrain.checkpoint.sources import release_sources
        from dstrain.checkpoint.store import PendingSave, rank_file_in, step_name

        key = os.path.abspath(directory)
        ckpt = self._ckpts.get(key)
        if ckpt is None:
            ckpt = dsio.checkpoint.Checkpointer(
                key, keep_last=self.inner.keep_last, allow_pickle=self.inner.allow_pickle
            )
            self._ckpts[key] = ckpt
        in_background = background and not self.stage_at_call
        try:
            task = run_sync(ckpt.save(step, state, background_staging=in_background))
        except BaseException:
            release_sources(state)
            raise
        ckpt.staging_capture.when_over(lambda: release_sources(state))  # swap versions pinned for it go
        expected = directory / step_name(step) / f"rank-{world.rank:05d}{self.suffix}"

        async def committed() -> Any:
            return await task

        def finish() -> Path:
            return rank_file_in(Path(run_sync(committed()).path), world.rank) or expected

        def staged() -> float:
            return float(run_sync(ckpt.wait_staged()))

        pending = PendingSave(expected, finish, staged if in_background else None)  # no per-set capture
        if not background:
            pending.wait()
        return pending

    def load(self, *a: Any, **k: Any) -> Any:
        return self.inner.load(*a, **k)

    def close(self) -> None:
        """Close this store's own Checkpointers (the inner store is the engine's to close)."""
        from dsio import run_sync

        for ckpt in self._ckpts.values():
            run_sync(ckpt.aclose())
        self._ckpts.clear()


def _train(engine: Any, x: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def run_config(args: argparse.Namespace, offload: str, root: str) -> dict[str, Any]:
    import dstrain
    from dstrain.checkpoint.store import DsioStore
    from dstrain.offload import OffloadAdam

    swap = os.path.join(root, f"swap-{offload}")
    os.makedirs(swap, exist_ok=True)
    engine, opt, _, _ = dstrain.initialize(model=_model(args.dim, args.layers), config=_config(offload, swap))
    # the optimizer's swap files (offload_optimizer on NVMe); None in memory or on CPU
    swapper = opt.swapped.swapper if isinstance(opt, OffloadAdam) else None
    methods = [m for m in METHODS if swapper is not None or m not in NVME_ONLY]
    store = engine.store
    assert isinstance(store, DsioStore), "this bench needs dsio's native core"
    store.keep_last = 1  # one directory per method, kept open across reps (as in a run); old steps go
    x = torch.randn(args.batch, args.dim)
    _train(engine, x, 2)  # warm-up
    older = {  # built once: their Checkpointers stay open across reps, as the store's do
        "async, staged at call": _OlderStore(store, stage_at_call=True),
        "async, background, whole-staging fence": _OlderStore(store, stage_at_call=False),
    }
    # rep 0 is not measured: it creates each directory's Checkpointer (handle, lock, staging region)
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for rep in range(args.reps + 1):
        for method in methods:
            d = os.path.join(root, f"ck-{offload}-{METHODS.index(method)}")
            before = _train(engine, x, args.steps_before)
            engine.store = older.get(method, store)
            if swapper is not None:
                swapper.copy_on_write = method not in NVME_ONLY
            b0 = engine.statistics().checkpoint_blocked_seconds
            t0 = time.perf_counter()
            engine.save_checkpoint(d, async_save=method != "sync")
            call = time.perf_counter() - t0
            pending = engine.checkpoints.pending  # None after a synchronous save
            during = _train(engine, x, args.steps_after) if method != "sync" else []
            blocked = engine.statistics().checkpoint_blocked_seconds - b0
            gate = pending.gate_seconds if pending is not None else 0.0
            t1 = time.perf_counter()
            engine.wait_checkpoint()
            commit_wait = time.perf_counter() - t1
            engine.store = store
            if rep > 0:
                rows[method].append(
                    {
                        "blocked_s": blocked if method != "sync" else call,
                        "call_s": call,
                        # blocked = call + gate (a step's per-sub-group waits) + fence (the rest)
                        "gate_s": gate,
                        "commit_wait_s": commit_wait,
                        "step_before_s": statistics.mean(before),
                        "step_during_s": statistics.mean(during) if during else float("nan"),
                    }
                )
    nbytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    swap_file = None
    if swapper is not None:  # what copy-on-write cost in disk space over all the saves above
        st = swapper.statistics()
        v = st.versions
        swap_file = {
            "file_bytes": st.file_bytes,
            "grown_bytes": v.grown_bytes if v else 0,
            "relocations": v.relocations if v else 0,
            "pins_left": v.pins if v else 0,
        }
    for older_store in older.values():
        older_store.close()
    engine.close()
    shutil.rmtree(swap, ignore_errors=True)
    sync = [r["blocked_s"] for r in rows["sync"]]
    ratios = {
        m: [r["blocked_s"] / s for r, s in zip(rows[m], sync, strict=True)] for m in methods if m != "sync"
    }
    return {
        "offload": offload,
        "param_bytes": nbytes,
        "state_bytes": 3 * nbytes,
        "rows": rows,
        "ratios": ratios,
        "swap_file": swap_file,
    }


def stage3_config(swap: str, *, bf16: bool, sub_group: int = 1 << 22) -> dict[str, Any]:
    """Stage 3 with parameters and optimizer state on NVMe under ``swap``."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": sub_group,
            "offload_param": {"device": "nvme", "nvme_path": swap},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        },
        "steps_per_print": 1_000_000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def run_stage3(args: argparse.Namespace, root: str, bf16: bool) -> dict[str, Any]:
    import dstrain
    import dstrain.checkpoint.policy as policy_module
    from dstrain.checkpoint.store import DsioStore

    swap = os.path.join(root, f"swap-{'bf16' if bf16 else 'fp32'}")
    os.makedirs(swap, exist_ok=True)
    engine, _, _, _ = dstrain.initialize(
        model=_model(args.dim, args.layers), config=stage3_config(swap, bf16=bf16)
    )
    assert engine.zero.store.holds_master, "the master must live in the swap files"
    assert isinstance(engine.store, DsioStore), "this bench needs dsio's native core"
    engine.store.keep_last = 1  # one directory per method, kept open across reps; old steps go
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(args.batch, args.dim, dtype=dtype)
    _train(engine, x, 2)  # warm-up
    lend = policy_module.lend_gate
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in STAGE3_METHODS}
    try:
        # rep 0 is not measured: it creates each directory's Checkpointer (handle, lock, staging region)
        for rep in range(args.reps + 1):
            for i, method in enumerate(STAGE3_METHODS):
                d = os.path.join(root, f"ck-{'bf16' if bf16 else 'fp32'}-{i}")
                before = _train(engine, x, args.steps_before)
                policy_module.lend_gate = (lambda *a: False) if method.endswith("fence") else lend
                b0 = engine.statistics().checkpoint_blocked_seconds
                t0 = time.perf_counter()
                engine.save_checkpoint(d, async_save=method != "sync")
                call = time.perf_counter() - t0
                during = _train(engine, x, args.steps_after) if method != "sync" else []
                blocked = engine.statistics().checkpoint_blocked_seconds - b0
                t1 = time.perf_counter()
                engine.wait_checkpoint()
                commit_wait = time.perf_counter() - t1
                policy_module.lend_gate = lend
                if rep > 0:
                    rows[method].append(
                        {
                            "blocked_s": blocked if method != "sync" else call,
                            "call_s": call,
                            "commit_wait_s": commit_wait,
                            "step_before_s": statistics.mean(before),
                            "step_during_s": statistics.mean(during) if during else float("nan"),
                        }
                    )
    finally:
        policy_module.lend_gate = lend
        engine.close()
        shutil.rmtree(swap, ignore_errors=True)
    numel = sum(g.total for g in engine.zero.groups)
    sync = [r["blocked_s"] for r in rows["sync"]]
    ratios = {m: [r["blocked_s"] / s for r, s in zip(rows[m], sync, strict=True)] for m in STAGE3_METHODS[1:]}
    return {
        "precision": "bf16" if bf16 else "fp32",
        "master_bytes": 4 * numel,
        "state_bytes": 12 * numel,  # master, m, v (fp32): what the checkpoint streams
        "rows": rows,
        "ratios": ratios,
    }


def _split(rows: list[dict[str, float]]) -> str:
    """Medians of the blocked time's parts: the call, the per-sub-group gate, the fence (the rest)."""
    if not rows or "gate_s" not in rows[0]:
        return "-"
    call = statistics.median(r["call_s"] for r in rows)
    gate = statistics.median(r["gate_s"] for r in rows)
    fence = statistics.median(max(0.0, r["blocked_s"] - r["call_s"] - r["gate_s"]) for r in rows)
    return f"{call:.3f} / {gate:.3f} / {fence:.3f}"


def report(results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, str], label: str) -> str:
    lines = [
        f"# Checkpoint: time training is blocked per save ({info['date']}{', ' + label if label else ''})",
        "",
        f"Machine: {info['cpu']}, {info['memory']}, kernel {info['kernel']}; scratch {args.where} ({fs_of(args.where)}); "
        f"load average at start {args.load_start}. One process, ZeRO stage 1, MLP {args.layers} x Linear({args.dim}, "
        f"{args.dim}), batch {args.batch}, Adam; {args.reps} reps after one unmeasured, methods interleaved rep by rep; "
        "median (min-max), seconds. Async blocked = time inside save_checkpoint + the wait at the next optimizer step "
        f"for unfinished staging ({args.steps_after} steps run after each async save); ratio = async blocked / the "
        "same rep's synchronous save.",
        "",
        "| offload | state | method | blocked (s) | blocked / sync save | of which: in the call / per-sub-group "
        "gate / fence (s) | commit wait after the steps (s) | step before (s) | step during the save (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for m in METHODS:
            if m not in r["rows"]:
                continue
            rows = r["rows"][m]
            ratio = fmt([100 * x for x in r["ratios"][m]], 1) + " %" if m != "sync" else "100 %"
            lines.append(
                f"| {r['offload']} | {r['state_bytes'] / 2**20:.0f} MiB | {m} | {fmt([x['blocked_s'] for x in rows], 3)} "
                f"| {ratio} | {_split(rows)} | {fmt([x['commit_wait_s'] for x in rows], 3)} "
                f"| {fmt([x['step_before_s'] for x in rows], 3)} "
                f"| {fmt([x['step_during_s'] for x in rows], 3) if m != 'sync' else '-'} |"
            )
    lines += ["", "Target (issue 11): async save blocks training <= 5% of a synchronous save's time."]
    for r in results:
        med = statistics.median(r["ratios"]["async, staged in background"])
        whole = statistics.median(r["ratios"]["async, background, whole-staging fence"])
        no_cow = r["ratios"].get(NVME_ONLY[0])
        lines.append(
            f"- offload {r['offload']}: {100 * med:.1f}% ({'met' if med <= 0.05 else 'MISSED'}); "
            f"whole-staging fence: {100 * whole:.1f}%; "
            + (f"gate without copy-on-write: {100 * statistics.median(no_cow):.1f}%; " if no_cow else "")
            + f"staged at call: {100 * statistics.median(r['ratios']['async, staged at call']):.1f}%"
        )
        sf = r.get("swap_file")
        if sf:
            lines.append(
                f"  - swap file after all saves: {sf['file_bytes'] / 2**20:.0f} MiB, of which "
                f"{sf['grown_bytes'] / 2**20:.0f} MiB grown by copy-on-write ({sf['relocations']} slot writes "
                f"went around a pinned version; pins left: {sf['pins_left']})"
            )
    return "\n".join(lines) + "\n"


def report_stage3(results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, str]) -> str:
    lines = [
        f"# Checkpoint of a ZeRO-3 run with parameters and optimizer state on NVMe: time training is blocked "
        f"({info['date']}{', ' + args.label if args.label else ''})",
        "",
        f"Machine: {info['cpu']}, {info['memory']}, kernel {info['kernel']}; scratch {args.where} "
        f"({fs_of(args.where)}); load average at start {args.load_start}. One process, ZeRO stage 3, "
        f"offload_param and offload_optimizer on NVMe (the master only in the swap files), MLP {args.layers} x "
        f"Linear({args.dim}, {args.dim}), batch {args.batch}, Adam; {args.reps} reps after one unmeasured, methods "
        "interleaved rep by rep; median (min-max), seconds. Async blocked = time inside save_checkpoint + the "
        f"waits of the next optimizer step ({args.steps_after} steps run after each async save); ratio = async "
        "blocked / the same rep's synchronous save.",
        "",
        "| precision | master + m + v | method | blocked (s) | blocked / sync save | commit wait after the steps (s) "
        "| of which in the call (s) | step before (s) | step during the save (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for m in STAGE3_METHODS:
            rows = r["rows"][m]
            ratio = fmt([100 * x for x in r["ratios"][m]], 1) + " %" if m != "sync" else "100 %"
            lines.append(
                f"| {r['precision']} | {r['state_bytes'] / 2**20:.0f} MiB | {m} "
                f"| {fmt([x['blocked_s'] for x in rows], 3)} | {ratio} "
                f"| {fmt([x['commit_wait_s'] for x in rows], 3)} | {fmt([x['call_s'] for x in rows], 3)} "
                f"| {fmt([x['step_before_s'] for x in rows], 3)} "
                f"| {fmt([x['step_during_s'] for x in rows], 3) if m != 'sync' else '-'} |"
            )
    lines += ["", "Target (issue 11): async save blocks training <= 5% of a synchronous save's time."]
    for r in results:
        med = statistics.median(r["ratios"]["async"])
        whole = statistics.median(r["ratios"]["async, whole-staging fence"])
        lines.append(
            f"- {r['precision']}: {100 * med:.1f}% ({'met' if med <= 0.05 else 'MISSED'}); "
            f"whole-staging fence: {100 * whole:.1f}%"
        )
    return "\n".join(lines) + "\n"


def _write(
    kind: str, label: str, info: dict[str, str], args: argparse.Namespace, results: list, text: str
) -> None:
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    stem = os.path.join(RESULTS, f"{kind}-{day}{'-' + label if label else ''}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {stem}.json and .md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps-before", type=int, default=2)
    ap.add_argument("--steps-after", type=int, default=3)
    ap.add_argument("--offload", default="none,nvme")
    ap.add_argument("--stage3", action="store_true", help="ZeRO-3 with parameters + optimizer state on NVMe")
    ap.add_argument("--precision", default="fp32,bf16", help="--stage3: comma-separated fp32, bf16")
    ap.add_argument("--label", default="", help="suffix of the result files, e.g. under-load")
    ap.add_argument(
        "--quick", action="store_true", help="seconds: both modes, tiny model, 1 rep (make bench)"
    )
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.batch, args.reps, args.steps_before, args.steps_after = 256, 2, 8, 1, 1, 1
        args.label = args.label or "quick"
    args.where = scratch_dir()
    args.load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    os.makedirs(args.where, exist_ok=True)
    root = os.path.join(args.where, f"ckpt-blocked-{os.getpid()}")
    os.makedirs(root)
    info = machine()
    try:
        if not args.stage3 or args.quick:
            results = [run_config(args, o, root) for o in args.offload.split(",")]
            _write("ckpt-blocked", args.label, info, args, results, report(results, args, info, args.label))
        if args.stage3 or args.quick:
            results = [run_stage3(args, root, p == "bf16") for p in args.precision.split(",")]
            _write("ckpt-blocked-stage3", args.label, info, args, results, report_stage3(results, args, info))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
