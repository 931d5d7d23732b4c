"""What each rank's checkpoint file holds of the global model: the ``layout`` entry (the manifest of
global shapes and slices that lets a checkpoint load into any world size, stage or offload device,
and be exported without the job).

Every rank file of a step carries, under the top-level key ``"layout"``, one JSON string::

    {"version": 1, "rank": r, "world_size": W, "dp_size": D, "stage": S,
     "stepper": "torch" | null,          # optimizer state in torch's per-tensor format (reshapable)
     "pinned": [],                       # parts whose state ties the file to its shape (MoE experts,
                                         # a pipeline stage): not resharded
     "params": {name: [global shape]},   # every trainable parameter of this rank's groups
     "aliases": {name: canonical name},  # tied parameters: the other names of one tensor
     "groups": [{"numel": N,             # this rank's master partition of param group g
                 "views": [n0, n1, ...], # how the optimizer steps it: consecutive pieces
                 "segments": [[offset, name, start, length], ...]}]}

A segment says: elements ``[offset, offset + length)`` of the file's tensor ``zero/master/<g>`` are
elements ``[start, start + length)`` of parameter ``name``, row-major flattened (global shape in
``params``). The optimizer state (``stepper/state/<i>/exp_avg``, ``exp_avg_sq``) lies over the same
elements: view ``i`` (counted over all groups) covers master elements ``[n0 + ... + n(i-1), ...)``
of its group. Padding is in no segment. Stage 0 ranks all hold everything; stages 1-2 each rank a
contiguous range of the group's flat parameters; stage 3 a shard of every unit.

The files stay safetensors: stock safetensors (``safe_open(path).metadata()["dsio.state"]``) reads the
tensors, and this entry is the JSON string at ``layout`` of that state tree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dstrain.errors import CheckpointMismatchError

__all__ = [
    "LAYOUT_VERSION",
    "Layout",
    "PinnedPart",
    "ReshapableState",
    "Segment",
    "check_same_model",
    "describe",
    "parameter_names",
    "trainable_shapes",
]

LAYOUT_VERSION = 1


@runtime_checkable
class PinnedPart(Protocol):
    """A checkpoint part whose state belongs to this rank's place in the job (an MoE layer's experts,
    a pipeline stage's layers): while `pins_shape` is true, the checkpoint loads only into the same
    world size and stage (`dstrain.checkpoint.reshape` refuses, naming both shapes). Its
    ``load_state_dict`` only checks (raising its own error for another layout), so a load asks it first."""

    def pins_shape(self) -> bool: ...


@runtime_checkable
class ReshapableState(Protocol):
    """A stepper whose ``state_dict()`` is in torch's optimizer format over the ZeRO strategy's views
    (``{"state": {i: {"step", "exp_avg", ...}}, "param_groups": [...]}``, every tensor shaped like its
    view): a checkpoint of it can be resharded. Per-rank state (1-bit Adam's error feedback) is not."""

    reshapable_state: bool


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[offset, offset + length)`` of a master partition are ``[start, start + length)`` of
    parameter ``name``."""

    offset: int
    name: str
    start: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One rank file's ``layout`` entry, parsed."""

    rank: int
    world_size: int
    dp_size: int
    stage: int
    stepper: str | None
    pinned: list[str]
    params: dict[str, tuple[int, ...]]
    aliases: dict[str, str]
    numels: list[int]
    views: list[list[int]]
    segments: list[list[Segment]]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": LAYOUT_VERSION,
                "rank": self.rank,
                "world_size": self.world_size,
                "dp_size": self.dp_size,
                "stage": self.stage,
                "stepper": self.stepper,
                "pinned": self.pinned,
                "params": {k: list(v) for k, v in self.params.items()},
                "aliases": self.aliases,
                "groups": [
                    {
                        "numel": n,
                        "views": v,
                        "segments": [[s.offset, s.name, s.start, s.length] for s in segs],
                    }
                    for n, v, segs in zip(self.numels, self.views, self.segments, strict=True)
                ],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Layout:
        from dsio.checkpoint import CheckpointFormatError

        try:
            d = json.loads(text)
            if d.get("version") != LAYOUT_VERSION:
                raise ValueError(f"layout version {d.get('version')!r}")
            groups = d["groups"]
            return cls(
                rank=int(d["rank"]),
                world_size=int(d["world_size"]),
                dp_size=int(d["dp_size"]),
                stage=int(d["stage"]),
                stepper=d["stepper"],
                pinned=[str(x) for x in d["pinned"]],
                params={str(k): tuple(int(x) for x in v) for k, v in d["params"].items()},
                aliases={str(k): str(v) for k, v in d["aliases"].items()},
                numels=[int(g["numel"]) for g in groups],
                views=[[int(x) for x in g["views"]] for g in groups],
                segments=[
                    [Segment(int(a), str(b), int(c), int(e)) for a, b, c, e in g["segments"]] for g in groups
                ],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"{where}: malformed layout entry ({e})") from None

    def same_shape(self, other: Layout) -> bool:
        """Whether a file of ``other`` loads natively here (the same partitions, views and segments)."""
        return (
            self.world_size == other.world_size
            and self.dp_size == other.dp_size
            and self.stage == other.stage
            and self.numels == other.numels
            and self.views == other.views
            and self.segments == other.segments
        )


def describe(
    module: torch.nn.Module,
    zero: Any,
    stepper: Any,
    *,
    rank: int,
    world_size: int,
    pinned: list[str],
) -> Layout:
    """This rank's `Layout`: ``zero`` (a ``ZeroStrategy``) says which parameter elements its master
    partitions hold; parameter names are ``module``'s (the first name of a tied parameter)."""
    names, aliases = parameter_names(module)
    params = trainable_shapes(module)
    segments = [
        [Segment(piece.offset, names[id(piece.param)], piece.start, piece.length) for piece in pieces]
        for pieces in zero.master_pieces()
    ]
    from dstrain.zero.units import whole_shape  # the zero room imports checkpoint.sources: no cycle at import

    # a view whose values a store holds is empty: its whole shape says how many elements it steps
    views = [[math.prod(whole_shape(v)) for v in g["params"]] for g in zero.param_groups()]
    return Layout(
        rank=rank,
        world_size=world_size,
        dp_size=zero.comm.world_size,
        stage=zero.stage,
        stepper="torch" if isinstance(stepper, ReshapableState) and stepper.reshapable_state else None,
        pinned=pinned,
        params=params,
        aliases={k: v for k, v in aliases.items() if v in params},
        numels=[sum(view_numels) for view_numels in views],
        views=views,
        segments=segments,
    )


def parameter_names(module: torch.nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """(the first name of each parameter by ``id``, {other name of a tied parameter: its first name})."""
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first = names.setdefault(id(p), name)
        if first != name:
            aliases[name] = first
    return names, aliases


def trainable_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's first name and whole shape (a released stage-3 parameter's too:
    it holds an empty tensor between uses, `dstrain.zero.units.whole_shape` keeps its shape)."""
    from dstrain.zero.units import whole_shape  # the zero room imports checkpoint.sources: no cycle at import

    return {n: tuple(whole_shape(p)) for n, p in module.named_parameters() if p.requires_grad}


def check_same_model(
    saved: Mapping[str, tuple[int, ...]], mine: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Raise `CheckpointMismatchError` listing every parameter missing from ``saved``, extra in it, or
    of another shape (``where`` names the checkpoint)."""
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    reshaped = sorted(n for n in set(saved) & set(mine) if tuple(saved[n]) != tuple(mine[n]))
    if not (missing or unexpected or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"missing from it: {_names(missing)}")
    if unexpected:
        parts.append(f"not in this model: {_names(unexpected)}")
    if reshaped:
        parts.append(
            "of another shape: "
            + ", ".join(f"{n} {list(saved[n])} (model {list(mine[n])})" for n in reshaped)
        )
    raise CheckpointMismatchError(
        f"{where} holds another model's parameters; " + "; ".join(parts),
        tuple(missing),
        tuple(unexpected),
        tuple(reshaped),
    )


def _names(names: Iterable[str]) -> str:
    return ", ".join(names)
