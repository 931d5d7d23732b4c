"""Where engine checkpoints go: `DsioStore` over ``dsio.checkpoint.Checkpointer`` (the project's one
commit protocol), or the `TorchSaveStore` fallback for machines without dsio's native core.

A checkpoint directory holds committed steps, as written by ``Checkpointer``::

    save_dir/
      step-000000010/    manifest.json, rank-00000.safetensors, rank-00001.safetensors, ...
      latest             names the newest committed step
      writer.lock        one writer per directory (held by the engine's store until it closes)

`default_store` probes for dsio's native core and falls back, with the reason logged once, to
`TorchSaveStore`, which writes ``rank-NNNNN.pt`` files in the same layout. Loading picks the reader
from the files found in the step directory, so a ``.pt`` checkpoint stays loadable once dsio is there.

Every call is collective over the ranks of the world (each rank writes its own file). A save returns
a `PendingSave`. A synchronous save has committed by then. A background save returns at once: dsio
stages (copies the tensors into its pinned region, streams lazy sources such as swap files) while
training runs forward and backward; `PendingSave.wait_staged` blocks until the state is free to
change (the engine calls it right before the next optimizer step), `PendingSave.wait` until the
step is committed on every rank. (torch.save: a CPU snapshot is taken before returning.)
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from dstrain.checkpoint.agree import broadcast_object, gather_objects
from dstrain.checkpoint.pending import PendingSave
from dstrain.checkpoint.sources import materialize, release_sources
from dstrain.dist.comm import Comm
from dstrain.dist.groups import new_group
from dstrain.errors import CheckpointNotFoundError, DstrainError

if TYPE_CHECKING:
    from dsio.checkpoint import TouchOrder

__all__ = [
    "CheckpointStore",
    "DsioStore",
    "PendingSave",
    "TorchSaveStore",
    "committed_step_dir",
    "default_store",
    "load_any",
    "rank_file_in",
    "rank_file_name",
    "step_name",
    "validate_tag",
]

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d{9,})$")

LAZY_BYTES = 1 << 20
"""A streamed load leaves tensors of at least this many bytes in the file."""


def step_name(step: int) -> str:
    """The directory of a committed step (dsio.checkpoint's naming)."""
    return f"step-{step:09d}"


def rank_file_name(rank: int, suffix: str) -> str:
    """Rank ``rank``'s file in a step directory (``rank-00003.safetensors``; dsio.checkpoint's naming),
    for every store's ``suffix``."""
    return f"rank-{rank:05d}{suffix}"


class CheckpointStore(Protocol):
    """Saves and loads one rank's state dict as step ``step`` of a checkpoint directory."""

    suffix: str
    """Extension of this store's rank files."""

    allow_pickle: bool
    """Whether loads may unpickle (``torch.load(weights_only=False)``); False loads only tensors
    and plain data."""

    def save(
        self,
        directory: Path,
        step: int,
        state: dict[str, Any],
        world: Comm,
        *,
        background: bool,
        touch_order: TouchOrder | None = None,
    ) -> PendingSave:
        """Capture ``state`` and start writing it; with ``background`` False, finish before returning.
        ``touch_order``: what the caller will change next, in order (see `PendingSave.wait_captured`)."""
        ...

    def load(
        self, directory: Path, step: int, world: Comm, *, lazy: tuple[str, ...] = ()
    ) -> tuple[Path, dict[str, Any]]:
        """This rank's (file, state) of committed step ``step``; the top-level entries named in
        ``lazy`` may keep big tensors in the file (``dsio.checkpoint.StoredTensor``)."""
        ...

    def close(self) -> None:
        """Finish what is in flight and release locks, memory and threads."""
        ...


# -- locating committed steps (shared by both stores) -------------------------------------------


def latest_step(directory: Path) -> int | None:
    """The step ``latest`` names if it is committed, else the newest committed step, else None."""
    try:
        text = (directory / "latest").read_text(errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        text = ""
    m = _STEP.match(text)
    if m and (directory / text).is_dir():
        return int(m.group(1))
    steps = []
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    for name in names:
        m = _STEP.match(name)
        if m and (directory / name).is_dir():
            steps.append(int(m.group(1)))
    return max(steps) if steps else None


def rank_file_in(step_dir: Path, rank: int) -> Path | None:
    """This rank's file in a committed step directory (per dsio's manifest where there is one)."""
    manifest = step_dir / "manifest.json"
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text())["files"]
            name = next(e["path"] for e in entries if e.get("rank") == rank)
            return step_dir / name
        except (ValueError, KeyError, StopIteration, TypeError):
            pass
    for suffix in (".safetensors", ".pt"):
        candidate = step_dir / rank_file_name(rank, suffix)
        if candidate.is_file():
            return candidate
    return None


# -- dsio ---------------------------------------------------------------------------------------


class DsioStore:
    """Checkpoints through ``dsio.checkpoint.Checkpointer``: safetensors files with per-tensor crc32c,
    written through dsio's I/O engine, committed crash-safely, one writer per directory.

    One ``Checkpointer`` per directory, kept until `close` (it holds the directory's writer lock and the
    pinned staging region between saves). Its coroutines run on dsio's shared loop thread
    (``dsio.run_sync``). Raises ``BackendUnavailableError`` at construction where dsio's native core is
    not built.
    """

    suffix = ".safetensors"

    def __init__(self, *, allow_pickle: bool = False, keep_last: int | None = None) -> None:
        import dsio
        import dsio.checkpoint
        from dsio import run_sync

        if not any(s.available for s in dsio.backend_status()):  # raises where _C is not built
            raise dsio.BackendUnavailableError("no dsio I/O backend works on this machine")
        self._ckpt_mod = dsio.checkpoint
        self._run = run_sync
        self.allow_pickle = allow_pickle
        self.keep_last = keep_last
        self._checkpointers: dict[str, Any] = {}
        self._group: Any = None

    def _checkpointer(self, directory: Path) -> Any:
        key = os.path.abspath(directory)
        ckpt = self._checkpointers.get(key)
        if ckpt is None:
            if dist.is_available() and dist.is_initialized() and self._group is None:
                # the checkpoints' own gloo group (collective, created once): a background save
                # coordinates on it while training runs its collectives on the others
                self._group = new_group(backend="gloo")
            ckpt = self._ckpt_mod.Checkpointer(
                key, keep_last=self.keep_last, allow_pickle=self.allow_pickle, process_group=self._group
            )
            self._checkpointers[key] = ckpt
        return ckpt

    def save(
        self,
        directory: Path,
        step: int,
        state: dict[str, Any],
        world: Comm,
        *,
        background: bool,
        touch_order: TouchOrder | None = None,
    ) -> PendingSave:
        ckpt = self._checkpointer(directory)
        # background: returns once the file is laid out, staging runs on dsio's loop meanwhile
        # (a streamed state in ``touch_order``'s order); else: returns once staged, committed below
        order = touch_order if background else None
        try:
            task = self._run(ckpt.save(step, state, background_staging=background, touch_order=order))
        except BaseException:
            release_sources(state)  # swap versions pinned for this save (dstrain.checkpoint.sources)
            raise
        capture = ckpt.staging_capture
        capture.when_over(lambda: release_sources(state))  # once staging ends, on any path
        expected = directory / step_name(step) / rank_file_name(world.rank, self.suffix)

        async def committed() -> Any:
            return await task

        def finish() -> Path:
            result = self._run(committed())
            return rank_file_in(Path(result.path), world.rank) or expected

        def staged() -> float:
            return float(self._run(ckpt.wait_staged()))

        pending = PendingSave(expected, finish, staged if background else None, capture)
        if not background:
            pending.wait()
        return pending

    def load(
        self, directory: Path, step: int, world: Comm, *, lazy: tuple[str, ...] = ()
    ) -> tuple[Path, dict[str, Any]]:
        ckpt = self._checkpointer(directory)
        try:
            state = self._run(ckpt.load(step, lazy_from=LAZY_BYTES if lazy else None))
        except self._ckpt_mod.CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(str(e)) from e
        if lazy and isinstance(state, dict):  # only the entries named stay in the file
            state = {k: v if k in lazy else materialize(v) for k, v in state.items()}
        path = rank_file_in(directory / step_name(step), world.rank)
        return path or directory / step_name(step), state

    def close(self) -> None:
        for ckpt in self._checkpointers.values():
            self._run(ckpt.aclose())
        self._checkpointers.clear()


# -- torch.save fallback ------------------------------------------------------------------------


def _snapshot(value: Any) -> Any:
    """A deep copy of a state's tensors on the CPU, so training can go on while it is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(v) for v in value)
    return value


class TorchSaveStore:
    """``torch.save`` files in the layout above, for machines without dsio's native core.

    Each rank writes ``step-N.tmp/rank-NNNNN.pt`` and fsyncs it; once every rank reported success,
    rank 0 commits the step through dsio's commit protocol (``dsio.checkpoint.commit_written``:
    manifest, fsyncs, rename into ``step-N``, ``latest``), the one every checkpoint directory uses.
    A failure on any rank fails the save on every rank and commits nothing. Loading uses
    ``weights_only=True`` (no arbitrary unpickling) unless ``allow_pickle`` is set, which
    ``client_state`` holding custom objects needs.
    """

    suffix = ".pt"

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle

    def save(
        self,
        directory: Path,
        step: int,
        state: dict[str, Any],
        world: Comm,
        *,
        background: bool,
        touch_order: TouchOrder | None = None,
    ) -> PendingSave:
        # ``touch_order`` needs no handling: the state is snapshotted before this returns
        from dsio.checkpoint import commit_written, step_tmp_dir, write_rank_file

        directory.mkdir(parents=True, exist_ok=True)
        tmp_dir = Path(step_tmp_dir(directory, step))
        name = rank_file_name(world.rank, self.suffix)
        lazy = state
        try:
            state = materialize(state)  # torch.save cannot stream lazy sources (swap files): read them
        finally:
            release_sources(lazy)  # the swap versions pinned for this save

        def write(state: dict[str, Any]) -> None:
            write_rank_file(tmp_dir / name, lambda f: torch.save(state, f))

        future: concurrent.futures.Future[None]
        if background:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dstrain-ckpt")
            future = pool.submit(write, _snapshot(state))
            pool.shutdown(wait=False)  # the thread exits once the write is done
        else:
            future = concurrent.futures.Future()
            try:
                write(state)
                future.set_result(None)
            except BaseException as e:
                future.set_exception(e)

        def finish() -> Path:
            error = future.exception()
            verdicts = gather_objects(world, None if error is None else f"rank {world.rank}: {error!r}")
            failures = [v for v in verdicts if v is not None]
            commit_error = None
            if world.rank == 0:
                names = [rank_file_name(r, self.suffix) for r in range(world.world_size)]
                try:  # with failures: nothing is committed, the partial step goes
                    commit_written(directory, step, names, failures=failures)
                except OSError as e:  # dsio's CheckpointCommitError (an OSError) among them
                    commit_error = f"rank 0 could not commit: {e!r}"
            outcome = broadcast_object(world, commit_error)
            if error is not None:
                raise error
            if failures or outcome is not None:
                raise DstrainError(f"checkpoint step {step} not committed: {'; '.join(failures) or outcome}")
            return directory / step_name(step) / name

        pending = PendingSave(directory / step_name(step) / name, finish)
        if not background:
            pending.wait()
        return pending

    def load(
        self, directory: Path, step: int, world: Comm, *, lazy: tuple[str, ...] = ()
    ) -> tuple[Path, dict[str, Any]]:
        path = directory / step_name(step) / rank_file_name(world.rank, self.suffix)
        if not path.is_file():
            raise CheckpointNotFoundError(f"no checkpoint file {path}")
        return path, torch.load(path, map_location="cpu", weights_only=not self.allow_pickle)

    def close(self) -> None:
        return None


def validate_tag(name: str, world: Comm, mode: str) -> None:
    """DeepSpeed's ``checkpoint.tag_validation``: Ignore, Warn or Fail when ranks save under different names."""
    if mode == "Ignore" or world.world_size == 1:
        return
    names = gather_objects(world, name)
    if len(set(names)) > 1:
        message = f"ranks save checkpoints under different tags: {names}"
        if mode == "Fail":
            raise DstrainError(message)
        log.warning(message)


# -- choosing and reading ------------------------------------------------------------------------


_fallback_logged = False


def default_store() -> CheckpointStore:
    """`DsioStore` where dsio's native core works here, else `TorchSaveStore` (the reason logged once)."""
    global _fallback_logged
    try:
        return DsioStore()
    except Exception as e:  # ImportError, dsio's BackendUnavailableError, ...
        if not _fallback_logged:
            log.warning(
                "dsio.checkpoint unavailable (%s: %s); checkpoints use torch.save", type(e).__name__, e
            )
            _fallback_logged = True
        return TorchSaveStore()


def committed_step_dir(directory: Path, step: int | None) -> tuple[Path, int]:
    """(directory, number) of committed step ``step`` of ``directory`` (None: the latest one);
    `CheckpointNotFoundError` when there is none."""
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {directory}")
    step_dir = directory / step_name(step)
    if not step_dir.is_dir():
        raise CheckpointNotFoundError(f"no committed step {step} in {directory}")
    return step_dir, step


def load_any(
    store: CheckpointStore, directory: Path, step: int | None, world: Comm, *, lazy: tuple[str, ...] = ()
) -> tuple[Path, dict[str, Any]]:
    """Load step ``step`` (default: the latest) with the store that wrote it (``.pt`` or dsio's).
    ``lazy``: top-level entries whose big tensors may stay in a dsio file (read by `restore`)."""
    step_dir, step = committed_step_dir(directory, step)
    found = rank_file_in(step_dir, world.rank)
    if found is not None and found.suffix != store.suffix:
        # written by the other kind of store (e.g. with torch.save before dsio was available here)
        pickle = store.allow_pickle
        other: CheckpointStore = (
            TorchSaveStore(allow_pickle=pickle) if found.suffix == ".pt" else DsioStore(allow_pickle=pickle)
        )
        try:
            return other.load(directory, step, world)  # all in memory: `other` closes its handle
        finally:
            other.close()
    return store.load(directory, step, world, lazy=lazy)
