"""Loading a checkpoint into another shape: any world size, ZeRO stage, offload device or sub-group size.

Every rank file records which elements of which parameter its master partition and optimizer state
hold (`dstrain.checkpoint.layout`). A rank of the new engine describes its own partitions the same
way, and builds its state in its own native format -- ``zero``'s masters, the stepper's torch-format
``exp_avg`` / ``exp_avg_sq`` per view -- out of `Assembled` tensors: lazy sources that read, when the
part loading them asks for a range, only the overlapping byte ranges of the saved files (dsio reads of
the stored tensors; ``torch.load(mmap=True)`` pages of ``.pt`` files). No rank reads another's whole
state, and a part that streams its load (an offloaded optimizer, an offloaded stage-3 master) never
holds more than a window of it.

What is per rank and not resharded: 1-bit / 0-1 Adam's error feedback and parts that pin the
shape (`dstrain.checkpoint.layout.PinnedPart`: MoE experts, pipeline stages), refused with a
`ReshapeError` naming both shapes; counters, precision, lr schedule, RNG, buffers and client state come
from the file of rank ``rank % saved world size``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsio import wait_all
from dsio.checkpoint import LazyTensor
from dstrain.checkpoint.layout import Layout, Segment, check_same_model
from dstrain.checkpoint.store import rank_file_name
from dstrain.errors import CheckpointRankError, ReshapeError

if TYPE_CHECKING:
    from dsio.handle import AsyncIOHandle

__all__ = ["Assembled", "SavedStep", "native_state", "open_step", "saved_world"]

_F32 = 4


class Assembled(LazyTensor):
    """A tensor made of ranges of other tensors: ``pieces`` are ``(byte offset here, bytes, source,
    byte offset in source)``, the source a `LazyTensor` (a tensor left in a checkpoint file) or a
    tensor; bytes no piece covers are zero (padding)."""

    def __init__(
        self,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        pieces: list[tuple[int, int, LazyTensor | torch.Tensor, int]],
        io: AsyncIOHandle | None = None,
    ) -> None:
        super().__init__(dtype, shape)
        self.pieces = sorted(pieces, key=lambda p: p[0])
        self._starts = [p[0] for p in self.pieces]
        self.io = io
        """The handle `dstrain.checkpoint.sources.read_lazy` reads with (the loading one)."""

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        end = offset + out.numel()
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"bytes [{offset}, {end}) are outside a {self.nbytes}-byte tensor")
        out.zero_()
        reads = []
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        for here, n, src, there in self.pieces[i:]:
            if here >= end:
                break
            lo, hi = max(here, offset), min(here + n, end)
            if lo >= hi:
                continue
            dest = out[lo - offset : hi - offset]
            if isinstance(src, torch.Tensor):
                raw = src.detach().reshape(-1).view(torch.uint8)
                dest.copy_(raw[there + lo - here : there + hi - here])
            else:
                reads.append(src.read_into(io, there + lo - here, dest))
        await wait_all(reads, drain=True)  # all end (into ``out``) before this returns or raises


@dataclass
class SavedFile:
    rank: int
    path: Path
    state: dict[str, Any]
    """The file's state with its tensors left in the file (`LazyTensor`) or memory-mapped (``.pt``)."""
    layout: Layout


@dataclass
class SavedStep:
    """The rank files of one committed step, opened without reading their tensors."""

    step_dir: Path
    files: list[SavedFile]
    handle: Any = None
    _index: dict[str, list[tuple[int, int, int, int, int]]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.files)

    def index(self) -> dict[str, list[tuple[int, int, int, int, int]]]:
        """Per parameter name: ``(start, end, rank, group, master offset)`` of every saved piece, by start."""
        if not self._index:
            for f in self.files:
                for gi, segs in enumerate(f.layout.segments):
                    for s in segs:
                        self._index.setdefault(s.name, []).append(
                            (s.start, s.start + s.length, f.rank, gi, s.offset)
                        )
            for pieces in self._index.values():
                pieces.sort()
        return self._index

    def params(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            out.update(f.layout.params)
        return out

    def aliases(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in self.files:
            out.update(f.layout.aliases)
        return out

    def close(self) -> None:
        if self.handle is not None:
            from dsio import run_sync

            run_sync(self.handle.aclose())
            self.handle = None
        self.files = []


def saved_world(step_dir: Path) -> tuple[int, str]:
    """(ranks that wrote ``step_dir``, their files' suffix): from the step's manifest (dsio's commit), else
    from the ``rank-*.pt`` files of a step committed without one."""
    manifest = step_dir / "manifest.json"
    try:
        m = json.loads(manifest.read_text())
        names = [str(e["path"]) for e in m["files"]]
        return int(m["world_size"]), Path(names[0]).suffix if names else ".safetensors"
    except FileNotFoundError:
        pass
    except OSError as e:
        raise OSError(e.errno, f"cannot read {manifest}: {e.strerror}") from e
    except (ValueError, KeyError, TypeError, IndexError):
        from dsio.checkpoint import CheckpointFormatError

        raise CheckpointFormatError(f"{manifest} is not a dsio manifest") from None
    ranks = sorted(step_dir.glob("rank-*.pt"))
    return len(ranks), ".pt"


def rank_path(step_dir: Path, rank: int, suffix: str) -> Path:
    return step_dir / rank_file_name(rank, suffix)


def open_step(step_dir: Path, ranks: list[int] | None = None, *, allow_pickle: bool = False) -> SavedStep:
    """Open the rank files of ``step_dir`` (``ranks``: only those; default all) lazily: their headers
    and structure are read, their tensors stay in the files. A missing file is `CheckpointRankError`
    naming the rank and the file."""
    world, suffix = saved_world(step_dir)
    wanted = list(range(world)) if ranks is None else ranks
    paths = {r: rank_path(step_dir, r, suffix) for r in wanted}
    for r, p in paths.items():
        if not p.is_file():
            raise CheckpointRankError(
                f"{step_dir} was written by {world} ranks but the file of rank {r} is missing: {p}",
                rank=r,
            )
    saved = SavedStep(step_dir, [])
    states: dict[int, dict[str, Any]] = {}
    if suffix == ".pt":
        for r, p in paths.items():
            states[r] = torch.load(p, map_location="cpu", mmap=True, weights_only=not allow_pickle)
    else:
        import dsio.checkpoint
        from dsio import run_sync
        from dsio.handle import AsyncIOHandle

        async def open_all() -> tuple[Any, dict[int, Any]]:
            io = AsyncIOHandle(dsio.checkpoint.DEFAULT_IO)
            try:
                loaded = await wait_all(
                    (
                        dsio.checkpoint.load(p, handle=io, lazy_from=1, allow_pickle=allow_pickle)
                        for p in paths.values()
                    ),
                    drain=True,
                )
            except BaseException:  # every load has ended: none still reads through io
                await io.aclose()
                raise
            return io, dict(zip(paths, loaded, strict=True))

        saved.handle, states = run_sync(open_all())
    for r, p in paths.items():
        state = states[r]
        raw = state.get("layout") if isinstance(state, dict) else None
        if not isinstance(raw, str):
            saved.close()
            raise ReshapeError(
                f"{p} records no layout (written before dstrain recorded one): it loads only into "
                "the world size, stage and offload it was saved with"
            )
        saved.files.append(SavedFile(r, p, state, Layout.from_json(raw, str(p))))
    return saved


def _sources(
    saved: SavedStep, want: list[Segment], prefer: int, where: str
) -> Iterator[tuple[int, int, int, int, int]]:
    """For each wanted segment: ``(offset here, rank, saved group, saved master offset, length)``
    pieces that cover it, preferring rank ``prefer``'s file where several hold the same elements."""
    index = saved.index()
    for s in want:
        pieces = sorted(index.get(s.name, ()), key=lambda p: (p[0], p[2] != prefer))
        cursor, end = s.start, s.start + s.length
        for start, stop, rank, gi, moff in pieces:
            if cursor >= end:
                break
            if start <= cursor < stop:
                n = min(stop, end) - cursor
                yield s.offset + cursor - s.start, rank, gi, moff + cursor - start, n
                cursor += n
        if cursor < end:
            raise ReshapeError(f"{where}: no saved file holds elements [{cursor}, {end}) of {s.name}")


def _view_of(views: list[int], offset: int) -> tuple[int, int]:
    """(index of the view holding master element ``offset``, that view's first element)."""
    pos = 0
    for i, n in enumerate(views):
        if offset < pos + n:
            return i, pos
        pos += n
    raise ReshapeError(f"master element {offset} lies past the views {views}")


def _stepper_state(f: SavedFile) -> dict[Any, Any]:
    st = f.state.get("stepper") or {}
    return st.get("state") or {}


def native_state(
    saved: SavedStep, mine: Layout, *, my_stepper_groups: list[int], where: str, optimizer: bool = True
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(``zero``'s state, the stepper's torch-format state or None without one) for the rank ``mine``
    describes, as `Assembled` lazy sources over ``saved``'s files.

    ``my_stepper_groups``: how many tensors (views) each of this rank's param groups steps;
    ``optimizer`` False: no stepper state (`Engine.load_checkpoint`'s ``load_optimizer_states``)."""
    home = saved.files[mine.rank % saved.world_size]
    check_same_model(saved.params(), mine.params, where)
    if len(home.layout.numels) != len(mine.numels):
        raise ReshapeError(
            f"{where} has {len(home.layout.numels)} param groups per rank, this engine "
            f"{len(mine.numels)}: the model's parameters are grouped differently"
        )
    pinned = sorted(set(home.layout.pinned) | set(mine.pinned))
    if pinned:
        raise ReshapeError(
            f"{where} was saved at world size {home.layout.world_size}, ZeRO stage {home.layout.stage}; this "
            f"engine runs world size {mine.world_size}, stage {mine.stage}: the parts {pinned} are laid out "
            "per rank (MoE experts over the expert-parallel group, pipeline stages) and are not resharded; "
            "load it with the shape it was saved with"
        )
    by_rank = {f.rank: f for f in saved.files}
    io = saved.handle

    def master(gi: int, seg_src: list[tuple[int, int, int, int, int]]) -> Assembled:
        pieces = [
            (here * _F32, n * _F32, by_rank[r].state["zero"]["master"][sg], moff * _F32)
            for here, r, sg, moff, n in seg_src
        ]
        return Assembled(torch.float32, (mine.numels[gi],), pieces, io)

    plans = [list(_sources(saved, segs, home.rank, where)) for segs in mine.segments]
    zero_state = {
        "stage": mine.stage,
        "world_size": mine.dp_size,
        "master": [master(gi, plan) for gi, plan in enumerate(plans)],
    }
    saved_opt = home.state.get("stepper")
    if not optimizer or saved_opt is None or "param_groups" not in saved_opt:
        return zero_state, None
    if any(f.layout.stepper != "torch" for f in saved.files):
        raise ReshapeError(
            f"{where}: its optimizer state is per rank (e.g. 1-bit / 0-1 Adam's error feedback), saved at "
            f"world size {home.layout.world_size}, ZeRO stage {home.layout.stage}; this engine runs world size "
            f"{mine.world_size}, stage {mine.stage}: load it with the shape it was saved with, or with "
            "load_optimizer_states=False"
        )
    if mine.stepper != "torch":
        raise ReshapeError(
            f"{where}: this engine's optimizer keeps per-rank state and cannot take state saved at world size "
            f"{home.layout.world_size}, stage {home.layout.stage} (pass load_optimizer_states=False)"
        )
    kinds, scalars = _state_kinds(saved, where)
    state: dict[int, dict[str, Any]] = {}
    vi = 0
    for gi, plan in enumerate(plans):
        pieces: dict[str, list[tuple[int, int, Any, int]]] = {k: [] for k in kinds}
        for here, r, sg, moff, n in plan:
            f = by_rank[r]
            views = f.layout.views
            first = sum(len(v) for v in views[:sg])
            entries = _stepper_state(f)
            pos, left = moff, n
            while left:
                j, vstart = _view_of(views[sg], pos)
                k = min(left, vstart + views[sg][j] - pos)
                entry = entries.get(first + j)
                if entry is not None:
                    for kind in kinds:
                        if kind not in entry:
                            raise ReshapeError(f"{where}: optimizer state entry {first + j} lacks {kind!r}")
                        dest = here + (pos - moff)
                        pieces[kind].append((dest * _F32, k * _F32, entry[kind], (pos - vstart) * _F32))
                pos += k
                left -= k
        vpos = 0
        for n in mine.views[gi]:
            if kinds or scalars:
                state[vi] = {key: value.clone() for key, value in scalars.items()}
                for kind in kinds:
                    cut = _cut(pieces[kind], vpos * _F32, n * _F32)
                    state[vi][kind] = Assembled(torch.float32, (n,), cut, io)
            vi += 1
            vpos += n
    groups = []
    start = 0
    for g, count in zip(saved_opt["param_groups"], my_stepper_groups, strict=True):
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + count))}
        )
        start += count
    return zero_state, {"state": state, "param_groups": groups}


def _cut(pieces: list[tuple[int, int, Any, int]], lo: int, n: int) -> list[tuple[int, int, Any, int]]:
    """``pieces`` (byte offset, bytes, source, source offset) clipped to ``[lo, lo + n)``, rebased to ``lo``."""
    out = []
    for here, k, src, there in pieces:
        a, b = max(here, lo), min(here + k, lo + n)
        if a < b:
            out.append((a - lo, b - a, src, there + a - here))
    return out


def _state_kinds(saved: SavedStep, where: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(the per-element state keys, e.g. ``exp_avg`` and ``exp_avg_sq``: fp32 tensors shaped like their
    view; the other entries, e.g. ``step``, equal for every view) of the saved optimizer state."""
    from dstrain.checkpoint.sources import materialize

    for f in saved.files:
        entries = _stepper_state(f)
        views = [n for g in f.layout.views for n in g]
        for i, entry in entries.items():
            kinds, scalars = [], {}
            for key, value in entry.items():
                shape = tuple(value.shape) if isinstance(value, torch.Tensor | LazyTensor) else None
                if shape == (views[int(i)],) and shape != ():
                    if value.dtype != torch.float32:
                        raise ReshapeError(f"{where}: optimizer state {key!r} is {value.dtype}, not float32")
                    kinds.append(key)
                else:
                    v = materialize(value)
                    scalars[key] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
            return kinds, scalars
    return [], {}
