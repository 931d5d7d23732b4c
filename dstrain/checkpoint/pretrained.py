"""``load_pretrained(model, path)``: stream a pretrained checkpoint into a model's partitions.

    with dstrain.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = GPT(config)
    dstrain.checkpoint.load_pretrained(model, "gpt2-xl/")   # model.safetensors or its shards
    engine, *_ = dstrain.initialize(model=model, config=cfg)

``path`` is a safetensors file (Hugging Face's ``model.safetensors`` or one written by dsio), a
directory holding ``model.safetensors`` or ``model.safetensors.index.json`` (sharded: the index's
``weight_map`` names the file of each key), or such an index file itself.

Each rank reads only the byte ranges of its own shards: for a parameter partitioned by
``zero.Init``, the elements of every member parameter that fall in this rank's shard, read with
dsio's slice reader (`dsio.checkpoint.SliceReader`: O_DIRECT where aligned, all ranges of a batch
in flight) straight into the shard where it lives (device or host memory), or, for shards in a
swap file, into one shard-sized buffer that is then written back to the swap file: never a whole
tensor, never more than ``BATCH_BYTES`` of buffers. Parameters and buffers that are not
partitioned are read whole into their own memory. Values are converted to the model's dtype as
``load_state_dict``'s copy would.

Keys are matched by name: the model's parameters (every name of a tied parameter counts: the file
needs one of them) and persistent buffers against the file's tensors. Missing keys, unexpected
keys and shape mismatches are a `PretrainedMismatchError` listing them, raised before any value is
read (``strict=True``, the default); ``strict=False`` loads what matches and reports the rest in
the returned `PretrainedLoad`. Parameters an engine has already partitioned (after
``initialize``) are refused: load before ``initialize`` (or use ``engine.load_checkpoint``).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsio import wait_all
from dsio.checkpoint import CheckpointFormatError, CheckpointNotFoundError, SliceReader, TensorSlice
from dstrain.errors import InitError, PretrainedMismatchError

if TYPE_CHECKING:
    from dstrain.zero.init import InitUnit

__all__ = ["BATCH_BYTES", "INDEX_NAME", "SINGLE_NAME", "PretrainedLoad", "load_pretrained"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: Shard buffers (for shards in swap files) allocated at most at once, and bytes read per batch.
BATCH_BYTES = 256 << 20
#: Largest index file read (a 400-shard index of a 70B model is ~100 KB).
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PretrainedLoad:
    """What `load_pretrained` did on this rank."""

    loaded: tuple[str, ...]
    """Keys read into the model (a tied parameter under the key the file has)."""
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    """``(key, file shape, model shape)``."""
    files: tuple[str, ...]
    bytes_read: int
    """Bytes this rank read from the files (its shards' ranges, plus whole unpartitioned tensors)."""


def _files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of ``path`` and, for a sharded checkpoint, key -> file."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            return _index(index)
        single = os.path.join(path, SINGLE_NAME)
        if os.path.exists(single):
            return [single], None
        raise CheckpointNotFoundError(f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no pretrained checkpoint at {path}")
    if path.endswith(".json"):
        return _index(path)
    return [path], None


def _index(index: str) -> tuple[list[str], dict[str, str]]:
    st = os.stat(index)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_INDEX_BYTES:
        raise CheckpointFormatError(f"{index}: not a regular file of at most {MAX_INDEX_BYTES} bytes")
    with open(index, "rb") as f:
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise CheckpointFormatError(f"{index}: more than {MAX_INDEX_BYTES} bytes")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CheckpointFormatError(f"{index}: not a valid JSON index") from None
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
    ):
        raise CheckpointFormatError(f"{index}: weight_map must map tensor names to file names")
    base = os.path.dirname(os.path.abspath(index))
    files: dict[str, str] = {}
    for name in dict.fromkeys(wmap.values()):
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointFormatError(
                f"{index}: shard file {name!r} is not a plain name in the index's directory"
            )
        files[name] = os.path.join(base, name)
    return list(files.values()), {k: files[v] for k, v in wmap.items()}


def _model_keys(
    model: torch.nn.Module,
) -> tuple[dict[int, list[str]], dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """(tensor id -> its names, tensor id -> tensor) for parameters, and name -> persistent buffer."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        tensors[id(p)] = p
    state_keys = set(model.state_dict(keep_vars=True).keys())
    buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False) if n in state_keys}
    return names, tensors, buffers


def load_pretrained(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    io_config: Any = None,
) -> PretrainedLoad:
    """Read the checkpoint at ``path`` into ``model`` (see the module docstring); every rank calls
    it and reads only its own shards. Returns what was loaded and what did not match."""
    from dsio import run_sync
    from dstrain.zero.units import unit_of  # the zero room imports checkpoint.sources: no cycle at import

    path = os.fspath(path)
    files, wmap = _files(path)
    names, tensors, buffers = _model_keys(model)
    for t in tensors.values():
        if unit_of(t) is not None:
            raise InitError(
                type(model).__name__,
                "load_pretrained needs the model before dstrain.initialize (its parameters are an "
                "engine's now): load first, or use engine.load_checkpoint",
            )
    readers: dict[str, SliceReader] = {}

    async def open_all() -> None:
        from dsio import AsyncIOHandle
        from dsio.checkpoint import DEFAULT_IO

        handle = AsyncIOHandle(io_config or DEFAULT_IO)
        for f in files:
            readers[f] = await SliceReader.open(f, handle=handle)
        opened.append(handle)

    async def close_all() -> None:
        for r in readers.values():
            await r.aclose()
        for h in opened:
            await h.aclose()

    opened: list[Any] = []
    try:
        run_sync(open_all())
        where: dict[str, SliceReader] = {}
        for f, r in readers.items():
            for k in r.tensors:
                if wmap is None or wmap.get(k) == f:
                    where.setdefault(k, r)
        if wmap is not None:
            lost = sorted(k for k, f in wmap.items() if k not in readers[f].tensors)
            if lost:
                raise CheckpointFormatError(f"{path}: the index names tensors its files lack: {lost[:20]}")
        plan = _match(names, tensors, buffers, where)
        if strict and (plan.missing or plan.unexpected or plan.mismatched):
            raise PretrainedMismatchError(path, plan.missing, plan.unexpected, plan.mismatched)
        done = _Loader(where, run_sync).load(plan, tensors, buffers)
    finally:
        run_sync(close_all())
    return PretrainedLoad(
        loaded=tuple(sorted(plan.key_of.values()) + sorted(plan.buffer_keys)),
        missing=plan.missing,
        unexpected=plan.unexpected,
        mismatched=plan.mismatched,
        files=tuple(files),
        bytes_read=done,
    )


@dataclass
class _Plan:
    key_of: dict[int, str]  # tensor id -> the file key it is read from
    buffer_keys: list[str]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


def _match(
    names: dict[int, list[str]],
    tensors: dict[int, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    where: dict[str, SliceReader],
) -> _Plan:
    key_of: dict[int, str] = {}
    missing: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    used: set[str] = set()
    for tid, ns in names.items():
        t = tensors[tid]
        have = [n for n in ns if n in where]
        used.update(have)
        if not have:
            missing.append(ns[0])
            continue
        info = where[have[0]].tensors[have[0]]
        if tuple(info.shape) != tuple(t.shape):
            mismatched.append((have[0], tuple(info.shape), tuple(t.shape)))
            continue
        key_of[tid] = have[0]
    buffer_keys = []
    for n, b in buffers.items():
        if n not in where:
            missing.append(n)
            continue
        used.add(n)
        info = where[n].tensors[n]
        if tuple(info.shape) != tuple(b.shape):
            mismatched.append((n, tuple(info.shape), tuple(b.shape)))
            continue
        buffer_keys.append(n)
    unexpected = sorted(k for k in where if k not in used)
    return _Plan(key_of, buffer_keys, tuple(sorted(missing)), tuple(unexpected), tuple(mismatched))


class _Loader:
    """Executes a plan: batches of slices, each batch read with every range in flight."""

    def __init__(self, where: dict[str, SliceReader], run: Callable[[Any], Any]) -> None:
        self.where = where
        self.run = run
        self.bytes = 0

    def _read(self, slices: list[TensorSlice]) -> None:
        if not slices:
            return
        by_reader: dict[int, tuple[SliceReader, list[TensorSlice]]] = {}
        for s in slices:
            r = self.where[s.name]
            by_reader.setdefault(id(r), (r, []))[1].append(s)

        async def go() -> int:
            counts = await wait_all((r.read(ss, convert=True) for r, ss in by_reader.values()), drain=True)
            return sum(counts)

        self.bytes += int(self.run(go()))

    def load(self, plan: _Plan, tensors: dict[int, torch.Tensor], buffers: dict[str, torch.Tensor]) -> int:
        from dstrain.zero import init as zero_init

        with torch.no_grad():
            whole: list[TensorSlice] = []
            partitioned: list[Any] = []
            for tid, key in plan.key_of.items():
                t = tensors[tid]
                if zero_init.is_partitioned(t):
                    partitioned.append(t)
                else:
                    whole.append(TensorSlice(key, _writable(t)))
            whole += [TensorSlice(n, _writable(buffers[n])) for n in plan.buffer_keys]
            self._read(whole)
            self._load_units(zero_init.partitioned_units(partitioned), plan)
        return self.bytes

    def _load_units(self, units: list[InitUnit], plan: _Plan) -> None:
        """Each unit's shard: its members' ranges read into it, a batch of units at a time."""
        batch: list[InitUnit] = []
        size = 0
        for u in units:
            batch.append(u)
            size += u.shard_bytes
            if size >= BATCH_BYTES:
                self._batch(batch, plan)
                batch, size = [], 0
        self._batch(batch, plan)

    def _batch(self, units: list[InitUnit], plan: _Plan) -> None:
        if not units:
            return
        pending: list[list[TensorSlice]] = []

        def collect(unit: InitUnit) -> Callable[[list[tuple[int, int, torch.Tensor]]], None]:
            members = unit.members()

            def fill(pieces: list[tuple[int, int, torch.Tensor]]) -> None:
                slices = []
                for i, start, out in pieces:
                    p = members[i]
                    key = plan.key_of.get(id(p)) if p is not None else None
                    if key is not None:  # missing keys (strict=False) keep their initial values
                        slices.append(TensorSlice(key, out, start))
                pending.append(slices)

            return fill

        # memory shards are filled in place; swap-file shards through a buffer written back after the
        # read: so the reads of a batch happen inside the last unit's fill, all in flight together
        memory = [u for u in units if u.swap is None]
        swapped = [u for u in units if u.swap is not None]
        for u in memory:
            u.overwrite(collect(u))
        self._read([s for ss in pending for s in ss])
        for u in swapped:
            pending.clear()

            def fill_and_read(pieces: list[tuple[int, int, torch.Tensor]], u: InitUnit = u) -> None:
                collect(u)(pieces)
                self._read(pending[0])

            u.overwrite(fill_and_read)


def _writable(t: torch.Tensor) -> torch.Tensor:
    data = t.data
    if not data.is_contiguous():
        raise InitError("load_pretrained", f"tensor of shape {tuple(t.shape)} is not contiguous")
    return data
