"""The on-disk commit protocol of a checkpoint directory.

    run1/
      step-000001100/            committed: manifest.json + rank-00000.safetensors ...
      step-000001200/
      step-000001300.tmp/        being written (or left by a crash: removed at start)
      latest                     "step-000001200\\n", replaced atomically

A step becomes visible only by ``rename(step-N.tmp, step-N)`` after every file in it and the
directory itself were fsynced, and ``latest`` is replaced by write-temp + fsync + rename + fsync
of the parent. Anything ending in ``.tmp`` is garbage by definition: retention first renames a
step to ``step-N.old.tmp`` (atomic), then deletes it, so a crash mid-delete never leaves a
half-deleted step that looks committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

from ..errors import CheckpointFormatError

__all__ = [
    "LATEST",
    "MANIFEST",
    "clean_partials",
    "commit",
    "committed_steps",
    "fsync_dir",
    "fsync_file",
    "inside",
    "read_latest",
    "read_manifest",
    "remove_trees",
    "retire",
    "step_name",
    "tmp_name",
    "write_manifest",
]

LATEST = "latest"
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d{9,})$")


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def tmp_name(step: int) -> str:
    return step_name(step) + ".tmp"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(directory: str, name: str, data: bytes) -> None:
    tmp = os.path.join(directory, f"{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(directory, name))
    fsync_dir(directory)


def inside(root: str, name: str, what: str) -> str:
    """``root/name`` for a plain file name; anything that could point elsewhere is rejected."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        raise CheckpointFormatError(f"{what} names {name!r}, which is not a file inside {root}")
    path = os.path.join(root, name)
    real_root = os.path.realpath(root)
    if os.path.dirname(os.path.realpath(path)) != real_root:
        raise CheckpointFormatError(f"{what} names {name!r}, which resolves outside {root}")
    return path


def committed_steps(root: str) -> list[int]:
    """Steps whose directory is committed (renamed into place, with a manifest), oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = _STEP.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


def clean_partials(root: str) -> list[str]:
    """Remove everything a crash can leave behind (``*.tmp``); return what was removed."""
    removed = []
    for name in os.listdir(root):
        if not name.endswith(".tmp"):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        removed.append(name)
    if removed:
        fsync_dir(root)
    return removed


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    _atomic_write(directory, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read().decode())
    except FileNotFoundError:
        raise
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: not a valid manifest ({e})") from None
    if (
        not isinstance(m, dict)
        or not isinstance(m.get("files"), list)
        or type(m.get("world_size")) is not int
    ):
        raise CheckpointFormatError(f"{path}: manifest lacks 'world_size' or 'files'")
    for f in m["files"]:
        if not isinstance(f, dict) or type(f.get("bytes")) is not int:
            raise CheckpointFormatError(f"{path}: malformed file entry {f!r}")
        inside(directory, f.get("path"), f"manifest {path}")  # type: ignore[arg-type]
    return m


def commit(root: str, step: int) -> None:
    """Make ``step-N.tmp`` (already fsynced, with its manifest) the committed ``step-N`` and ``latest``."""
    tmp = os.path.join(root, tmp_name(step))
    final = os.path.join(root, step_name(step))
    fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again: the old copy becomes garbage first
        old = os.path.join(root, step_name(step) + ".old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
    _atomic_write(root, LATEST, (step_name(step) + "\n").encode())


def read_latest(root: str) -> int | None:
    """The step ``latest`` names, if it names a committed one; a malformed pointer is an error."""
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as f:
            text = f.read(256).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    m = _STEP.match(text)
    if not m:
        raise CheckpointFormatError(f"{path} names {text!r}, which is not a step directory of {root}")
    step = int(m.group(1))
    return step if os.path.isfile(os.path.join(root, text, MANIFEST)) else None


def retire(root: str, keep_last: int | None, protect: int) -> list[str]:
    """Retire the oldest committed steps beyond ``keep_last`` (never ``protect``).

    Each is renamed to ``step-N.old.tmp`` (atomic, so it stops being a step at once) and the
    directory is fsynced; the returned paths are what is left to delete (``remove_trees``),
    which can happen in the background: a crash before then leaves ``*.tmp``, removed at start.
    """
    if keep_last is None:
        return []
    steps = committed_steps(root)
    doomed = [s for s in steps[: max(0, len(steps) - keep_last)] if s != protect]
    out = []
    for s in doomed:
        old = os.path.join(root, step_name(s) + ".old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(os.path.join(root, step_name(s)), old)
        out.append(old)
    if out:
        fsync_dir(root)
    return out


def remove_trees(paths: list[str]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
