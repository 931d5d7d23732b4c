"""Shared pieces of the dstrain tests: a tiny model, deterministic data, a plain PyTorch reference loop,
an engine loop, and a helper that runs a function on a real multi-process gloo group."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)  # appended: the installed dsio stays the one imported
# this process's (VmRSS, VmHWM) and the VmHWM reset: the benchmark drivers' readers, one copy for both
from bench._common import reset_peak, rss  # noqa: E402

VOCAB, SEQ, DIM = 32, 8, 16


class Tiny(nn.Module):
    """Embedding, a root-level parameter, an MLP block, LayerNorm and a head tied to the embedding."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.1)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]  # (B, T, C)
        x = x + self.block(x)  # (B, T, C)
        logits = self.head(self.ln(x))  # (B, T, V)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


class TanhStack(nn.Module):
    """``depth`` Linear(width, width) layers, each followed by tanh, and an MSE loss: the deep model of the
    memory and offload tests (many equal units; the largest module, one layer, fixed by ``width``)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # (B, width)
        # the engine casts every floating input to the compute dtype, the target y too (bf16 under bf16):
        # the loss is computed in fp32 from both (a no-op at fp32). A bf16 target beside an fp32
        # prediction is a mixed-dtype loss that torch 2.11's mse_loss backward refuses ("Found dtype
        # BFloat16 but expected Float"; 2.13 promotes), issue 27.
        return F.mse_loss(x.float(), y.float())


def make_model(seed: int = 0, dim: int = DIM) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(dim)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (size, SEQ) token batch for ``step`` on every rank and in the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = (idx * 7 + 3) % VOCAB  # learnable
    return idx, targets


def base_config(stage: int, *, world: int, micro: int = 4, gas: int = 1, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    cfg.update(extra)
    return cfg


def reference_losses(
    steps: int, batch: int, *, lr: float = 1e-2, clip: float = 0.0, sgd: bool = False, device: str = "cpu"
) -> list[float]:
    """A plain single-process PyTorch loop on the global batch (AdamW, or SGD: sensitive to gradient scale)."""
    model = make_model().to(device)
    if sgd:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        idx, targets = (t.to(device) for t in global_batch(step, batch))
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def engine_losses(
    engine: Any, steps: int, *, start: int = 0, hook: Callable[[int, int], None] | None = None
) -> list[float]:
    """Train ``steps`` optimizer steps; returns the mean loss over the global batch of each step."""
    cfg = engine.config
    world, rank = engine.comm.world_size, engine.comm.rank
    mb, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    device = next(engine.module.parameters()).device
    totals = []  # this rank's (), one a step
    for step in range(start, start + steps):
        idx, targets = (t.to(device) for t in global_batch(step, cfg.train_batch_size))
        total = torch.zeros((), device=device)
        for micro in range(gas):
            lo = (micro * world + rank) * mb
            loss = engine(idx[lo : lo + mb], targets[lo : lo + mb])
            if hook is not None:
                hook(step, micro)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        totals.append(total)
    if not totals:
        return []
    # the ranks' sums of all steps in one all-reduce at the end, not one a step (a small collective costs ~1 ms
    # of CPU per rank on the loaded 2-core machine): at world 2 each element is the same a + b, then / world
    stacked = torch.stack(totals)  # (steps,)
    if world > 1:
        dist.all_reduce(stacked)
        stacked /= world
    return stacked.tolist()


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A new directory for swap files and checkpoints, removed when the block ends (raising or not):
    under ``$DSTRAIN_NVME_DIR`` where set (to put the tests' swap files on another disk), else in the
    temp directory. For a rank worker or a module fixture, which have no ``tmp_path``."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=os.environ.get("DSTRAIN_NVME_DIR")) as root:
        yield root


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
    backend: str,
    env: dict[str, str] | None = None,
) -> None:
    if env is not None:  # forked from the fork server: made like a spawned rank
        os.environ.clear()  # the caller's environment (a forked child has the server's)
        os.environ.update(env)
        torch.seed()  # a seed of its own, as a new interpreter has (a fork copies the server's RNG)
        np.random.seed()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


START_METHODS = ("spawn", "forkserver")


def start_processes(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
    *,
    world: int,
    backend: str,
    start_method: str,
) -> Any:
    """Start ``world`` ranks running ``fn(*args)`` (see `_entry`); torch's ProcessContext, not joined.

    ``start_method="spawn"``: each rank a new interpreter. ``"forkserver"``: each rank forked from the
    session's fork server (tests/_forkserver.py: torch, dsio and dstrain already imported; ~0.1 s instead
    of ~2 s of CPU per rank), given the caller's environment. Use spawn where process start-up itself or
    the start-up environment (MALLOC_* tunables, cgroup charges of imported pages) is under test, and
    for NCCL (CUDA in forked children is not what users run)."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if start_method == "forkserver" and backend == "nccl":
        raise ValueError("start_method='forkserver' is for gloo ranks; NCCL ranks are spawned")
    if os.environ.get("DSTRAIN_TESTS_SPAWN_ONLY") == "1":  # every rank a new interpreter (to compare, or
        start_method = "spawn"  # to rule the fork server out when a multi-rank test fails)
    # tests/ modules, imported here: this module is imported standalone too (a child's sys.path: tests/dstrain)
    from _ports import free_port  # a rendezvous port no concurrent launch picks

    if start_method == "forkserver":
        import _forkserver

        _forkserver.context()  # fixes the one fork server's preload list before torch starts it
    env = dict(os.environ) if start_method == "forkserver" else None  # a spawned rank inherits it
    return mp.start_processes(
        _entry,
        # a forked rank gets the caller's environment now (the fork server's is the one at its start)
        args=(world, free_port(), fn, args, out_dir, backend, env),
        nprocs=world,
        join=False,
        start_method=start_method,
    )


def spawn(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    backend: str = "gloo",
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` fresh processes forming a process group; returns each rank's result.

    ``start_method``: "spawn" (new interpreters) or "forkserver" (forked from the session's fork server:
    fresh processes that skip importing torch; see `start_processes`)."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = start_processes(fn, args, out_dir, world=world, backend=backend, start_method=start_method)
        try:
            while not ctx.join():
                pass
        except Exception:
            pass
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} died without a result")
            data = torch.load(path, weights_only=False)
            if "error" in data:
                raise RuntimeError(f"rank {rank} failed:\n{data['error']}")
            results.append(data["ok"])
        return results


# -- scenario workers (run inside spawned ranks, or in-process at world size 1) ------------------


def world_rank() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def train_scenario(config: dict[str, Any], steps: int = 20) -> dict[str, Any]:
    """Train the tiny model ``steps`` steps under ``config``; losses plus a checksum of the weights."""
    import dstrain

    engine, _, _, _ = dstrain.initialize(model=make_model(), config=config)
    losses = engine_losses(engine, steps)
    stats = engine.statistics()
    engine.close()
    if engine.zero.stage == 3:
        engine.zero.gathered_module()  # type: ignore[attr-defined]
    checksum = float(sum(p.detach().double().sum().cpu() for p in engine.module.parameters()))
    dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
    master_dtypes = sorted({str(p.dtype) for g in engine.optimizer.param_groups for p in g["params"]})
    return {
        "losses": losses,
        "stats": stats,
        "checksum": checksum,
        "dtypes": dtypes,
        "master_dtypes": master_dtypes,
        "n_optimizer_tensors": sum(len(g["params"]) for g in engine.optimizer.param_groups),
    }


def run_scenarios(scenarios: dict[str, dict[str, Any]], native_collectives: bool = False) -> dict[str, Any]:
    if native_collectives:  # gloo's own reduce-scatter / all-gather instead of dstrain's all-reduce forms
        os.environ["DSTRAIN_GLOO_NATIVE_COLLECTIVES"] = "1"
    return {name: train_scenario(cfg) for name, cfg in scenarios.items()}


def overflow_run(stage: int, hysteresis: int, inject: list[int], inject_rank: int) -> dict[str, Any]:
    """fp16 training where the loss of the steps in ``inject`` is made inf on ``inject_rank`` only."""
    import dstrain

    world, rank = world_rank()
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": hysteresis, "loss_scale_window": 1000}
    cfg = base_config(stage, world=world, micro=2, fp16=fp16)
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_num_steps": 100, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01},
    }
    engine, optimizer, _, sched = dstrain.initialize(model=make_model(), config=cfg)
    out: dict[str, list[Any]] = {"scale": [], "skipped": [], "changed": [], "lr": []}
    for step in range(6):
        before = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
        device = next(engine.module.parameters()).device
        idx, targets = (t.to(device) for t in global_batch(step, cfg["train_batch_size"]))
        lo = rank * 2
        loss = engine(idx[lo : lo + 2], targets[lo : lo + 2])
        if step in inject and rank == inject_rank:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        after = [p.detach() for g in optimizer.param_groups for p in g["params"]]
        out["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        out["scale"].append(engine.loss_scale)
        out["skipped"].append(engine.skipped_steps)
        out["lr"].append(engine.get_lr()[0])
    engine.close()
    return out


def resident_param_numel(engine: Any) -> int:
    """Measured: elements of the distinct storages behind the module's parameters and ZeRO's shards."""
    storages: dict[int, int] = {}
    tensors = [p for p in engine.module.parameters()]
    tensors += [getattr(g, "shards", getattr(g, "flat", None)) for g in engine.zero.groups]
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes() // t.element_size()
    return sum(storages.values())


def memory_run(stage: int, dim: int) -> dict[str, Any]:
    import dstrain

    world, _ = world_rank()
    model = make_model(dim=dim)
    model_numel = sum(p.numel() for p in model.parameters())
    cfg = base_config(stage, world=world, micro=2)
    engine, _, _, _ = dstrain.initialize(model=model, config=cfg)
    after_init = resident_param_numel(engine)
    engine_losses(engine, 2)
    after_train = resident_param_numel(engine)
    stats = engine.statistics().zero
    engine.close()
    return {"model": model_numel, "after_init": after_init, "after_train": after_train, "stats": stats}


CLIENT_STATE = {"epoch": 3, "note": "resume me", "history": [1.5, 2.5], "nested": {"k": [1, 2]}}


def make_store(kind: str | None) -> Any:
    """None: dstrain's default (dsio.checkpoint where it works, else torch.save)."""
    import dstrain

    if kind is None:
        return None
    return dstrain.TorchSaveStore() if kind == "torch" else dstrain.DsioStore()


def checkpoint_save_run(
    root: str, scenarios: dict[str, dict[str, Any]], store: str | None = None
) -> dict[str, Any]:
    """Per scenario: train 10 steps, save, train 10 more; returns all 20 losses."""
    import dstrain

    out = {}
    for name, cfg in scenarios.items():
        engine, _, _, _ = dstrain.initialize(
            model=make_model(), config=cfg, checkpoint_store=make_store(store)
        )
        first = engine_losses(engine, 10)
        # asynchronous where the scenario says so: the next 10 steps run while the file is written
        async_save = name.endswith("_async")
        engine.save_checkpoint(os.path.join(root, name), client_state=CLIENT_STATE, async_save=async_save)
        rng = torch.rand(4)  # the RNG stream right after the save point
        out[name] = {"losses": first + engine_losses(engine, 10, start=10), "rng": rng}
        engine.close()
    return out


def checkpoint_resume_run(
    root: str, scenarios: dict[str, dict[str, Any]], store: str | None = None
) -> dict[str, Any]:
    """Per scenario: a differently initialised model, load the checkpoint, train the last 10 steps."""
    import dstrain

    out = {}
    for name, cfg in scenarios.items():
        engine, _, _, _ = dstrain.initialize(
            model=make_model(seed=123), config=cfg, checkpoint_store=make_store(store)
        )
        torch.manual_seed(999)
        _, client = engine.load_checkpoint(os.path.join(root, name))
        steps, rng = engine.global_steps, torch.rand(4)
        out[name] = {
            "losses": engine_losses(engine, 10, start=10),
            "client_state": client,
            "global_steps": steps,
            "rng": rng,
        }
        engine.close()
    return out


# -- bounded launches and memory probes (shared by several rooms) ----------------------------------


def spawn_bounded(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` ranks of a ``backend`` group ("nccl": rank r on cuda:r); a run past
    ``timeout`` seconds is killed and raises TimeoutError (a hang fails the test instead of stalling it).
    ``start_method``: as `_dstrain_helpers.spawn` ("forkserver": gloo ranks forked from the session's
    fork server, no torch import per rank)."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = start_processes(fn, args, out_dir, world=world, backend=backend, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"ranks still running after {timeout:.0f} s (a hang)")
        except mp.ProcessRaisedException:
            pass
        except mp.ProcessExitedException:
            pass
        # every rank's error first (a rank killed because its peer failed leaves no result: name the cause)
        loaded = {}
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pt")
            if os.path.exists(path):
                loaded[rank] = torch.load(path, weights_only=False)
        errors = [f"rank {r} failed:\n{d['error']}" for r, d in loaded.items() if "error" in d]
        if errors:
            raise RuntimeError("\n".join(errors))
        missing = [r for r in range(world) if r not in loaded]
        if missing:
            raise RuntimeError(f"ranks {missing} died without a result")
        return [loaded[r]["ok"] for r in range(world)]


def least_peak_growth(
    call: Callable[[], object], reps: int = 3, prepare: Callable[[], object] | None = None
) -> int:
    """The least peak-RSS growth (VmHWM after ``call()`` minus VmRSS before it) over ``reps`` calls,
    each after ``prepare()`` (not measured) where given.

    A one-time cost (the first touch of a pool's buffers, an allocator's new arena, a worker thread's
    first allocations) shows in one call, not in every one, and a loaded machine makes more of it
    happen at once (measured: 16 MiB on the second of six streamed loads, 0 on the four after it);
    what a call materializes it allocates again each time, so the least of a few calls keeps that
    and drops the noise. Skips the test where the kernel cannot reset VmHWM."""
    import pytest

    growths = []
    for _ in range(reps):
        if prepare is not None:
            prepare()
        if not reset_peak():
            pytest.skip("this kernel cannot reset VmHWM (/proc/self/clear_refs)")
        before, _ = rss()
        call()
        _, peak = rss()
        growths.append(peak - before)
    return min(growths)


def run_child(
    script: Path,
    root: Path,
    paths: Sequence[Path],
    what: str,
    forked: bool = False,
    args: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Run ``script root *args`` in a process of its own (a crash there is a failed test, not a dead test run)
    with ``paths`` first on PYTHONPATH (the helper modules it imports) and OMP_NUM_THREADS=1 unless
    set. Its stdout is one JSON object per line, each with a ``"name"``: returned by name. A SIGSEGV
    fails naming ``what`` crashed and the child's last ``# `` progress line on stderr; any other
    non-zero exit fails with the tail of its stderr.

    A fresh interpreter, or with ``forked`` a process forked from the session's fork server running the
    script (tests/_forkserver.py `run`: ~2-3 CPU-s of imports saved), where the script's subject is not
    interpreter start-up or exit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*map(str, paths), env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(script), str(root), *args]
    if forked:
        import _forkserver

        call = functools.partial(_forkserver.script, str(script), [str(root), *args], [str(p) for p in paths])
        child = _forkserver.run(call, cmd, env=env, timeout=600)
    else:
        child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    died = child.returncode < 0 and -child.returncode == signal.SIGSEGV
    reached = [line for line in child.stderr.splitlines() if line.startswith("# ")]
    assert not died, f"{what} crashed the process (SIGSEGV) in {reached[-1:]}"
    assert child.returncode == 0, child.stderr[-4000:]
    return {r["name"]: r for r in (json.loads(line) for line in child.stdout.splitlines() if line)}
