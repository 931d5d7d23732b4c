"""Engine checkpoints: one file per rank under ``<dir>/<tag>/``, plus ``<dir>/latest`` naming the tag.

Storage goes through the small `CheckpointStore` interface. `default_store` probes for
``dsio.checkpoint`` (`DsioStore`: safetensors files with per-tensor crc32c, written through dsio's
I/O engine) and falls back, with a logged reason, to the ``torch.save`` stepping stone
(`TorchSaveStore`). Loading picks the reader from the file found, so either kind stays loadable.
Files are written to a temporary name, fsynced and renamed: a crash never leaves a torn file under
the final name, and ``latest`` is written only after every rank finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dstrain.dist.comm import Comm
from dstrain.errors import CheckpointNotFoundError, DstrainError

__all__ = [
    "CheckpointStore",
    "PendingSave",
    "DsioStore",
    "TorchSaveStore",
    "default_store",
    "load_rank_state",
    "save_rank_state",
    "snapshot",
]

log = logging.getLogger(__name__)


class CheckpointStore(Protocol):
    """Where one rank's state dict goes. ``suffix`` names its files (``.pt``, ``.safetensors``)."""

    suffix: str

    def write(self, path: Path, state: dict[str, Any]) -> None:
        """Durably and atomically store ``state`` at ``path``."""
        ...

    def read(self, path: Path) -> dict[str, Any]:
        """Return what `write` stored at ``path``."""
        ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TorchSaveStore:
    """``torch.save`` to a temporary file, fsync, rename. Loading uses ``weights_only=True`` (no arbitrary
    unpickling) unless ``allow_pickle`` is set, which ``client_state`` holding custom objects needs."""

    suffix = ".pt"

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle

    def write(self, path: Path, state: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def read(self, path: Path) -> dict[str, Any]:
        return torch.load(path, map_location="cpu", weights_only=not self.allow_pickle)


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion from synchronous code, also when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


class DsioStore:
    """``dsio.checkpoint``: a safetensors file per rank, crc32c per tensor, written through dsio's engine.

    Written to a temporary name and renamed, like `TorchSaveStore`. Raises ImportError (or dsio's
    ``BackendUnavailableError``) at construction where dsio or its native core is missing.
    """

    suffix = ".safetensors"

    def __init__(self, *, allow_pickle: bool = False) -> None:
        import dsio.checkpoint

        self._ckpt = dsio.checkpoint
        self.allow_pickle = allow_pickle

    def write(self, path: Path, state: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        _run(self._ckpt.save(_to_cpu(state), tmp, allow_pickle=self.allow_pickle, fsync=True))
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def read(self, path: Path) -> dict[str, Any]:
        return _run(self._ckpt.load(path, allow_pickle=self.allow_pickle))


_fallback_logged = False


def default_store() -> CheckpointStore:
    """`DsioStore` where dsio.checkpoint works here, else `TorchSaveStore` (the reason logged once)."""
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


def _rank_file(save_dir: Path, tag: str, rank: int, suffix: str) -> Path:
    return save_dir / tag / f"rank{rank:05d}{suffix}"


def _validate_tag(tag: str, comm: Comm, mode: str) -> None:
    if mode == "Ignore" or comm.world_size == 1:
        return
    tags: list[Any] = [None] * comm.world_size
    dist.all_gather_object(tags, tag, group=comm.group)
    if len(set(tags)) > 1:
        message = f"ranks save with different checkpoint tags: {tags}"
        if mode == "Fail":
            raise DstrainError(message)
        log.warning(message)


def snapshot(value: Any) -> Any:
    """A deep copy of a state's tensors on the CPU, so training can go on while it is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(v) for v in value)
    return value


class PendingSave:
    """This rank's checkpoint file, possibly still being written; `commit` finishes the save."""

    def __init__(
        self,
        future: concurrent.futures.Future[None],
        root: Path,
        tag: str,
        path: Path,
        save_latest: bool,
        comm: Comm,
    ) -> None:
        self.future = future
        self.root = root
        self.tag = tag
        self.path = path
        self.save_latest = save_latest
        self.comm = comm

    def commit(self) -> Path:
        """Wait for this rank's file; once every rank has its file, rank 0 points ``latest`` at the tag.

        A collective: every rank calls it.
        """
        self.future.result()
        self.comm.barrier()
        if self.save_latest and self.comm.rank == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(self.tag)
            with open(tmp) as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.root / "latest")
            _fsync_dir(self.root)
        self.comm.barrier()
        return self.path


def save_rank_state(
    store: CheckpointStore,
    save_dir: str | os.PathLike[str],
    tag: str,
    state: dict[str, Any],
    comm: Comm,
    *,
    save_latest: bool = True,
    tag_validation: str = "Warn",
    background: bool = False,
) -> PendingSave:
    """Every rank writes its ``state`` (on a background thread if ``background``; the caller must
    not change ``state`` until committed: see `snapshot`). Call `PendingSave.commit` to finish."""
    _validate_tag(tag, comm, tag_validation)
    root = Path(save_dir)
    (root / tag).mkdir(parents=True, exist_ok=True)
    path = _rank_file(root, tag, comm.rank, store.suffix)
    future: concurrent.futures.Future[None]
    if background:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dstrain-ckpt")
        future = pool.submit(store.write, path, state)
        pool.shutdown(wait=False)  # the thread exits once the write is done
    else:
        future = concurrent.futures.Future()
        store.write(path, state)
        future.set_result(None)
    return PendingSave(future, root, tag, path, save_latest, comm)


def load_rank_state(
    store: CheckpointStore, load_dir: str | os.PathLike[str], tag: str | None, comm: Comm
) -> tuple[Path, dict[str, Any]]:
    """This rank's state from ``<load_dir>/<tag>`` (``tag`` defaults to the content of ``latest``)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.exists():
            raise CheckpointNotFoundError(f"no tag given and no {latest}")
        tag = latest.read_text().strip()
    path = _rank_file(root, tag, comm.rank, store.suffix)
    if not path.exists():
        # written by the other kind of store (e.g. with torch.save before dsio was available here)
        for suffix in (".safetensors", ".pt"):
            candidate = _rank_file(root, tag, comm.rank, suffix)
            if candidate.exists():
                return candidate, _store_for(suffix, store).read(candidate)
        raise CheckpointNotFoundError(f"no checkpoint file {path}")
    return path, store.read(path)


def _store_for(suffix: str, like: CheckpointStore) -> CheckpointStore:
    pickle = bool(getattr(like, "allow_pickle", False))
    return DsioStore(allow_pickle=pickle) if suffix == ".safetensors" else TorchSaveStore(allow_pickle=pickle)
