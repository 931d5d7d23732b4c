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
   pipeline's, the checkpoints'): their threads are joined now, not at finalization.

A script that called ``destroy_process_group()`` itself has nothing left for step 3.
"""

from __future__ import annotations

import atexit
import datetime
import logging
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
