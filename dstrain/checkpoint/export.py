"""Whole weights out of a checkpoint, without the job: Hugging Face safetensors files, or a state dict.

    dstrain export CKPT_DIR OUT_DIR [--step N] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
    dstrain.checkpoint.export(ckpt_dir, out_dir, dtype=torch.bfloat16, max_shard_size="5GB")
    sd = dstrain.checkpoint.consolidated_state_dict(ckpt_dir)        # DeepSpeed's get_fp32_state_dict...
    dstrain.checkpoint.load_state_dict_from_checkpoint(model, ckpt_dir)

A parameter is put together from the fp32 master pieces every rank file holds of it (their layout
entries, `dstrain.checkpoint.layout`), read as byte ranges of the stored tensors; buffers and frozen
parameters come from rank 0's file. `export` writes Hugging Face's layout: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` when the weights exceed one
shard; names are the module's own, a tied parameter once (under its first name, as HF expects). Only
one output shard's tensors are in memory at a time (a tensor bigger than the shard size is a shard
of its own).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from dstrain.checkpoint.layout import check_same_model, parameter_names
from dstrain.checkpoint.reshape import Assembled, SavedStep, open_step
from dstrain.checkpoint.sources import materialize
from dstrain.checkpoint.store import committed_step_dir
from dstrain.errors import CheckpointNotFoundError

__all__ = [
    "DTYPES",
    "consolidated_state_dict",
    "export",
    "load_state_dict_from_checkpoint",
    "parse_size",
    "save_16bit_model",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``--dtype`` names."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int (Hugging Face's ``max_shard_size`` forms)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size {size!r}: expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _open(ckpt_dir: str | os.PathLike[str], step: int | None) -> SavedStep:
    return open_step(committed_step_dir(Path(ckpt_dir), step)[0])


class _Weights:
    """The whole tensors of one opened step, one at a time."""

    def __init__(self, saved: SavedStep, dtype: torch.dtype | None) -> None:
        self.saved = saved
        self.dtype = dtype
        self.params = saved.params()
        self.aliases = saved.aliases()
        by_rank = {f.rank: f for f in saved.files}
        self._by_rank = by_rank
        extra = by_rank[0].state.get("module_extra") or {}
        self.extra: dict[str, Any] = dict(extra)
        index = saved.index()
        self._pieces: dict[str, list[tuple[int, int, int, int, int]]] = index

    def names(self) -> list[str]:
        """Every tensor name, in the order the module's ``state_dict`` lists them where known."""
        return list(self.params) + [k for k in self.extra if k not in self.params and k not in self.aliases]

    def nbytes(self, name: str) -> int:
        if name in self.params:
            numel = 1
            for d in self.params[name]:
                numel *= d
            dtype = self.dtype or torch.float32
        else:
            src = self.extra[name]
            numel = 1
            for d in src.shape:
                numel *= int(d)
            dtype = self.dtype if self.dtype is not None and src.dtype.is_floating_point else src.dtype
        return numel * torch.empty((), dtype=dtype).element_size()

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.params:
            shape = self.params[name]
            numel = 1
            for d in shape:
                numel *= d
            pieces, covered = [], 0
            for start, stop, rank, gi, moff in self._pieces.get(name, ()):
                if stop <= covered:  # another rank's copy of elements already placed (stage 0)
                    continue
                lo = max(start, covered)
                src = self._by_rank[rank].state["zero"]["master"][gi]
                pieces.append((lo * 4, (stop - lo) * 4, src, (moff + lo - start) * 4))
                covered = stop
            if covered != numel:
                raise CheckpointNotFoundError(
                    f"{self.saved.step_dir}: the rank files hold {covered} of {numel} elements of {name}"
                )
            whole = materialize(Assembled(torch.float32, (numel,), pieces, self.saved.handle)).view(shape)
        else:
            whole = materialize(self.extra[name])
        if self.dtype is not None and whole.dtype.is_floating_point and whole.dtype != self.dtype:
            whole = whole.to(self.dtype)
        return whole


def consolidated_state_dict(
    ckpt_dir: str | os.PathLike[str], step: int | None = None, dtype: torch.dtype | str | None = torch.float32
) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a checkpoint directory (its latest step, or ``step``): fp32
    masters (cast to ``dtype``; None keeps fp32 masters and the buffers' own dtypes), buffers and frozen
    parameters, tied names sharing one tensor. All in memory: for a big model use `export`."""
    saved = _open(ckpt_dir, step)
    try:
        w = _Weights(saved, _dtype(dtype))
        out = {name: w.tensor(name) for name in w.names()}
        for alias, first in w.aliases.items():
            out[alias] = out[first]
        return out
    finally:
        saved.close()


def load_state_dict_from_checkpoint(
    model: torch.nn.Module, ckpt_dir: str | os.PathLike[str], step: int | None = None, strict: bool = True
) -> torch.nn.Module:
    """Load a checkpoint's whole weights into ``model`` (a plain module, e.g. for inference; DeepSpeed's
    ``load_state_dict_from_zero_checkpoint``); returns it. With ``strict``, a checkpoint of another
    model is ``dstrain.CheckpointMismatchError`` naming the parameters, before anything is loaded."""
    sd = consolidated_state_dict(ckpt_dir, step, dtype=None)
    mine = model.state_dict()
    if strict:
        check_same_model(
            {k: tuple(v.shape) for k, v in sd.items()},
            {k: tuple(v.shape) for k, v in mine.items()},
            str(ckpt_dir),
        )
    model.load_state_dict({k: v.to(mine[k].dtype) if k in mine else v for k, v in sd.items()}, strict=strict)
    return model


def _shards(w: _Weights, limit: int) -> list[list[str]]:
    """Names cut into consecutive shards of at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in w.names():
        n = w.nbytes(name)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def export(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> list[Path]:
    """Write the checkpoint's whole weights as Hugging Face safetensors files into ``out_dir``; returns
    the files written (the index last, when sharded). See the module docstring."""
    from tqdm import tqdm

    import dsio.checkpoint
    from dsio import run_sync

    target = _dtype(dtype)
    limit = parse_size(max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    saved = _open(ckpt_dir, step)
    written: list[Path] = []
    try:
        w = _Weights(saved, target)
        shards = _shards(w, limit)
        total = sum(w.nbytes(n) for n in w.names())
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map: dict[str, str] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not progress) as bar:
            for file_name, shard in zip(names, shards, strict=True):
                tensors = {}
                for name in shard:
                    tensors[name] = w.tensor(name).contiguous()
                    weight_map[name] = file_name
                    bar.update(w.nbytes(name))
                path = out / file_name
                run_sync(dsio.checkpoint.save(tensors, path, metadata={"format": "pt"}))
                written.append(path)
                del tensors  # only one shard in memory
        if len(shards) > 1:
            index = out / "model.safetensors.index.json"
            index.write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            )
            written.append(index)
        return written
    finally:
        saved.close()


def save_16bit_model(
    module: torch.nn.Module,
    zero: Any,
    rank: int,
    save_dir: str | os.PathLike[str],
    save_filename: str = "model.safetensors",
    *,
    exclude_frozen_parameters: bool = False,
) -> Path | None:
    """The online export (DeepSpeed's ``engine.save_16bit_model``): the model's weights in its compute
    dtype, gathered a unit at a time (``zero``'s `gathered_units`, collective at stage 3), copied to
    rank 0's memory and written there as one safetensors file (``format: pt``; a tied weight once).
    Returns the file on rank 0, None on the others."""
    import dsio.checkpoint
    from dsio import run_sync

    names, _ = parameter_names(module)
    out: dict[str, torch.Tensor] = {}
    for params in zero.gathered_units():
        if rank == 0:
            for p in params:
                out[names[id(p)]] = p.detach().to("cpu", copy=True)
    if rank != 0:
        return None
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, value in module.state_dict().items():
        p = params.get(name)
        if name in out or (p is not None and p.requires_grad):  # written, or a tied alias of one
            continue
        if p is not None and exclude_frozen_parameters:
            continue
        out[name] = value.detach().to("cpu", copy=True)  # buffers and frozen parameters
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / save_filename
    run_sync(dsio.checkpoint.save(out, path, metadata={"format": "pt"}))
    return path
