"""The dsio/dstrain demo: ZeRO-Infinity training with async checkpoints, a crash, a resume and live metrics.

    make demo                                  # ~3 minutes on a quiet 2-core CPU machine
    make demo DEMO_OUT=bench/results/demo-2026-11-30
    DEVICE=cuda make demo                      # the same on a GPU machine (NCCL, CUDA tensors)
    python demo/train_demo.py --tiny           # seconds: the smoke test's size

What it does, all on this machine with nothing downloaded:

1. **reference**: 2 local ranks (torchrun, started here) train a byte-level GPT on the standard
   library's own sources with ``dstrain.initialize`` from a DeepSpeed JSON config: ZeRO stage 3,
   optimizer state (and parameters, where this build's dstrain offers ``offload_param``) offloaded to
   NVMe files under ``--work`` through dsio, an async checkpoint every ``--ckpt-every`` steps.
2. **crash**: the same run from scratch; when rank 1 reports step ``--kill-after`` the driver SIGKILLs it.
3. **resume**: a fresh torchrun loads the latest committed checkpoint and trains to the end. Its losses
   must equal the reference's bit for bit (the demo exits 1 if they do not).

While each phase runs, every rank serves Prometheus metrics (the URLs are printed; the progress bar's
swap rate and the checkpoint bar come from scraping them). At the end: a table (``<out>.md``), the raw
numbers (``<out>.json``) and a plot (``<out>.png``: loss with the crash and resume marked, swap GB/s
over time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import DemoRunError, Phase, run_phase  # noqa: E402
from model import GPTShape  # noqa: E402

MARKER = ".dsio-demo"  # a --work folder holding this file is the demo's own, wiped at the start of each run
FULL = {
    "shape": GPTShape(dim=512, layers=6, heads=8, seq=64),
    "micro": 4,
    "steps": 30,
    "every": 5,
    "kill": 17,
}
TINY = {"shape": GPTShape(dim=64, layers=2, heads=2, seq=32), "micro": 2, "steps": 8, "every": 2, "kill": 5}


def build_config(
    work: Path, *, micro: int, dtype: str, param_offload: str = "auto", world: int = 2
) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed JSON config of the run (ZeRO-3, NVMe offload) and the offloads actually on.

    ``param_offload``: ``"auto"`` asks for ``offload_param`` and keeps it only when this dstrain accepts
    it (a build that refuses it with `NotImplementedConfigError` runs with optimizer offload alone, and
    the demo says so); ``"on"`` requires it; ``"off"`` leaves parameters in memory.
    """
    if param_offload not in ("auto", "on", "off"):
        raise ValueError(f"param_offload must be 'auto', 'on' or 'off', got {param_offload!r}")
    from dstrain import DSConfig, NotImplementedConfigError

    swap_opt, swap_param = work / "nvme" / "optimizer", work / "nvme" / "param"
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": 1
        << 21,  # optimizer state streamed in sub-groups of 2Mi elements (a multiple of 1024)
        "offload_optimizer": {"device": "nvme", "nvme_path": str(swap_opt), "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": str(swap_param)},
        "offload_pinned_bytes": 96 << 20,  # dstrain's one pinned-memory budget for every swap buffer
    }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 1, "overlap_events": True},
    }
    for d in (swap_opt, swap_param):
        d.mkdir(parents=True, exist_ok=True)
    active = ["optimizer state -> NVMe"]
    if param_offload == "off":
        del zero["offload_param"]
        active.append("parameters stay in memory (--param-offload off)")
    else:
        try:
            DSConfig.load(config, world_size=world)
            active.insert(0, "parameters -> NVMe")
        except NotImplementedConfigError as e:
            if param_offload == "on":
                raise
            del zero["offload_param"]
            active.append(f"parameters stay in memory: this dstrain refuses offload_param ({e})")
    DSConfig.load(config, world_size=world)  # anything else wrong is a bug of the demo: raise here
    return config, active


def compare(reference: Phase, crash: Phase, resume: Phase) -> dict[str, Any]:
    """Bitwise comparison of every step's loss (both ranks) after the resume, and before the crash."""
    ref = {(e["rank"], e["step"]): e["loss_hex"] for e in reference.of("step")}
    after = [(e["rank"], e["step"], e["loss_hex"]) for e in resume.of("step")]
    before = [(e["rank"], e["step"], e["loss_hex"]) for e in crash.of("step")]
    bad_after = [(r, s) for r, s, h in after if ref.get((r, s)) != h]
    bad_before = [(r, s) for r, s, h in before if ref.get((r, s)) != h]
    return {
        "steps_compared_after_resume": len(after),
        "steps_compared_before_crash": len(before),
        "mismatches_after_resume": bad_after,
        "mismatches_before_crash": bad_before,
        "bitwise_equal": bool(after) and not bad_after and not bad_before,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="build/demo-run", help="swap files, checkpoints, logs (wiped first)")
    p.add_argument("--out", default=None, help="result stem: <out>.md/.json/.png (default <work>/demo)")
    p.add_argument("--device", default=os.environ.get("DEVICE", "cpu"), choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=os.environ.get("DTYPE", "fp32"), choices=("fp32", "bf16"))
    p.add_argument(
        "--param-offload",
        default=os.environ.get("PARAM_OFFLOAD", "auto"),
        choices=("auto", "on", "off"),
        help="offload_param to NVMe: auto = when this dstrain accepts it",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model and 8 steps (the smoke test)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--kill-after", type=int, default=None, help="SIGKILL rank 1 once it reports this step")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (matplotlib not needed)")
    args = p.parse_args(argv)
    preset = TINY if args.tiny else FULL
    shape: GPTShape = preset["shape"]
    steps = args.steps or preset["steps"]
    every = args.ckpt_every or preset["every"]
    kill = args.kill_after or preset["kill"]
    if not 0 < every < kill < steps:
        p.error(f"need 0 < --ckpt-every ({every}) < --kill-after ({kill}) < --steps ({steps})")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "demo: DEVICE=cuda, but this torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); run without DEVICE=cuda for CPU",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(
            f"demo: DEVICE=cuda runs 2 ranks with NCCL, one GPU each; this machine has {torch.cuda.device_count()}",
            file=sys.stderr,
        )
        return 2

    t_start = time.time()
    work = Path(args.work).resolve()
    if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
        print(
            f"demo: --work {work} is not empty and was not made by the demo: refusing to wipe it",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(work, ignore_errors=True)
    (work / "records").mkdir(parents=True)
    (work / MARKER).write_text("made by demo/train_demo.py: wiped at the start of every run\n")
    out = Path(args.out) if args.out else work / "demo"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = work / "torchrun.log"
    config, active = build_config(
        work, micro=preset["micro"], dtype=args.dtype, param_offload=args.param_offload
    )
    (work / "config.json").write_text(json.dumps(config, indent=2))
    print(
        f"demo: ZeRO-3 on 2 ranks ({args.device}, {args.dtype}), {steps} steps, async checkpoint every {every}"
    )
    print("demo: offloaded: " + "; ".join(active))
    print(f"demo: config {work / 'config.json'}, torchrun log {log}")

    def phase(
        name: str, ckpt: str, *, resume: bool = False, start: int = 0, kill_after: int | None = None
    ) -> Phase:
        for d in (work / "nvme" / "optimizer", work / "nvme" / "param"):  # a fresh node: no swap files
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        worker_args = [
            "--config", str(work / "config.json"), "--shape", json.dumps(shape_dict),
            "--steps", str(steps), "--ckpt-dir", str(work / ckpt), "--ckpt-every", str(every),
            "--records", str(work / "records" / name), "--device", args.device,
        ]  # fmt: skip
        if resume:
            worker_args.append("--resume")
        return run_phase(
            name, worker_args, records=str(work / "records" / name), env=env, log=log, steps=steps, start_step=start, saves=steps // every - start // every,
            kill_rank=1 if kill_after else None, kill_after_step=kill_after,
        )  # fmt: skip

    shape_dict = {"dim": shape.dim, "layers": shape.layers, "heads": shape.heads, "seq": shape.seq}
    try:
        reference = phase("reference", "ckpt-reference")
        crash = phase("crash", "ckpt", kill_after=kill)
        committed = _latest(work / "ckpt")
        print(f"demo: after the crash, the latest committed checkpoint is step {committed}")
        resume = phase("resume", "ckpt", resume=True, start=committed or 0)
    except DemoRunError as e:
        print(f"demo: FAILED: {e}", file=sys.stderr)
        return 1
    verdict = compare(reference, crash, resume)
    from report import summarize, write_outputs

    result = summarize(
        reference=reference, crash=crash, resume=resume, verdict=verdict, active=active, config=config,
        shape=shape_dict, device=args.device, dtype=args.dtype, wall_seconds=time.time() - t_start,
    )  # fmt: skip
    paths = write_outputs(result, out, plot_png=not args.no_plot)
    print(Path(paths["md"]).read_text())
    print("demo: wrote " + ", ".join(str(v) for v in paths.values()))
    if not verdict["bitwise_equal"]:
        print(
            "demo: FAILED: the resumed run does not match the uninterrupted one bit for bit", file=sys.stderr
        )
        return 1
    return 0


def _latest(directory: Path) -> int | None:
    """The latest committed step of a dsio checkpoint directory (a reader: takes no writer lock)."""
    import dsio.checkpoint

    if not directory.is_dir():
        return None
    ckpt = dsio.checkpoint.Checkpointer(str(directory))
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


if __name__ == "__main__":
    sys.exit(main())
