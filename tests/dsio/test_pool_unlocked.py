"""A pinned pool that cannot be locked (RLIMIT_MEMLOCK) is still resident from construction, as mlock
would have made it: its pages are faulted in up front, not as buffers are first used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, resource, sys
    from dsio.pool import PinnedPool  # imported first: nobody may not read the interpreter's files
    if os.geteuid() == 0:  # root bypasses RLIMIT_MEMLOCK (CAP_IPC_LOCK): become nobody
        os.setgid(65534); os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = rss()
    pool = PinnedPool(64 << 20, 1 << 20)
    grown = rss() - before
    assert not pool._mem.locked
    print(grown)
    """
)


def test_unlockable_pool_is_resident_from_construction() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= (64 << 20) * 0.95  # every page of the pool is resident
