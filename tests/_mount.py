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
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


#: In the child: where each test's reports go (one JSON object per line), read back by the parent.
REPORT_ENV = "DSIO_TEST_MOUNT_REPORT"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Plugin hook, active only in the namespaced child (loaded there with ``-p _mount``)."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2]).removeprefix("Skipped: ")
    else:
        text = report.longreprtext
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
            )
        )
        f.write("\n")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one test did in the namespaced child."""

    outcome: str  # "passed" | "failed" | "skipped"
    text: str


def require_namespace() -> None:
    """Skip (or fail under CI) saying how to enable it, when ``unshare -Urm`` cannot mount here."""
    why = userns_unavailable_reason()
    if why:
        skip_or_fail(f"this test mounts a filesystem and we are not root; {why}; {ENABLE_HINT}")


def run_in_namespace(nodeids: list[str], basetemp: Path) -> tuple[dict[str, Outcome], str]:
    """Run ``nodeids`` in ONE child pytest under ``unshare -Urm`` (one interpreter start for all of them).

    Returns each test's outcome (failed if any phase failed, else skipped if skipped, else passed) and the
    child's output. Skips (or fails under CI) when user namespaces are not available here.
    """
    require_namespace()
    report = basetemp / "reports.jsonl"
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, **{IN_NAMESPACE_ENV: "1", REPORT_ENV: str(report)})
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = ["unshare", "-Urm", sys.executable, "-m", "pytest", "-q", "-p", "_mount", "-p", "no:cacheprovider"]
    cmd += [f"--basetemp={basetemp / 'tmp'}", *nodeids]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out: dict[str, Outcome] = {}
    lines = report.read_text().splitlines() if report.is_file() else []
    for line in lines:
        rec = json.loads(line)
        prev = out.get(rec["nodeid"])
        if prev is not None and prev.outcome == "failed":
            continue
        if rec["outcome"] == "failed" or (prev is None or rec["outcome"] == "skipped"):
            out[rec["nodeid"]] = Outcome(rec["outcome"], rec["text"])
    return out, r.stdout + r.stderr


def mirror(nodeid: str, results: dict[str, Outcome], output: str) -> None:
    """Make this (parent) test end as ``nodeid`` did in the child."""
    res = results.get(nodeid)
    if res is None:
        pytest.fail(f"`unshare -Urm` child reported nothing for {nodeid}:\n{output[-6000:]}", pytrace=False)
    if res.outcome == "skipped":
        skip_or_fail(f"inside `unshare -Urm`: {res.text}")
    if res.outcome == "failed":
        pytest.fail(f"inside `unshare -Urm`:\n{res.text[-6000:]}", pytrace=False)
