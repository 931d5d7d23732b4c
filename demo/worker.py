"""One rank of the demo's training run (started by ``demo/train_demo.py`` through torchrun).

It trains the byte-level GPT of ``demo/model.py`` with ``dstrain.initialize`` from the DeepSpeed JSON
config the driver wrote, saves an async checkpoint every ``--ckpt-every`` steps, serves its Prometheus
metrics (``dsio.metrics.serve()``: base port ``DSIO_METRICS_PORT`` + ``LOCAL_RANK``) and writes one JSON
line per event to its records file and to stdout (the driver's progress bars read stdout). With
``--resume`` it first loads the latest committed checkpoint and goes on from its step.

The loop reads top to bottom: batch -> forward -> backward -> step -> record -> maybe save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTShape, batch, corpus  # noqa: E402


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def metric_sums(prefix: str) -> dict[str, float]:
    """This process's dsio/dstrain metrics whose name starts with ``prefix``, read through the same
    collector the /metrics endpoint serves; a sample's labels other than ``rank`` join its key."""
    from dsio.metrics import DsioCollector

    out: dict[str, float] = {}
    for family in DsioCollector().collect():
        for s in family.samples:
            if not s.name.startswith(prefix):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "rank")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def swap_bytes() -> tuple[float, float]:
    """(read, written) bytes swapped so far by every offload swapper of this rank (param and optimizer)."""
    read = written = 0.0
    for key, value in metric_sums("dstrain_offload_swap_bytes").items():
        if "direction=read" in key:
            read += value
        elif "direction=write" in key:
            written += value
    return read, written


class Recorder:
    """JSON lines to the records file (flushed per line: a SIGKILL loses nothing already written) and stdout."""

    def __init__(self, path: str, rank: int) -> None:
        self.rank = rank
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())

    def __call__(self, event: str, *, quiet: bool = False, **fields: Any) -> None:
        line = json.dumps({"event": event, "rank": self.rank, "t": time.time(), **fields})
        self._file.write(line + "\n")
        self._file.flush()
        if not quiet:  # one write(2) of less than PIPE_BUF: the two ranks' lines never interleave
            os.write(sys.stdout.fileno(), ("DEMO " + line + "\n").encode())

    def close(self) -> None:
        self._file.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="DeepSpeed JSON config written by the driver")
    p.add_argument("--shape", required=True, help="GPTShape as JSON")
    p.add_argument("--steps", type=int, required=True, help="train until this global step")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, required=True)
    p.add_argument("--records", required=True, help="records file stem: <stem>-rank<R>.jsonl")
    p.add_argument("--resume", action="store_true", help="load the latest committed checkpoint first")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)

    import dstrain
    import dstrain.metrics
    from dsio.metrics import serve

    torch.set_num_threads(1)
    dstrain.init_distributed("nccl" if args.device == "cuda" else "gloo")
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    record = Recorder(f"{args.records}-rank{rank}.jsonl", rank)
    try:
        server = serve()  # 10464 (or DSIO_METRICS_PORT) + LOCAL_RANK, on loopback
    except OSError:  # that port is taken (another run, another exporter): any free port, printed below
        server = serve(port=0)
    record("metrics", url=server.url, pid=os.getpid())

    with open(args.config) as f:
        config = json.load(f)
    shape = GPTShape(**json.loads(args.shape))
    micro = int(config["train_micro_batch_size_per_gpu"])
    torch.manual_seed(0)
    model = GPT(shape)
    n_params = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = dstrain.initialize(model=model, config=config)
    # its dstrain_* and dstrain_offload_* series in the /metrics this rank serves (and in swap_bytes) until close
    dstrain.metrics.register(engine)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else None
    text = corpus()

    start = 0
    if args.resume:
        t0 = time.perf_counter()
        path, _client = engine.load_checkpoint(args.ckpt_dir)
        start = engine.global_steps
        record("resumed", step=start, path=str(path), seconds=time.perf_counter() - t0)
    record("start", step=start, params=n_params, steps=args.steps)

    for step in range(start, args.steps):
        x, y = batch(text, step, rank, micro, shape.seq)  # each (micro, seq)
        if device is not None:
            x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        read, written = swap_bytes()
        value = float(loss.item())
        record(
            "step",
            step=step + 1,
            loss=value,
            loss_hex=value.hex(),  # the bitwise comparison reads this
            seconds=dt,
            tokens=micro * shape.seq,
            swap_read=read,
            swap_written=written,
        )
        if (step + 1) % args.ckpt_every == 0:
            # async: returns once the state is captured; the files are written while training goes on
            t0 = time.perf_counter()
            engine.save_checkpoint(args.ckpt_dir, async_save=True)
            record("save", step=step + 1, blocked_seconds=time.perf_counter() - t0)

    t0 = time.perf_counter()
    engine.wait_checkpoint()
    record("drained", seconds=time.perf_counter() - t0)
    ckpt = metric_sums("dsio_checkpoint_")
    summary = {
        "peak_rss_kib": _peak_rss_kib(),
        "checkpoint": ckpt,
        "offload": metric_sums("dstrain_offload_"),
    }
    record("summary", quiet=True, **summary)
    t0 = time.perf_counter()
    engine.close()
    server.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    record("closed", seconds=time.perf_counter() - t0)
    record.close()


if __name__ == "__main__":
    main()
