"""``Checkpointer``: async, crash-safe checkpoints of a training run, one directory per step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import aiofiles.os
import torch

from .. import _registry as _metrics  # the statistics registry, not the Prometheus layer
from ..config import IOConfig
from ..errors import ClosedError
from ..handle import AsyncIOHandle
from . import _commit
from ._api import DEFAULT_IO, file_metadata, into_targets, restore
from ._capture import Capture, TouchOrder
from ._dist import Coordinator
from ._errors import (
    CheckpointCommitError,
    CheckpointLockedError,
    LatestNotUpdatedError,
    StateChangedError,
    errno_of,
)
from ._finish import commit_or_discard, describe
from ._load import read_rank_file
from ._locate import rank_file
from ._lock import DirectoryLock
from ._results import CheckpointStatistics, SaveResult, snapshot
from ._state import flatten
from ._write import FileWriter, Staging

__all__ = ["CheckpointStatistics", "Checkpointer", "SaveResult"]

log = logging.getLogger("dsio.checkpoint")

# The commit's metadata work (manifest, renames, directory fsyncs, ``latest``) runs on a worker
# thread through aiofiles, so no fsync ever stalls the event loop.
_commit_off_loop = aiofiles.os.wrap


class Checkpointer:
    """Checkpoints of one run in ``directory``: ``step-000001200/`` per step, ``latest``, retention.

    ``task = await ckpt.save(step, state)`` returns once this rank's file is laid out (a few
    milliseconds: nothing is copied yet), and ``state``'s tensors are copied into pinned host memory
    in the background. **The caller may change no tensor of ``state`` until ``await
    ckpt.wait_staged()`` returns** (it waits for that copy; a training loop calls it right before
    its next optimizer step, so the copy overlaps the forward and backward passes); a change made
    through torch before then is detected and fails the save with `StateChangedError` rather than
    storing torn bytes. Python values of ``state`` (ints, strings, lists) are captured by
    ``save()`` itself. ``background_staging=False`` makes ``save()`` return only once the copy is
    done (then the state is free at once). ``await task`` returns a ``SaveResult`` once the files
    and directories are fsynced and the step is committed. Only one save is in flight
    at a time: ``save()`` first waits for the previous save to finish (that wait counts as
    blocked time in ``statistics()``); its failure is reported by its own task, not by the next
    ``save()``.

    Under an initialized ``torch.distributed`` group every rank must construct its
    ``Checkpointer`` and call ``save``/``load`` in the same order: each rank writes
    ``rank-NNNNN.safetensors`` of its own state, and rank 0 commits the step only after every
    rank's file is durable. The directory must be the same (shared) one on every rank.
    ``load`` reads the calling rank's file and refuses a checkpoint of another world size.

    ``copy_threads`` threads copy the state into the pinned staging region (what ``save()``
    blocks for); ``preallocate`` reserves each file's blocks (while the first tensors are copied)
    before any byte is written, so a full disk fails before the writes.

    ``keep_last`` keeps that many newest committed steps: after each commit older ones are
    renamed away at once (``steps()`` no longer lists them) and deleted on a worker thread,
    which the next ``save()``, ``wait()`` and ``aclose()`` wait for; ``None`` keeps all.

    One writer per directory: the first ``save()`` takes an exclusive lock on
    ``directory/writer.lock`` (held until ``close()``; another writer, in this process or
    another, gets ``CheckpointLockedError`` naming the holder's pid and host), and only then
    removes what a crashed writer left (``*.tmp``; an interrupted re-save's old copy is restored).
    Constructing a Checkpointer and loading take no lock and change nothing on disk, so an
    evaluator may read a directory that a training job is writing.
    """

    _closed = True  # until __init__ opens it: __del__ of a half-built Checkpointer does nothing

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int | None = None,
        *,
        config: IOConfig | None = None,
        allow_pickle: bool = False,
        process_group: Any = None,
        preallocate: bool = True,
        copy_threads: int = 2,
    ) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep_last = keep_last
        self.config = config or DEFAULT_IO
        self.allow_pickle = allow_pickle
        self.preallocate = preallocate
        self.copy_threads = copy_threads
        self._coord = Coordinator(process_group)
        self._lock = DirectoryLock(self.directory)
        self._writer_ready = False
        self._staging = Staging()
        self._handle: AsyncIOHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._save_lock: asyncio.Lock | None = None
        self._inflight: asyncio.Task[SaveResult] | None = None
        self._staged: asyncio.Future[None] | None = None
        self.staging_capture: Capture = Capture(0)
        """The last save's per-touch-set futures (see `save`'s ``touch_order``)."""
        self._bg_wait = 0.0
        self._cleanup: asyncio.Future[None] | None = None
        self._doomed: list[str] = []
        self._closed = False
        self._saves = self._failed = self._loads = 0
        self._last: dict[str, Any] = dict(
            step=None, wait=0.0, stage=0.0, blocked=0.0, write=0.0, bytes=0, tput=0.0
        )
        self._tot: dict[str, Any] = dict(blocked=0.0, stage=0.0, write=0.0, bytes=0, load=0.0, read=0)
        _metrics.track(self)  # dsio.metrics reads statistics() at scrape time (weak reference)

    # -- introspection --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._coord.rank

    @property
    def world_size(self) -> int:
        return self._coord.world_size

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return _commit.committed_steps(self.directory)

    def latest_step(self) -> int | None:
        """The step ``latest`` names, else the newest committed step, else None."""
        step = _commit.read_latest(self.directory)
        if step is None:
            steps = self.steps()
            step = steps[-1] if steps else None
        return step

    def statistics(self) -> CheckpointStatistics:
        return snapshot(
            self._saves,
            self._failed,
            self._loads,
            self._inflight is not None and not self._inflight.done(),
            self._last,
            self._tot,
            self._staging.nbytes,
        )

    # -- saving ----------------------------------------------------------------------------------
    def _io(self) -> AsyncIOHandle:
        if self._closed:
            raise ClosedError("the Checkpointer is closed")
        loop = asyncio.get_running_loop()
        if self._handle is None or self._loop is not loop:
            if self._handle is not None:
                self._handle.close()
            self._handle = AsyncIOHandle(self.config)
            self._loop = loop
            self._save_lock = asyncio.Lock()
        return self._handle

    def _become_writer_sync(self) -> None:
        """Rank 0: create the directory, take the writer lock, clean up after a crashed writer."""
        os.makedirs(self.directory, exist_ok=True)
        self._lock.acquire()
        try:
            changed = _commit.recover(self.directory)
        except BaseException:
            self._lock.release()
            raise
        if changed:
            log.warning(
                "dsio.checkpoint: cleaned up after a crashed writer in %s: %s", self.directory, changed
            )

    async def _become_writer(self) -> None:
        """Before the first save: rank 0 locks and recovers; every rank learns the outcome."""
        if self._writer_ready:
            return
        error: BaseException | None = None
        if self.rank == 0:
            try:
                await _commit_off_loop(self._become_writer_sync)()
            except BaseException as e:
                error = e
        verdict = await self._coord.broadcast(describe(error))
        if error is not None:
            raise error
        if verdict is not None:  # rank 0 could not become the writer: every rank refuses to save
            kind, pid, host, err, msg = verdict
            if kind == "locked":
                raise CheckpointLockedError(self.directory, pid, host)
            raise CheckpointCommitError(err, -1, f"rank 0 could not open {self.directory} for writing: {msg}")
        self._writer_ready = True

    async def save(
        self,
        step: int,
        state: Any,
        *,
        background_staging: bool = True,
        touch_order: TouchOrder | None = None,
    ) -> asyncio.Task[SaveResult]:
        """Lay out ``state``'s file for step ``step`` and return the task that makes it durable.

        With ``background_staging`` (the default) the copy (or, for a state holding `LazyTensor`
        sources, the streamed write) runs in the task: ``save()`` returns once the file is laid out,
        and the caller must leave ``state``'s tensors and sources unchanged until ``await
        wait_staged()`` returns (a training loop calls it right before its next optimizer step).
        Without a ``touch_order``, each tensor's torch version counter is recorded here and checked
        when staging ends: a tensor changed in between (an in-place op, ``copy_``, an optimizer
        step) fails the save with `StateChangedError` (changes that bypass torch's version counter,
        e.g. writes through ``.data``, a numpy view or a raw pointer, cannot be seen: don't).
        Blocked time is ``save()``'s own plus what ``wait_staged()`` waited. With
        ``background_staging=False``, ``save()`` returns once every tensor is copied, and the state
        may change at once.

        ``touch_order`` (`dsio.checkpoint.MemorySpan` / `FileSpan` sets, in the order the caller
        will change them) lets the caller change parts of ``state`` before staging is done: a
        streamed save reads its windows in that order, and ``staging_capture.future(i)`` resolves
        once nothing overlapping set ``i`` is read any more (all sets resolve when staging ends).

        Waits first for a save still in flight (and for a concurrent ``save()`` call on this
        Checkpointer to finish staging: two saves never share the staging region). Returns when
        ``state`` has been copied; raises here (nothing written, nothing committed) if the state
        cannot be stored. The task raises ``CheckpointCommitError`` (an ``OSError`` with
        ``errno``) when the step was not committed, ``LatestNotUpdatedError`` when it was but
        ``latest`` could not be updated.
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        io = self._io()
        assert self._save_lock is not None
        async with self._save_lock:
            await self._become_writer()
            await self._idle()
            capture = Capture(len(touch_order or ()))
            self.staging_capture = capture
            try:
                if background_staging:
                    return await self._stage_background(step, state, io, t0, touch_order, capture)
                return await self._stage(step, state, io, t0)
            finally:
                if not background_staging:
                    capture.resolve_all()

    def _writer(
        self,
        step: int,
        state: Any,
        io: AsyncIOHandle,
        tmpdir: str,
        touch_order: TouchOrder | None,
        capture: Capture | None,
    ) -> FileWriter:
        """This rank's file of ``step`` laid out (nothing copied yet)."""
        tensors, tree = flatten(state, allow_pickle=self.allow_pickle)
        os.makedirs(tmpdir, exist_ok=True)
        meta = file_metadata(tree, {"dsio.step": str(step), "dsio.rank": str(self.rank)})
        return FileWriter(
            io,
            os.path.join(tmpdir, rank_file(self.rank)),
            tensors,
            meta,
            self._staging,
            preallocate=self.preallocate,
            copy_threads=self.copy_threads,
            touch_order=touch_order,
            capture=capture,
        )

    async def _stage(self, step: int, state: Any, io: AsyncIOHandle, t0: float) -> asyncio.Task[SaveResult]:
        t_wait = time.perf_counter() - t0
        tmpdir = os.path.join(self.directory, _commit.tmp_name(step))
        writer: FileWriter | None = None
        try:
            writer = self._writer(step, state, io, tmpdir, None, None)
            await writer.stage()
        except BaseException as e:
            if writer is not None:
                await writer.abort()
            # The other ranks wait for this one's verdict: report the failure to them, and let
            # rank 0 remove the partial step before the error reaches the caller.
            task = asyncio.ensure_future(self._complete(step, None, tmpdir, 0.0, 0.0, e))
            task.add_done_callback(_retrieve)
            self._inflight = task
            await asyncio.wait([task])
            raise
        stage_s = writer.stage_seconds
        blocked = time.perf_counter() - t0
        self._inflight = asyncio.ensure_future(self._complete(step, writer, tmpdir, t_wait, blocked, None))
        self._last.update(wait=t_wait, stage=stage_s, blocked=blocked, stream=writer.buffer_bytes)
        self._staged = None
        self._bg_wait = 0.0
        self._tot["blocked"] += blocked
        self._tot["stage"] += stage_s
        return self._inflight

    async def _stage_background(
        self,
        step: int,
        state: Any,
        io: AsyncIOHandle,
        t0: float,
        touch_order: TouchOrder | None,
        capture: Capture,
    ) -> asyncio.Task[SaveResult]:
        t_wait = time.perf_counter() - t0
        tmpdir = os.path.join(self.directory, _commit.tmp_name(step))
        try:
            writer = self._writer(step, state, io, tmpdir, touch_order, capture)
        except BaseException as e:  # nothing staged: tell the other ranks, then the caller
            capture.resolve_all()
            task = asyncio.ensure_future(self._complete(step, None, tmpdir, 0.0, 0.0, e))
            task.add_done_callback(_retrieve)
            self._inflight = task
            await asyncio.wait([task])
            raise
        # The caller's promise (no change before wait_staged() returns) is checked, not trusted: a
        # touch-ordered save's owner changes sets as their futures resolve, so only without one.
        watched = None if touch_order else _Versions(writer.tensors)
        staged: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        blocked = time.perf_counter() - t0
        self._bg_wait = 0.0

        async def stage_then_complete() -> SaveResult:
            try:
                await writer.stage()
                changed = watched.changed() if watched is not None else []
                if changed:
                    raise StateChangedError(step, changed)
            except BaseException as e:
                await writer.abort()
                capture.resolve_all()
                staged.set_result(None)  # the state is free; the task reports the failure
                return await self._complete(step, None, tmpdir, t_wait, blocked, e)
            capture.resolve_all()
            staged.set_result(None)
            self._last.update(stage=writer.stage_seconds, stream=writer.buffer_bytes)
            self._tot["stage"] += writer.stage_seconds
            return await self._complete(step, writer, tmpdir, t_wait, blocked, None)

        self._staged = staged
        self._inflight = asyncio.ensure_future(stage_then_complete())
        self._last.update(wait=t_wait, blocked=blocked)
        self._tot["blocked"] += blocked
        return self._inflight

    async def wait_staged(self) -> float:
        """Wait until the save in flight no longer reads the caller's state (its staging is done);
        return the seconds waited (added to the save's blocked time). Never raises the save's error."""
        fut = self._staged
        if fut is None or fut.done():
            return 0.0
        t0 = time.perf_counter()
        await asyncio.shield(fut)
        waited = time.perf_counter() - t0
        self._bg_wait += waited
        self._last["blocked"] += waited
        self._tot["blocked"] += waited
        return waited

    async def _complete(
        self,
        step: int,
        writer: FileWriter | None,
        tmpdir: str,
        t_wait: float,
        blocked: float,
        staging_error: BaseException | None,
    ) -> SaveResult:
        t0 = time.perf_counter()
        error: BaseException | None = staging_error
        nbytes = 0
        if writer is not None:
            try:
                nbytes = await writer.finish()
            except BaseException as e:
                error = e
                await writer.abort()
        # Every rank's verdict, then rank 0 commits (or removes the partial step) and tells all.
        mine = None if error is None else (errno_of(error), f"rank {self.rank}: {error!r}")
        verdicts = await self._coord.all_gather(mine)
        failures = [v for v in verdicts if v is not None]
        outcome: tuple[str, int | None, str, int | None] | None = None
        if self.rank == 0:
            outcome, self._doomed = await _commit_off_loop(commit_or_discard)(
                self.directory, self.world_size, self.keep_last, step, tmpdir, failures
            )
            if self._doomed:  # deleting gigabytes takes a while: off the save's critical path
                self._cleanup = asyncio.ensure_future(_commit_off_loop(_commit.remove_trees)(self._doomed))
        outcome = await self._coord.broadcast(outcome)
        if outcome is not None:
            kind, err, msg, previous = outcome
            if kind == "latest":  # committed, but latest still names the step before
                self._saves += 1
                self._last.update(step=step)
                raise LatestNotUpdatedError(err, step, msg, previous)
            if error is None:
                error = CheckpointCommitError(err, step, msg)
        if error is not None:
            self._failed += 1
            raise error
        write_s = time.perf_counter() - t0
        stage_s = writer.stage_seconds if writer is not None else 0.0
        self._saves += 1
        tput = nbytes / (stage_s + write_s) if stage_s + write_s > 0 else 0.0
        self._last.update(step=step, write=write_s, bytes=nbytes, tput=tput)
        self._tot["write"] += write_s
        self._tot["bytes"] += nbytes
        return SaveResult(
            step,
            os.path.join(self.directory, _commit.step_name(step)),
            nbytes,
            blocked + self._bg_wait,
            write_s,
        )

    async def _idle(self) -> None:
        """Wait (without raising) for the save in flight and the deletion of retired steps."""
        pending = [f for f in (self._inflight, self._cleanup) if f is not None and not f.done()]
        if pending:
            await asyncio.wait(pending)

    async def wait(self) -> SaveResult | None:
        """Wait for the save in flight (if any) and for retired steps to be deleted; return the
        save's result (or raise its error)."""
        await self._idle()
        task = self._inflight
        if task is None:
            return None
        return await task

    # -- loading ---------------------------------------------------------------------------------
    async def load(
        self,
        step: int | None = None,
        *,
        device: str | torch.device = "cpu",
        verify: bool = True,
        allow_pickle: bool | None = None,
        lazy_from: int | None = None,
        into: Any = None,
    ) -> Any:
        """The state saved at ``step`` (default: the latest committed) by this rank.

        The loaded CPU tensors are views of one allocation per file (read in a few large requests,
        like a raw read of the file): any one of them keeps the memory of all of them alive, so
        ``clone()`` a tensor you keep once the rest is dropped (e.g. a ``step`` counter kept after
        the parameters were copied into a model).

        ``lazy_from``: tensors of at least that many bytes stay on disk, as
        `dsio.checkpoint.StoredTensor`s that their consumer reads piece by piece (checksums checked
        as it reads; the file stays open until they are all gone). CPU only.

        ``into``: a state of the structure that was saved (e.g. the dict given to ``save``, whose
        tensors are a model's and an optimizer's): the file's tensors are read into its tensors in
        place, and the state returned holds those same tensor objects (its other values, e.g.
        counters and ``param_groups``, come from the file). No memory is allocated for the
        tensors: the load a resume usually wants (``load_state_dict`` then copies nothing new).
        Its tensors must match the file's by name (as ``save`` named them), dtype and shape
        (``CheckpointMismatchError`` otherwise) and be contiguous dense CPU tensors, no two sharing
        bytes (``TensorLayoutError``), checked before any byte is read. Every tensor is verified before
        ``load`` returns; on any error (``ChecksumError`` included) the tensors of ``into`` hold
        unspecified contents. Numpy arrays in it are filled too but come back as new arrays (as
        every load returns them). Not with ``lazy_from`` or another ``device``.

        Raises ``CheckpointNotFoundError`` when there is no such committed step (also when
        retention removes it while it is being opened),
        ``CheckpointMismatchError`` when it was written by a different world size,
        ``ChecksumError`` / ``CheckpointFormatError`` when its file is corrupt. Takes no lock.
        """
        if lazy_from is not None and torch.device(device).type != "cpu":
            raise ValueError(f"lazy_from leaves tensors on disk for the CPU; got device={device!r}")
        pickle_ok = self.allow_pickle if allow_pickle is None else allow_pickle
        targets = None if into is None else into_targets(into, device, lazy_from, pickle_ok)
        t0 = time.perf_counter()
        opened, header, tensors = await read_rank_file(
            self._io(),
            self.directory,
            step,
            self.latest_step,
            self.rank,
            self.world_size,
            verify=verify,
            lazy_from=lazy_from,
            into=targets,
        )
        state = restore(header, tensors, device=device, allow_pickle=pickle_ok, path=opened.path)
        self._loads += 1
        self._tot["load"] += time.perf_counter() - t0
        self._tot["read"] += opened.size
        return state

    # -- lifetime --------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Wait for the save in flight (its error stays with its task), then free everything."""
        await self._idle()
        if self._handle is not None:
            await self._handle.aclose()
        self.close()

    def close(self) -> None:
        """Free the I/O handle, the pinned staging region and the coordination thread."""
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._staging.release()
        self._coord.close()
        self._lock.release()
        _metrics.untrack(self)

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()


class _Versions:
    """The torch version counter of each in-memory tensor of a state, to tell whether any changed.

    Every in-place torch operation on a tensor (or on a view of it: views share the counter) bumps
    ``Tensor._version``; autograd relies on the same counter to refuse stale saved tensors."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._seen = [(n, t, t._version) for n, t in tensors.items() if isinstance(t, torch.Tensor)]

    def changed(self) -> list[str]:
        out = [n for n, t, v in self._seen if t._version != v]
        self._seen = []  # the tensors are the caller's again
        return out


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
