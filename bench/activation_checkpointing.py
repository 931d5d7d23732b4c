"""Activation checkpointing: step time, peak activation memory and bytes offloaded, method against method.

Methods, the same model in each (a stack of GPT blocks: LayerNorm, causal attention, MLP, dropout 0.1,
fp32; or ``--model mlp``: residual Linear-GELU-Dropout-Linear blocks):

    none           no checkpointing
    torch          torch.utils.checkpoint(block, x, use_reentrant=False)
    dstrain        dstrain.checkpointing.checkpoint, inputs kept on the device
    dstrain-cpu    ... cpu_checkpointing: inputs copied to host memory
    dstrain-nvme   ... nvme_path: inputs written to a swap file through dsio, read back ahead of backward
    deepspeed      deepspeed.checkpointing.checkpoint (its venv: DSIO_DEEPSPEED_VENV), defaults

Each method lives in its own worker process (so its memory peak is its own), built once and warmed up;
the driver then runs the reps, and in each rep asks every worker for one measured step, in an order
rotated by one per rep (house rule: methods interleaved rep by rep; a slow moment of the machine hits
every method alike). Step times are medians with [min-max] over the reps; ratios are per rep, between
two methods measured in the same rep, then their median [min-max]. Memory, one extra step per worker
after the reps: on CUDA ``max_memory_allocated`` above what was allocated before the step; on CPU the
peak of the allocator's live bytes over the step (torch.profiler's allocation events, exact) and the
peak resident-set growth (sampled every millisecond; glibc keeps freed pages, so it is coarser).

Floors. ``dstrain-cpu``: the ``dstrain`` step of the same rep plus one copy of the offloaded bytes at
this machine's memcpy bandwidth (on CPU a host copy is the whole extra work). ``dstrain-nvme``: the
larger of that step plus two copies (into the pinned buffer and out of it) and the swap traffic at the
disk's speed (a fresh O_DIRECT write + read through dsio of the bytes one step writes, probed before the
reps). The swap file's page-cache residency is checked after each step (mincore): with O_DIRECT the
reads come from the disk, never from the cache.

    python bench/activation_checkpointing.py                     # the default shape, 5 reps
    python bench/activation_checkpointing.py --quick             # make bench's smoke run (1 rep, tiny)
    python bench/activation_checkpointing.py --label under-load  # results named ...-under-load-<day>
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import rss_now  # noqa: E402

METHODS = ("none", "torch", "dstrain", "dstrain-cpu", "dstrain-nvme", "deepspeed")


# -- worker (one per method) ----------------------------------------------------------------------


class _PeakRSS:
    """Samples the resident set every millisecond while running."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_now())
            time.sleep(0.001)

    def __enter__(self) -> _PeakRSS:
        self.peak = rss_now()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_now())


def _allocator_peak(prof: Any) -> int:
    """Peak live bytes of the CPU allocator over a profiled region, above its level at the start."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
        stack.extend(e.children)
    if not events:
        return 0
    events.sort()
    base = events[0][2] - events[0][1]  # live bytes before the first event
    return max(total for _, _, total in events) - base


def _model(kind: str, dim: int, heads: int, depth: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class GPTBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.drop(self.proj(y))
            return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    class MLPBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
            return x + self.net(x)

    torch.manual_seed(0)
    return nn.ModuleList((GPTBlock() if kind == "gpt" else MLPBlock()) for _ in range(depth))


def worker(a: argparse.Namespace) -> None:
    """Serve one method: build, warm up, then answer ``step`` / ``mem`` / ``quit`` lines on stdin."""
    import torch

    torch.set_num_threads(a.threads)
    method = a.worker
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    swap = None
    dstrain_ckpt: Any = None
    checkpointer: Any = None
    ckpt: Any = None
    if method == "torch":
        from torch.utils.checkpoint import checkpoint as torch_ckpt

        def ckpt(f: Any, x: Any) -> Any:
            return torch_ckpt(f, x, use_reentrant=False)
    elif method == "deepspeed":
        import deepspeed

        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        deepspeed.init_distributed(dist_backend="gloo")  # its checkpoint asks the process group for ranks
        deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
        ckpt = deepspeed.checkpointing.checkpoint
    elif method.startswith("dstrain"):
        import dstrain.checkpointing as dstrain_ckpt

        section: dict[str, Any] = {}
        if method == "dstrain-cpu":
            section = {"cpu_checkpointing": True}
        elif method == "dstrain-nvme":
            swap = tempfile.mkdtemp(prefix="actckpt-", dir=a.swap_dir)
            section = {"cpu_checkpointing": True, "nvme_path": swap, "nvme_window": 2}
        checkpointer = dstrain_ckpt.configure(deepspeed_config={"activation_checkpointing": section})
        ckpt = dstrain_ckpt.checkpoint

    blocks = _model(a.model, a.dim, a.heads, a.depth).to(device)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-4)
    # requires grad: a reentrant checkpoint (DeepSpeed's) of an input without grad would cut the graph
    x0 = torch.randn(a.batch, a.tokens, a.dim, device=device, requires_grad=True)  # (B, T, C)
    libc = ctypes.CDLL("libc.so.6")

    def step() -> None:
        x = x0
        for b in blocks:
            x = ckpt(b, x) if ckpt is not None else b(x)  # (B, T, C)
        x.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def offload() -> dict[str, Any]:
        if dstrain_ckpt is None or method == "dstrain":
            return {}
        s = dstrain_ckpt.statistics()
        return {
            "host_bytes": s.peak_saved_bytes,
            "nvme_written": s.nvme_written_bytes,
            "nvme_read": s.nvme_read_bytes,
        }

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: allocator, lazy init, the swap file's slots
    ready: dict[str, Any] = {"ready": method}
    if method == "dstrain-nvme":
        io = checkpointer.store.io_statistics()
        ready.update(o_direct=io.o_direct, host_buffer_bytes=io.buffers * io.buffer_bytes)
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        before = offload()
        libc.malloc_trim(0)
        sync()
        out: dict[str, Any] = {}
        if cmd == "step":
            t0 = time.perf_counter()
            step()
            sync()
            out["step_s"] = time.perf_counter() - t0
        elif cmd == "mem":
            from torch.profiler import ProfilerActivity, profile

            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            with _PeakRSS() as rss:
                base_rss = rss_now()
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    step()
                    sync()
            out["rss_growth"] = rss.peak - base_rss
            out["peak_bytes"] = (torch.cuda.max_memory_allocated() - base) if cuda else _allocator_peak(prof)
            out["memory"] = "cuda max_memory_allocated" if cuda else "CPU allocator peak (profiler)"
        after = offload()
        if after:
            if method == "dstrain-nvme":
                out["offloaded_bytes"] = after["nvme_written"] - before["nvme_written"]
                out["read_bytes"] = after["nvme_read"] - before["nvme_read"]
                from bench._common import resident_fraction

                path = checkpointer.store.io_statistics().path
                out["resident"] = resident_fraction(path) if os.path.exists(path) else None
            else:
                out["offloaded_bytes"] = after["host_bytes"]
        print(json.dumps(out), flush=True)
    if dstrain_ckpt is not None:
        dstrain_ckpt.reset()  # closes the swap file
    if swap is not None:
        shutil.rmtree(swap, ignore_errors=True)


# -- driver ---------------------------------------------------------------------------------------


class _Worker:
    """One method's process, spoken to a line at a time."""

    def __init__(self, method: str, cmd: list[str], env: dict[str, str]) -> None:
        self.method = method
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env
        )
        self.ready: dict[str, Any] = {}

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.err.seek(0)
                raise RuntimeError(f"{self.method} worker exited:\n{self.err.read()[-3000:]}")
            if line.startswith("{"):  # other lines are the libraries' chatter
                return json.loads(line)

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def memcpy_gbps(nbytes: int) -> float:
    """This machine's copy bandwidth (GB/s of bytes copied; median of 5 copies of ``nbytes``)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def rotated(methods: list[str], rep: int) -> list[str]:
    """Rep ``rep``'s order: the methods rotated left by ``rep``."""
    k = rep % len(methods)
    return methods[k:] + methods[:k]


def _fmt(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def summarize(
    steps: dict[str, list[float]], extra: dict[str, dict[str, Any]], probes: dict[str, float]
) -> list[dict[str, Any]]:
    """Per method: step times, per-rep ratios against torch and none, memory, offloaded bytes, floors."""
    rows = []
    for m, ts in steps.items():
        row: dict[str, Any] = {"method": m, "step_s": ts, **extra.get(m, {})}
        for ref in ("torch", "none"):
            if ref in steps and ref != m:
                row[f"vs_{ref}"] = [t / r for t, r in zip(ts, steps[ref], strict=True)]
        off = row.get("offloaded_bytes")
        if off and "dstrain" in steps and probes.get("memcpy_gbps"):
            copy_s = off / (probes["memcpy_gbps"] * 1e9)
            if m == "dstrain-cpu":
                floors = [p + copy_s for p in steps["dstrain"]]
                row["floor_how"] = "dstrain step + 1 copy of the offloaded bytes"
            else:
                io_s = off / (probes["write_gbps"] * 1e9) + row.get("read_bytes", off) / (
                    probes["read_gbps"] * 1e9
                )
                floors = [max(p + 2 * copy_s, io_s) for p in steps["dstrain"]]
                row["floor_how"] = "max(dstrain step + 2 copies, write + read at the probed disk speed)"
            row["floor_s"] = floors
            row["vs_floor"] = [t / f for t, f in zip(ts, floors, strict=True)]
        rows.append(row)
    return rows


def render(meta: dict[str, Any], rows: list[dict[str, Any]], probes: dict[str, float]) -> str:
    sh = meta["shape"]
    load = f"under load (load {meta['load']})" if meta.get("under_load") else f"load {meta['load']}"
    model = (
        f"{sh['depth']} GPT blocks (LayerNorm, causal attention with {sh['heads']} heads, 4x MLP, dropout 0.1)"
        if sh["model"] == "gpt"
        else f"{sh['depth']} residual MLP blocks (Linear-GELU-Dropout-Linear, 4x hidden, dropout 0.1)"
    )
    lines = [
        f"# Activation checkpointing: step time, peak memory, bytes offloaded ({meta['date']}, {load})",
        "",
        f"{model}, input ({sh['batch']}, {sh['tokens']}, {sh['dim']}) fp32, SGD, {sh['threads']} thread(s). "
        f"Every method in its own process, warmed up; {sh['reps']} rep(s), each running every method once in an "
        "order rotated per rep. Step: median [min-max] over the reps; ratios: per rep, then median [min-max]. "
        f"Memory: one more step per method: {meta.get('memory', '?')}, and the peak resident-set growth.",
        "",
        "| method | step (s) | vs torch | vs none | peak memory (MiB) | RSS growth (MiB) | offloaded (MiB/step) | step / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        off = r.get("offloaded_bytes")
        lines.append(
            f"| {r['method']} | {_fmt(r['step_s'])} | {_fmt(r.get('vs_torch', []), 2) if r['method'] != 'torch' else '1'} "
            f"| {_fmt(r.get('vs_none', []), 2) if r['method'] != 'none' else '1'} "
            f"| {r['peak_bytes'] / 2**20:.1f} | {r['rss_growth'] / 2**20:.1f} "
            f"| {off / 2**20:.1f} | {_fmt(r.get('vs_floor', []), 2)} |"
            if off is not None
            else f"| {r['method']} | {_fmt(r['step_s'])} | {_fmt(r.get('vs_torch', []), 2) if r['method'] != 'torch' else '1'} "
            f"| {_fmt(r.get('vs_none', []), 2) if r['method'] != 'none' else '1'} "
            f"| {r['peak_bytes'] / 2**20:.1f} | {r['rss_growth'] / 2**20:.1f} | - | - |"
        )
    lines.append("")
    if probes:
        lines.append(
            f"Floors: memcpy {probes['memcpy_gbps']:.1f} GB/s"
            + (
                f"; disk (swap directory, {meta.get('swap_fs', '?')}): write {probes['write_gbps']:.2f} GB/s, "
                f"read {probes['read_gbps']:.2f} GB/s (fresh O_DIRECT file through dsio, median of the probes "
                "before and after the reps)"
                if "write_gbps" in probes
                else ""
            )
            + "."
        )
        for r in rows:
            if "floor_s" in r:
                lines.append(f"- {r['method']}: floor {_fmt(r['floor_s'])} s = {r['floor_how']}.")
    for r in rows:
        if r["method"] == "dstrain-nvme":
            res = [x for x in r.get("resident", []) if x is not None]
            lines.append(
                f"- dstrain-nvme: swap file O_DIRECT {r.get('o_direct')}, pinned host buffers "
                f"{r.get('host_buffer_bytes', 0) / 2**20:.1f} MiB (the window, not the depth), read back "
                f"{r.get('read_bytes', 0) / 2**20:.1f} MiB/step; page-cache residency of the swap file after each "
                f"step: max {max(res) * 100 if res else float('nan'):.1f}% (mincore)."
            )
    for m, why in meta.get("failed", {}).items():
        lines.append(f"- {m}: did not run: {why}")
    lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    med = [statistics.median(r["step_s"]) for r in rows]
    lo = [m - min(r["step_s"]) for m, r in zip(med, rows, strict=True)]
    hi = [max(r["step_s"]) - m for m, r in zip(med, rows, strict=True)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, med, yerr=[lo, hi], capsize=4, color="tab:blue")
    ax1.set_ylabel("step (s), median [min-max]")
    ax2.bar(names, [r["peak_bytes"] / 2**20 for r in rows], color="tab:orange", label="peak allocated")
    ax2.set_ylabel("peak activation memory (MiB)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=512, help="sequence length")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (workers take turns)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--quick", action="store_true", help="make bench's smoke run: dim 64, 64 tokens, depth 4, 1 rep"
    )
    ap.add_argument("--label", default=None, help="result file label (e.g. under-load); --quick: 'quick'")
    ap.add_argument(
        "--swap-dir", default=None, help="where dstrain-nvme's swap file goes (default: bench scratch)"
    )
    ap.add_argument("--ds-python", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    if ap.parse_known_args(argv)[0].quick:  # --quick's shape, each flag given still wins
        ap.set_defaults(dim=64, heads=2, tokens=64, batch=2, depth=4, reps=1, label="quick")
    a = ap.parse_args(argv)
    a.label = a.label or ""
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, ROOT)
    if a.worker:
        worker(a)
        return 0
    from bench._common import deepspeed_python, fs_of, machine, scratch_dir, write_labelled_result

    methods = [m for m in a.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if a.swap_dir is None:
        a.swap_dir = scratch_dir()
    os.makedirs(a.swap_dir, exist_ok=True)
    meta: dict[str, Any] = machine()
    meta["shape"] = {
        k: getattr(a, k) for k in ("model", "dim", "heads", "tokens", "batch", "depth", "reps", "threads")
    }
    meta["swap_fs"] = fs_of(a.swap_dir)
    meta["failed"] = {}
    args = [a.model, a.dim, a.heads, a.tokens, a.batch, a.depth]
    flags = ["--model", "--dim", "--heads", "--tokens", "--batch", "--depth"]
    common = [x for f, v in zip(flags, args, strict=True) for x in (f, str(v))]
    common += ["--threads", str(a.threads), "--swap-dir", a.swap_dir]
    workers: dict[str, _Worker] = {}
    try:
        for m in methods:
            py = sys.executable
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
            if m == "deepspeed":
                ds_py = deepspeed_python(a.ds_python)
                if ds_py is None:
                    meta["failed"][m] = "no DeepSpeed venv (DSIO_DEEPSPEED_VENV)"
                    continue
                py = ds_py
                env.setdefault("DS_ACCELERATOR", "cpu")
                env.setdefault(
                    "TORCH_EXTENSIONS_DIR",
                    os.path.join(os.path.dirname(os.path.dirname(py)), "torch_extensions"),
                )
            workers[m] = _Worker(m, [py, os.path.abspath(__file__), "--worker", m, *common], env)
        for m, w in list(workers.items()):  # they warm up side by side; nothing is measured yet
            try:
                w.ready = w.reply()
            except RuntimeError as e:
                meta["failed"][m] = str(e).strip().splitlines()[-1]
                print(e, file=sys.stderr)
                w.close()
                del workers[m]
        order = [m for m in methods if m in workers]
        nbytes = max(16 << 20, a.depth * a.batch * a.tokens * a.dim * 4)
        probes: dict[str, float] = {"memcpy_gbps": memcpy_gbps(nbytes)}
        disk: list[dict[str, float]] = []
        if "dstrain-nvme" in workers:
            from bench.offload_gpu import disk_probe

            disk.append(disk_probe(a.swap_dir, -(-nbytes // 4096) * 4096))
        steps: dict[str, list[float]] = {m: [] for m in order}
        extra: dict[str, dict[str, Any]] = {m: dict(workers[m].ready) for m in order}
        for rep in range(a.reps):
            for m in rotated(order, rep):
                out = workers[m].ask("step")
                steps[m].append(out["step_s"])
                for k in ("offloaded_bytes", "read_bytes"):
                    if k in out:
                        extra[m][k] = out[k]
                if "resident" in out:
                    extra[m].setdefault("resident", []).append(out["resident"])
            print(
                f"rep {rep + 1}/{a.reps}: " + ", ".join(f"{m} {steps[m][-1]:.3f}s" for m in order),
                file=sys.stderr,
            )
        for m in order:
            out = workers[m].ask("mem")
            extra[m].update(peak_bytes=out["peak_bytes"], rss_growth=out["rss_growth"])
            meta["memory"] = out["memory"]
        if disk:
            disk.append(disk_probe(a.swap_dir, -(-nbytes // 4096) * 4096))
            probes["write_gbps"] = statistics.median(d["write_gbps"] for d in disk)
            probes["read_gbps"] = statistics.median(d["read_gbps"] for d in disk)
    finally:
        for w in workers.values():
            w.close()
    meta["load"] = f"{os.getloadavg()[0]:.1f}"
    meta["under_load"] = "under-load" in a.label
    rows = summarize(steps, extra, probes)
    md = render(meta, rows, probes)
    stem = write_labelled_result(
        "activation-checkpointing", a.label, meta, md, {"rows": rows, "probes": probes, "disk": disk}
    )
    plot(rows, stem + ".png", md.splitlines()[0].lstrip("# "))
    with open(stem + ".md", "a") as f:
        f.write(f"\n![results]({os.path.basename(stem)}.png)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
