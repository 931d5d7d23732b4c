"""What dstrain tears down when the process exits, and in which order.

A script may never call ``engine.close()`` nor ``torch.distributed.destroy_process_group()``; it must
still exit 0. Left to the interpreter, the process groups outlive Python: gloo's worker threads still
hold the work of collectives and point-to-point messages (the pipeline's receives posted ahead, their
fillers), and when one completes during interpreter finalization, releasing its tensors takes the
GIL of an interpreter that is gone; the thread is unwound where C++ cannot unwind and the process
dies with SIGABRT ("terminate called without an active exception"). A rank that destroys its group
while a peer still sends to it makes the peer fail instead ("Connection closed by peer").

So the first `track` (every `dstrain.initialize`, and `dstrain.init_distributed` when it creates the
default group) registers one ``atexit`` hook that, while the interpreter is whole:

1. closes every engine still open (dsio's own exit hook, which runs before ``atexit``'s, has already
   finished pending background saves: dstrain.checkpoint's saves run on dsio's loop thread);
2. waits, on gloo, until every rank has got here (``monitored_barrier``, at most `EXIT_BARRIER_S`,
   so a rank that died does not hold the others), so no message is still in flight towards a rank
   that is going;
3. destroys the default process group, and with it every group made from it (the topology's, the
   pipeline's, the checkpoints'): their threads are joined now, not at finalization;
4. drops the references torch itself keeps to destroyed groups (`_forget_destroyed_groups`): a gloo
   group's threads are joined only when its last reference goes, not by ``destroy_process_group``, and
   ``torch.distributed.nn.functional``'s functions hold the default group in their default arguments
   (``group=group.WORLD``, evaluated at its import). That module is imported lazily, after the group
   exists (the first ``torch.optim.Adam(fused=True)``: initialize's optimizer), so the world group's
   threads outlived step 3 and aborted the README pipeline block at exit in one of many launches.

A script that called ``destroy_process_group()`` itself has nothing left for step 3; step 4 still runs.
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import logging
import sys
import threading
import weakref
from typing import Protocol

import torch.distributed as dist

__all__ = ["EXIT_BARRIER_S", "Closeable", "track", "track_process_group"]

log = logging.getLogger(__name__)

EXIT_BARRIER_S = 60.0
"""Longest wait at exit for the other ranks (gloo), in seconds."""


class Closeable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Closeable] = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def _hook() -> None:
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(_at_exit)
            _hooked = True


def track(engine: Closeable) -> None:
    """Close ``engine`` at exit if it is still open then (and tear down the process groups)."""
    _open.add(engine)
    _hook()


def track_process_group() -> None:
    """Tear down the process groups at exit (called when dstrain created the default group)."""
    _hook()


def _at_exit() -> None:
    for engine in list(_open):
        try:
            engine.close()
        except Exception as e:  # e.g. dsio's loop thread already drained: nothing left to finish there
            log.debug("dstrain: closing an engine at exit: %r", e)
    _open.clear()
    if not (dist.is_available() and dist.is_initialized()):
        _forget_destroyed_groups()
        return
    try:
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
    except Exception as e:  # a peer died or is stuck: do not wait for it, still join our threads
        log.warning("dstrain: not every rank reached exit within %.0f s: %r", EXIT_BARRIER_S, e)
    try:
        dist.destroy_process_group()
    except Exception as e:
        log.warning("dstrain: destroying the process group at exit failed: %r", e)
    _forget_destroyed_groups()


_HOLDS_GROUPS = ("torch.distributed.nn.functional",)
"""torch modules whose functions take ``group=group.WORLD``: the group of their import, kept for good."""


def _forget_destroyed_groups() -> None:
    """With no process group left, turn the default arguments of `_HOLDS_GROUPS`' functions that are
    process groups (destroyed ones) into None (the default group, as torch reads it), so that the last
    reference to the destroyed groups goes now and their gloo threads are joined while the
    interpreter is whole. No-op while a group is initialized."""
    if not dist.is_available() or dist.is_initialized():
        return
    for name in _HOLDS_GROUPS:
        module = sys.modules.get(name)
        if module is None:  # never imported: nothing holds a group there
            continue
        for fn in vars(module).values():
            if not inspect.isfunction(fn) or not fn.__defaults__:
                continue
            if any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
                fn.__defaults__ = tuple(
                    None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__
                )
