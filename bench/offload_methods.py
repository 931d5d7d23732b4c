"""Shapes and methods of the offload benchmark, and the bytes per step each method should swap.

A *shape* is a model plus its data: the anchors' 16.8M-parameter MLP and the ~110M GPT of
bench/train.py (its model is imported from there, not copied). A *method* is a library (dstrain or
DeepSpeed) and where the optimizer state and the parameters live (memory, cpu, nvme). New methods
are rows of `METHODS`; the driver runs every listed one and a method the library refuses shows up in
the report as a failed row with the library's own error, so rows appear as soon as a feature lands.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_METHODS", "METHODS", "SHAPES", "Method", "Shape", "expected_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """A model and its data, with the ZeRO settings both libraries get."""

    name: str
    kind: str
    """``mlp`` or ``gpt``."""
    micro_batch: int
    sub_group: int
    """``zero_optimization.sub_group_size`` (elements)."""
    steps: int
    """Default steps per run (two warm-up steps, then the timed ones)."""
    pinned: int
    """dstrain's ``offload_pinned_bytes`` per rank for this shape."""
    paramopt_pinned: int | None = None
    """dstrain's ``offload_pinned_bytes`` with parameters and optimizer state on NVMe, where it must
    be larger (None: ``pinned``): the budget is also what decides whether the fp32 gradient shards
    stay in memory (4 B/param per rank; above it they go to NVMe too), and the shard pool takes half
    of it."""
    paramopt_note: str = "the fp32 gradient shards fit in it, so they stay in memory"
    """Why ``paramopt_pinned`` is what it is (the report prints it)."""
    hidden: int = 2048
    layers: int = 12
    dim: int = 768
    heads: int = 12
    vocab: int = 32000
    seq: int = 128

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "gpt"):
            raise ValueError(f"Shape.kind: expected 'mlp' or 'gpt', got {self.kind!r}")
        for f in ("micro_batch", "sub_group", "steps", "pinned"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Shape.{f}: must be positive, got {getattr(self, f)}")

    def pinned_for(self, method: Method) -> int:
        """``offload_pinned_bytes`` for ``method`` on this shape."""
        if method.param == "nvme" and method.optimizer == "nvme" and self.paramopt_pinned is not None:
            return self.paramopt_pinned
        return self.pinned

    def describe(self, params: int) -> str:
        if self.kind == "mlp":
            return (
                f"MLP of {params / 1e6:.1f}M parameters (4 x Linear({self.hidden}, {self.hidden}) + GELU, "
                f"Linear({self.hidden}, 8)), micro batch {self.micro_batch} per rank"
            )
        return (
            f"GPT of bench/train.py, {params / 1e6:.1f}M parameters ({self.layers} layers, d={self.dim}, "
            f"{self.heads} heads, vocab {self.vocab}, seq {self.seq}, tied head), micro batch "
            f"{self.micro_batch} per rank"
        )

    def tiny(self) -> Shape:
        """The same kind of model at a few hundred thousand parameters (the smoke test's size)."""
        if self.kind == "mlp":
            return dataclasses.replace(self, hidden=256, sub_group=16384, steps=3, pinned=4 << 20)
        return dataclasses.replace(
            self,
            layers=2,
            dim=64,
            heads=4,
            vocab=512,
            seq=32,
            sub_group=16384,
            steps=3,
            pinned=4 << 20,
            paramopt_pinned=None,
        )

    def build(self) -> tuple[Any, Callable[[Any], Any], Callable[[Any, Any], Any]]:
        """(model, make_batch(generator), loss_of(engine, batch)); the model seeded identically everywhere."""
        import torch
        from torch import nn

        if self.kind == "mlp":
            h = self.hidden
            torch.manual_seed(0)
            model = nn.Sequential(
                *[nn.Sequential(nn.Linear(h, h), nn.GELU()) for _ in range(4)], nn.Linear(h, 8)
            )

            def make_batch(g: Any) -> Any:
                return torch.randn(self.micro_batch, h, generator=g)  # (B, H)

            def loss_of(engine: Any, x: Any) -> Any:
                return engine(x).pow(2).mean()

            return model, make_batch, loss_of

        from bench.train import build_model  # the GPT of the training benchmark, one definition

        ns = argparse.Namespace(
            layers=self.layers, dim=self.dim, heads=self.heads, vocab=self.vocab, seq=self.seq
        )
        model = build_model(ns)

        def make_gpt_batch(g: Any) -> Any:
            return torch.randint(0, self.vocab, (self.micro_batch, self.seq + 1), generator=g)  # (B, T+1)

        def gpt_loss(engine: Any, b: Any) -> Any:
            return engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())  # (B, T) each

        return model, make_gpt_batch, gpt_loss


SHAPES: dict[str, Shape] = {
    "mlp": Shape(
        name="mlp",
        kind="mlp",
        micro_batch=8,
        sub_group=4_194_304,
        steps=8,
        pinned=64 << 20,
        # at 64 MiB the shard pool (half of it) lends backward one buffer for the master ranges of the
        # sub-groups stepped there: 59 of the 67 MB of master ranges a step needs were read from the file
        # again in the step (a 4th read of the shards); at 256 MiB all of them are assembled from the
        # backward gathers' shards and every sub-group steps in backward (bench/results/offload-s8-under-load.md)
        paramopt_pinned=256 << 20,
        paramopt_note="the master ranges of every sub-group then assemble from the backward gathers, "
        "so the shards are read twice a step, not three times",
    ),
    "gpt110m": Shape(
        name="gpt110m",
        kind="gpt",
        micro_batch=1,
        sub_group=4_194_304,
        steps=5,
        pinned=128 << 20,
        # the fp32 gradient shards (219 MB per rank) stay in memory; the shard pool (half of it) holds
        # the tied embedding's 49 MB shard in pieces beside the layers' read-ahead
        paramopt_pinned=256 << 20,
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Method:
    """A library and where optimizer state and parameters live (``none`` = in memory, not offloaded)."""

    name: str
    impl: str
    optimizer: str
    param: str = "none"
    step_in_backward: bool = True
    """dstrain: ``offload_optimizer.step_in_backward`` (sub-groups stepped during backward where
    legal); False is the same run with every sub-group stepped in ``engine.step()``."""
    step_thread: bool = True
    """dstrain: ``offload_optimizer.step_thread`` (those sub-group steps on a thread of their own);
    False is the same run with them on the backward thread (`dstrain.offload.optimizer.step_thread`)."""

    def __post_init__(self) -> None:
        if self.impl not in ("dstrain", "deepspeed"):
            raise ValueError(f"Method.impl: expected 'dstrain' or 'deepspeed', got {self.impl!r}")
        for f in ("optimizer", "param"):
            if getattr(self, f) not in ("none", "cpu", "nvme"):
                raise ValueError(f"Method.{f}: expected 'none', 'cpu' or 'nvme', got {getattr(self, f)!r}")

    @property
    def swaps(self) -> bool:
        """Whether anything of this method lives on NVMe."""
        return "nvme" in (self.optimizer, self.param)

    @property
    def label(self) -> str:
        late = "" if self.step_in_backward else " (stepped after backward)"
        late += "" if self.step_thread else " (early steps on the backward thread)"
        if self.param == "none":
            return f"{self.impl} optimizer {self.optimizer}{late}"
        return f"{self.impl} param {self.param} + optimizer {self.optimizer}{late}"


def _m(name: str, optimizer: str, param: str = "none") -> Method:
    return Method(name=name, impl=name.split("-")[0], optimizer=optimizer, param=param)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        _m("dstrain-none", "none"),
        _m("dstrain-cpu", "cpu"),
        _m("dstrain-nvme", "nvme"),
        dataclasses.replace(_m("dstrain-nvme-late", "nvme"), step_in_backward=False),
        dataclasses.replace(_m("dstrain-cpu-serial", "cpu"), step_thread=False),
        dataclasses.replace(_m("dstrain-nvme-serial", "nvme"), step_thread=False),
        _m("dstrain-param-cpu", "cpu", "cpu"),
        _m("dstrain-paramopt-nvme", "nvme", "nvme"),
        dataclasses.replace(_m("dstrain-paramopt-nvme-serial", "nvme", "nvme"), step_thread=False),
        _m("deepspeed-none", "none"),
        _m("deepspeed-cpu", "cpu"),
        _m("deepspeed-nvme", "nvme"),
    )
}
"""Every method the bench knows. DeepSpeed's parameter offload is not a row: at fp32 on NVMe it rounds
the weights to bf16 at initialize (anchors/ds_param_nvme_rounding.py), below ``max_in_cpu`` (1e9
parameters) it silently keeps them in memory, and with ``max_in_cpu: 0`` its prefetcher asserts."""

DEFAULT_METHODS = [m for m in METHODS if not m.endswith(("-late", "-serial"))]
"""What a plain run measures; ``dstrain-nvme-late`` (stepping during backward off, the before/after
of `dstrain.offload.optimizer.early_step`) and ``dstrain-cpu-serial`` / ``dstrain-nvme-serial`` (the
early steps on the backward thread, the before/after of `dstrain.offload.optimizer.step_thread`; also
``dstrain-paramopt-nvme-serial``) run when named in ``--methods``."""


def expected_bytes(
    method: Method, params: int, world: int = 2, *, grads_on_nvme: bool = False
) -> tuple[dict[str, float], str]:
    """({kind: bytes per step, both directions, all ranks}, the formula with the numbers plugged in).

    fp32 everywhere. Each rank holds P / world of every tensor. dstrain keeps the fp32 master in the
    parameter shard it already holds (at fp32 it is the parameter) and swaps Adam's m and v: 8 bytes
    per element read and 8 written. Offloaded parameters (stage 3): each rank's shard read once for
    the forward gathers and once for the backward gathers (and once more as the master inside the
    step when the optimizer is on NVMe too), written once after the step. DeepSpeed's
    optimizer swapper moves the fp32 master, m, v and the fp32 gradient: 16 bytes read and 16 written
    per element (measured: its processes' /proc/<pid>/io bytes equal this on the 110M GPT).
    Sub-groups are padded to 4 KiB in dstrain's files (a few KiB per sub-group, below the rounding).
    ``grads_on_nvme``: dstrain also swapped the fp32 gradient shards (parameters and optimizer on
    NVMe with ``offload_pinned_bytes`` below them): each written once per step (one micro-step) and
    read once in the step, 4 B each way."""
    shard = params / world
    out: dict[str, float] = {}
    parts: list[str] = []
    if method.optimizer == "nvme":
        per = 16 if method.impl == "deepspeed" else 8
        out["optimizer"] = 2 * per * shard * world
        what = "master + m + v + gradient" if per == 16 else "m + v"
        parts.append(
            f"optimizer ({what}): 2 x {per} B x {shard:,.0f} x {world} ranks = {out['optimizer'] / 1e6:,.0f} MB"
        )
    if method.param == "nvme":
        # each rank's shard read for the forward gathers and again for the backward ones (the bounded
        # pool cannot keep a large model's shards between them), written once after the step; with
        # the optimizer on NVMe too the fp32 master is that shard, read once more inside the step
        reads = 3 if method.optimizer == "nvme" else 2
        out["param"] = (reads + 1) * 4 * shard * world
        parts.append(
            f"param ({reads} reads: fwd + bwd gathers{' + master in the step' if reads == 3 else ''}, 1 write): "
            f"{reads + 1} x 4 B x {shard:,.0f} x {world} ranks = {out['param'] / 1e6:,.0f} MB"
            + (
                " (at most: dstrain assembles the master ranges it reads ahead during backward from the "
                "backward gathers' shards where it can, so the measured reads are below this)"
                if reads == 3 and method.impl == "dstrain"
                else ""
            )
        )
    if grads_on_nvme and method.impl != "deepspeed":
        out["grad"] = 2 * 4 * shard * world
        parts.append(
            f"grad (the budget holds no gradient shards: 1 write + 1 read): 2 x 4 B x {shard:,.0f} x "
            f"{world} ranks = {out['grad'] / 1e6:,.0f} MB"
        )
    return out, "; ".join(parts)
