"""Tests that need their own small filesystem (a full 8 MiB tmpfs, a ramfs without O_DIRECT).

Mounting needs CAP_SYS_ADMIN. As root (CI) the test mounts directly. As an ordinary user, where the kernel
allows unprivileged user namespaces, the whole test is re-run in a child pytest under ``unshare -Urm`` (a new
user + mount namespace in which this user is root and may mount tmpfs/ramfs; the mounts vanish with it), and
the outer test reports the child's outcome. Where neither works the test skips and says how to enable it;
under ``DSIO_CI=1`` (set by .ci/run) it fails instead, so CI never silently loses these tests.

Use::

    pytestmark = pytest.mark.needs_mount          # or on each test that uses such a fixture

    @pytest.fixture
    def small_fs(tmp_path):
        with mounted(tmp_path / "small", "tmpfs", "size=8m") as d:
            yield d
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

#: Set in the child pytest that runs inside the new namespace.
IN_NAMESPACE_ENV = "DSIO_TEST_IN_MOUNT_NS"
#: Under this variable (CI) a test that cannot get its mount fails instead of skipping.
CI_ENV = "DSIO_CI"
ROOT = Path(__file__).resolve().parent.parent

#: True while the fixtures of a ``needs_mount`` test are set up in a process that cannot mount: the test's
#: body runs in the namespaced child (tests/conftest.py's hooks set this), so :func:`mounted` only makes the
#: folder here.
deferred = False

ENABLE_HINT = (
    "run the tests as root, or allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ also "
    "sysctl kernel.apparmor_restrict_unprivileged_userns=0) so `unshare -Urm` works"
)


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``; under ``DSIO_CI=1`` fail instead (CI must run every test)."""
    if os.environ.get(CI_ENV):
        pytest.fail(f"{reason} ({CI_ENV}=1: CI must run this test, not skip it)")
    pytest.skip(reason)


def can_mount_directly() -> bool:
    """True as real root or inside a user namespace where we are root."""
    return os.geteuid() == 0


@functools.cache
def userns_unavailable_reason() -> str:
    """Why ``unshare -Urm`` cannot mount a tmpfs here, or "" when it can (probed once)."""
    exe = shutil.which("unshare")
    if exe is None:
        return "no `unshare` command (util-linux)"
    probe = (
        'd=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs "$d" && umount "$d"; rc=$?; rmdir "$d"; exit $rc'
    )
    try:
        r = subprocess.run([exe, "-Urm", "sh", "-c", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare -Urm` failed: {e}"
    if r.returncode != 0:
        return f"`unshare -Urm` cannot mount here: {(r.stderr.strip() or f'exit {r.returncode}')}"
    return ""


@contextmanager
def mounted(target: Path, fstype: str, options: str = "") -> Iterator[Path]:
    """Mount a fresh ``fstype`` at ``target`` (created) for the duration; unmount after.

    In a test marked ``needs_mount`` run by a user who cannot mount, nothing is mounted here (the test runs
    in a namespaced child that mounts for itself). Unmarked, where mounting fails, it skips (or fails under
    CI) with the reason.
    """
    target.mkdir(parents=True, exist_ok=True)
    if deferred:
        yield target
        return
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(target)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        skip_or_fail(f"cannot mount {fstype} here: {r.stderr.strip() or r.returncode}; {ENABLE_HINT}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)\b")
_SKIP_LINE = re.compile(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", re.M)


def run_in_namespace(nodeid: str, basetemp: Path) -> None:
    """Run one test (``nodeid``) in a child pytest under ``unshare -Urm``; mirror its outcome here.

    Passes when the child passed, fails with the child's output when it failed, skips with the child's
    reason when it skipped.
    """
    why = userns_unavailable_reason()
    if why:
        skip_or_fail(f"this test mounts a filesystem and we are not root; {why}; {ENABLE_HINT}")
    env = dict(os.environ, **{IN_NAMESPACE_ENV: "1"})
    cmd = [
        "unshare",
        "-Urm",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"--basetemp={basetemp}",
        nodeid,
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out = r.stdout + r.stderr
    counts = {k: int(n) for n, k in _SUMMARY.findall(out.splitlines()[-1] if out.strip() else "")}
    if r.returncode == 0 and counts.get("passed") == 1:
        return
    if r.returncode == 0 and counts.get("skipped") == 1:
        m = _SKIP_LINE.search(out)
        skip_or_fail(f"inside `unshare -Urm`: {m.group(1) if m else 'skipped'}")
    pytest.fail(
        f"in `unshare -Urm` the test did not pass (exit {r.returncode}):\n{out[-6000:]}", pytrace=False
    )
