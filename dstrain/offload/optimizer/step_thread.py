"""`StepThread`: the host side of sub-group steps taken during backward, off the backward thread.

With the fp32 master in host memory (ZeRO-Offload, `dstrain.offload.param.host_master`) a sub-group
stepped during the boundary backward (`dstrain.offload.optimizer.early_step`) is CPU work: the fused
Adam(W) kernel over its master, gradient, m and v (0.24 s a step for a 1.07B model at 16 threads on
the H200 machine). Run on the thread that also launches backward's kernels, it stalls the GPU for
that long. `OffloadAdam` hands each such step to this thread instead, so the host Adam runs while
backward goes on (torch's CPU kernels release the GIL: the overlap is real on two cores too).

- One worker, so jobs run in the order they were handed over (sub-groups are independent, so the
  results are bitwise those of stepping them on the caller: the same kernel over the same tensors).
- A bounded queue: `submit` waits while ``depth`` jobs are queued or running, so what a queued job
  holds (a swap buffer of m and v) stays bounded by the pools it came from.
- A failure is kept and raised as `StepThreadError` (its ``__cause__`` the original) by the next
  `submit` (during backward) or `join` (the optimizer step, before it steps the rest), once; jobs
  queued behind a failed one are dropped. If the worker itself ends (a ``BaseException`` in a job),
  waiting callers are told the same way at once, and the next `submit` starts another worker:
  nothing waits for a thread that is gone.
- `join` (at the end of every optimizer step's early part) waits until every job handed over is done;
  `close` joins, then ends the worker. The worker is a daemon: a process that never calls close()
  still exits; an optimizer dropped without close() ends it at collection (`stop`). At exit the jobs handed over first run to their end (bounded, `EXIT_WAIT_S`), before
  dsio's exit hook drains its loop: a job holds swap buffers and hands them back with the writes it
  submits, so a read waiting for one of those buffers would otherwise keep that drain waiting for
  its whole timeout (a minute), and the job's writes would find the loop closed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from dstrain.errors import StepThreadError

__all__ = ["StepThread"]

log = logging.getLogger(__name__)

_POLL_S = 0.5  # a waiting caller re-checks that the worker is alive this often

EXIT_WAIT_S = 30.0
"""At interpreter exit, how long the jobs still handed over may take to finish (each is one
sub-group's kernel and the submission of its writes)."""

_started: weakref.WeakSet[StepThread] = weakref.WeakSet()  # threads whose worker ran: finished at exit
_exit_hook = False


class StepThread:
    """One worker thread running sub-group steps in order, at most ``depth`` queued or running."""

    def __init__(self, depth: int = 2, name: str = "dstrain-offload-step") -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.depth = depth
        self._name = name
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = 0  # jobs queued or running
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None  # started by the first submit
        self.jobs_done = 0
        """Jobs run to completion so far."""

    @property
    def alive(self) -> bool:
        """Whether the worker is running (it starts at the first `submit`)."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (run with gradients off); waits while ``depth`` jobs are queued or running.
        Raises `StepThreadError` if an earlier job failed or the worker ended."""
        with self._cond:
            if self._stop:
                raise StepThreadError("the step thread is closed")
            self._raise_failure()
            if self._thread is None:
                _finish_at_exit(self)
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            while self._busy >= self.depth:
                self._wait()
            self._jobs.append(job)
            self._busy += 1
            self._cond.notify_all()

    def join(self) -> None:
        """Wait until every job handed over is done; raise `StepThreadError` for a failed one."""
        with self._cond:
            while self._busy:
                self._wait()
            self._raise_failure()

    def close(self) -> None:
        """Join (a failure not raised yet is logged, not raised), then end the worker."""
        with self._cond:
            while self._busy and self.alive:
                self._cond.wait(_POLL_S)
            self._stop = True
            self._cond.notify_all()
            error, self._error = self._error, None
        if self._thread is not None:
            self._thread.join()
        if error is not None:
            log.warning("a sub-group step on the step thread failed and was never raised: %r", error)

    def stop(self) -> None:
        """Let the worker end once nothing is queued, without waiting for it (its owner was dropped
        without `close`); a later `submit` raises `StepThreadError`."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the jobs handed over (never raises: at exit)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy and self.alive and time.monotonic() < deadline:
                self._cond.wait(_POLL_S)

    def _wait(self) -> None:
        """Wait for the worker (the condition held); raises at once if it failed or ended."""
        self._raise_failure()
        self._cond.wait(_POLL_S)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise StepThreadError(f"a sub-group step on the step thread failed: {error!r}") from error
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            self._jobs.clear()  # (a worker that ended without saying why: nothing left will run)
            self._busy = 0
            self._thread = None  # the next submit starts another
            raise StepThreadError("the step thread ended before finishing its sub-group steps")

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._jobs and not self._stop:
                        self._cond.wait()
                    if not self._jobs:  # stopped and nothing left
                        return
                    job = self._jobs.popleft()
                try:
                    with torch.no_grad():  # grad mode is per thread: the optimizer's steps take none
                        job()
                except Exception as e:  # kept for the caller; what is queued behind it is dropped
                    self._failed(e)
                    continue
                finally:
                    # the worker waits holding nothing of the job: its closure holds the optimizer,
                    # which a caller that drops it without close() expects to be collected
                    del job
                with self._cond:
                    self.jobs_done += 1
                    self._busy -= 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - the worker ends here: its callers are told why
            self._failed(e, ended=True)

    def _failed(self, error: BaseException, *, ended: bool = False) -> None:
        with self._cond:
            self._error = error
            self._jobs.clear()
            self._busy = 0
            if ended:
                self._thread = None  # the next submit starts another
            self._cond.notify_all()


def _finish_at_exit(thread: StepThread) -> None:
    """Let ``thread``'s jobs finish at interpreter exit, before dsio's exit hook drains its loop
    (threading's exit hooks run last registered first; dsio's is registered when its bridge is
    imported, which ``import dsio``'s ``is_exiting`` makes sure of before ours)."""
    global _exit_hook
    _started.add(thread)
    if _exit_hook:
        return
    from dsio import is_exiting  # noqa: F401  (dsio's exit hook registered first: ours runs before it)

    def finish() -> None:
        for t in list(_started):
            t._finish(EXIT_WAIT_S)

    with contextlib.suppress(AttributeError, RuntimeError):  # other interpreters / already exiting
        threading._register_atexit(finish)  # type: ignore[attr-defined]
    _exit_hook = True
