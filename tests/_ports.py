"""A TCP port for a test's rendezvous (a gloo group's TCPStore, a metrics server) that no concurrent
launch of this machine picks too.

Binding port 0 and releasing it hands back a port of the kernel's ephemeral range, where the port can
be taken again before the launched process binds it: by another ``free_port()`` of a test session
running beside this one (pytest-xdist workers, other checkouts' suites) or as the local end of any
outgoing connection. Here the port comes from below the ephemeral range (never an outgoing
connection's), from this xdist worker's own residue class (two workers of one session never pick the
same port), at random within it (sessions side by side rarely do), and is bound once to check that
nothing listens on it now.
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port"]

_SPAN = 12_000  # ports below the ephemeral range that are used (20768-32767 with Linux's default range)
_FLOOR = 10_000  # never below: registered services cluster under it
_RANDOM = random.SystemRandom()  # not the random module's stream, which a test may have seeded


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker() -> tuple[int, int]:
    """(this xdist worker's index, the session's worker count); (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index % max(count, 1), max(count, 1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on now, chosen as the module docstring says (the kernel's port 0 where
    the ephemeral range leaves no room below it)."""
    top = _ephemeral_low()
    low = max(_FLOOR, top - _SPAN)
    index, count = _worker()
    if top - low >= 64 * count:
        candidates = range(low + index, top, count)
        for _ in range(64):
            port = _RANDOM.choice(candidates)
            if _bindable(port):
                return port
    with socket.socket() as s:  # no room below the ephemeral range (or all 64 tries taken): the kernel's
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
