"""The on-disk commit protocol of a checkpoint directory.

    run1/
      writer.lock                flock'ed by the one writer; holds its pid and host
      step-000001100/            committed: manifest.json + rank-00000.safetensors ...
      step-000001200/
      step-000001300.tmp/        being written (or left by a crash: removed by the next writer)
      latest                     "step-000001200\\n", replaced atomically

A step becomes visible only by a rename into ``step-N`` after every file in it and the directory
itself were fsynced; the parent directory is fsynced after each rename, and ``latest`` is
replaced by write-temp + fsync + rename + fsync of the parent.

Re-saving a committed step swaps the new directory in with ``renameat2(RENAME_EXCHANGE)``, so
``step-N`` names a complete step at every instant. Where the filesystem cannot exchange, the old
copy is first renamed to ``step-N.old.tmp`` (complete, and still listed and loadable under that
name), then the new one into ``step-N``; the next writer restores ``.old.tmp`` if a crash left
``step-N`` missing. Anything else ending in ``.tmp`` is garbage by definition: retention renames
a step to ``step-N.del.tmp`` (atomic) before deleting it, so a crash mid-delete never leaves a
half-deleted step that looks committed, and a ``.old.tmp`` is only ever a complete copy.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointFormatError
from . import _fs

__all__ = [
    "LATEST",
    "LOCK",
    "MANIFEST",
    "StepVisibleError",
    "commit",
    "committed_steps",
    "read_latest",
    "read_manifest",
    "recover",
    "remove_trees",
    "retire",
    "step_name",
    "tmp_name",
    "write_latest",
    "write_manifest",
]

LATEST = "latest"
MANIFEST = "manifest.json"
LOCK = "writer.lock"
#: A manifest is a few hundred bytes per rank; anything bigger than this is not one.
MAX_MANIFEST_BYTES = 16 << 20
#: ``latest`` holds one step name.
MAX_LATEST_BYTES = 64
_STEP = re.compile(r"^step-(\d{9,18})$")
_OLD = re.compile(r"^step-(\d{9,18})\.old\.tmp$")


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def tmp_name(step: int) -> str:
    return step_name(step) + ".tmp"


def old_name(step: int) -> str:
    """A committed copy displaced by a re-save where the filesystem cannot exchange names."""
    return step_name(step) + ".old.tmp"


def _del_name(name: str) -> str:
    return f"{name}.{os.getpid()}.del.tmp"


def _is_step_dir(root: str, name: str) -> bool:
    """``root/name`` is a real directory (not a link) holding a regular ``manifest.json``."""
    try:
        if not stat.S_ISDIR(os.lstat(os.path.join(root, name)).st_mode):
            return False
        return stat.S_ISREG(os.lstat(os.path.join(root, name, MANIFEST)).st_mode)
    except OSError:
        return False


def committed_steps(root: str) -> list[int]:
    """Committed steps, oldest first: ``step-N`` directories with a manifest, and a ``.old.tmp``
    copy of a step whose re-save was interrupted (its only copy)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    present = set(names)
    out = set()
    for name in names:
        m = _STEP.match(name)
        if m and _is_step_dir(root, name):
            out.add(int(m.group(1)))
            continue
        m = _OLD.match(name)
        if m and step_name(int(m.group(1))) not in present and _is_step_dir(root, name):
            out.add(int(m.group(1)))
    return sorted(out)


def step_dirs(step: int) -> tuple[str, str]:
    """Where a committed step may be found, in order: its name, then its displaced copy."""
    return step_name(step), old_name(step)


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    tmp = os.path.join(directory, f"{MANIFEST}.{os.getpid()}.tmp")
    _fs.write_durable(tmp, data)
    _fs.rename(tmp, os.path.join(directory, MANIFEST))


def _plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def read_manifest(dir_fd: int, label: str) -> dict[str, Any]:
    """The validated manifest of the step directory ``dir_fd`` (``label`` names it in errors).

    A missing manifest is ``FileNotFoundError``; anything malformed, oversized or not a regular
    file is ``CheckpointFormatError``.
    """
    what = f"{label}/{MANIFEST}"
    fd = _fs.open_regular(MANIFEST, dir_fd=dir_fd, what=what)
    with _fs.fd_closing(fd):
        raw = _fs.read_bounded(fd, MAX_MANIFEST_BYTES, what)
    try:
        m = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointFormatError(f"{what}: not valid JSON") from None
    if not isinstance(m, dict):
        raise CheckpointFormatError(f"{what}: not a JSON object")
    ws, files = m.get("world_size"), m.get("files")
    if type(ws) is not int or ws < 1 or not isinstance(files, list):
        raise CheckpointFormatError(f"{what}: lacks a positive int 'world_size' or a 'files' list")
    for f in files:
        if (
            not isinstance(f, dict)
            or type(f.get("bytes")) is not int
            or f["bytes"] < 0
            or type(f.get("rank")) is not int
            or not _plain_name(f.get("path"))
        ):
            raise CheckpointFormatError(
                f"{what}: malformed file entry (needs int rank, int bytes, plain path)"
            )
    return m


def read_latest(root: str) -> int | None:
    """The step ``latest`` names, if it names a committed one; a malformed pointer is an error."""
    what = os.path.join(root, LATEST)
    try:
        fd = _fs.open_regular(what, what=what)
    except FileNotFoundError:
        return None
    with _fs.fd_closing(fd):
        raw = _fs.read_bounded(fd, MAX_LATEST_BYTES, what)
    m = _STEP.match(raw.decode("ascii", "replace").strip())
    if not m:
        raise CheckpointFormatError(f"{what} does not name a step directory ({len(raw)} bytes)")
    step = int(m.group(1))
    return step if step in committed_steps(root) else None


def write_latest(root: str, step: int) -> None:
    tmp = os.path.join(root, f"{LATEST}.{os.getpid()}.tmp")
    _fs.write_durable(tmp, (step_name(step) + "\n").encode())
    _fs.rename(tmp, os.path.join(root, LATEST))
    _fs.fsync_dir(root)


class StepVisibleError(OSError):
    """The step was renamed into place but that could not be made durable, nor undone: it is
    listed (committed) although the commit failed."""


def _durable_or_undo(root: str, undo: Callable[[], None]) -> None:
    """fsync ``root`` after a rename that made a step visible; on failure undo the rename, so
    that the error ("not committed") is true, or say that the step stayed visible."""
    try:
        _fs.fsync_dir(root)
    except OSError as e:
        try:
            undo()
        except OSError:
            raise StepVisibleError(e.errno, f"step left in place, not confirmed durable: {e.strerror}") from e
        raise


def _dispose(path: str, root: str) -> None:
    """Move a displaced copy out of the way and delete it; failures only leave garbage (*.tmp)."""
    doomed = os.path.join(root, _del_name(os.path.basename(path)))
    try:
        _fs.rename(path, doomed)
        _fs.remove_tree(doomed)
    except OSError:
        pass


def commit(root: str, step: int) -> None:
    """Make ``step-N.tmp`` (its files and manifest fsynced) the committed ``step-N``.

    Raises (with nothing of the new step visible) when it cannot, or ``StepVisibleError`` when
    the step is in place but that could not be confirmed nor undone. ``latest`` is not touched
    here (``write_latest``).
    """
    tmp = os.path.join(root, tmp_name(step))
    final = os.path.join(root, step_name(step))
    _fs.fsync_dir(tmp)
    if not os.path.lexists(final):
        _fs.rename(tmp, final)
        _durable_or_undo(root, lambda: _fs.rename(final, tmp))
        return
    # The same step saved again. Atomic where the filesystem can: the old copy ends up as .tmp.
    if _fs.exchange(tmp, final):
        _durable_or_undo(root, lambda: _undo_exchange(tmp, final))
        _dispose(tmp, root)
        return
    old = os.path.join(root, old_name(step))
    if os.path.lexists(old):  # a stale copy (step-N exists, so it is not the only one)
        _fs.remove_tree(old)
    _fs.rename(final, old)  # still listed and loadable as step N under this name
    try:
        _fs.rename(tmp, final)
    except OSError:
        with contextlib.suppress(OSError):  # else .old.tmp stays listed; the next writer restores it
            _fs.rename(old, final)
        raise

    def undo() -> None:
        _fs.rename(final, tmp)
        _fs.rename(old, final)

    _durable_or_undo(root, undo)
    _dispose(old, root)


def _undo_exchange(tmp: str, final: str) -> None:
    if not _fs.exchange(tmp, final):
        raise OSError(errno.EINVAL, "cannot exchange back", final)


def recover(root: str) -> list[str]:
    """A new writer's clean-up (under the lock): restore the committed copy of a step whose
    re-save was interrupted, and remove everything else a crash can leave (``*.tmp``).

    Never removes the only copy of a committed step, in particular of the one ``latest`` names.
    Returns what was removed or restored.
    """
    names = os.listdir(root)
    present = set(names)
    changed: list[str] = []
    for name in sorted(names):
        m = _OLD.match(name)
        if m and step_name(int(m.group(1))) not in present and _is_step_dir(root, name):
            final = step_name(int(m.group(1)))
            _fs.rename(os.path.join(root, name), os.path.join(root, final))
            present.add(final)
            changed.append(f"{name} -> {final} (restored)")
    latest = _latest_name(root)
    for name in sorted(os.listdir(root)):
        if not name.endswith(".tmp"):
            continue
        if (
            latest is not None
            and name == latest + ".tmp"
            and latest not in present
            and _is_step_dir(root, name)
        ):
            # Complete (its manifest is written last) and named by latest: keep it, as the step.
            _fs.rename(os.path.join(root, name), os.path.join(root, latest))
            present.add(latest)
            changed.append(f"{name} -> {latest} (restored)")
            continue
        _fs.remove_tree(os.path.join(root, name))
        changed.append(name)
    if changed:
        _fs.fsync_dir(root)
    return changed


def _latest_name(root: str) -> str | None:
    try:
        fd = _fs.open_regular(os.path.join(root, LATEST))
    except (FileNotFoundError, CheckpointFormatError):
        return None
    with _fs.fd_closing(fd):
        try:
            raw = _fs.read_bounded(fd, MAX_LATEST_BYTES, LATEST)
        except CheckpointFormatError:
            return None
    text = raw.decode("ascii", "replace").strip()
    return text if _STEP.match(text) else None


def retire(root: str, keep_last: int | None, protect: set[int]) -> list[str]:
    """Retire the oldest committed steps beyond ``keep_last`` (never those in ``protect``).

    Each is renamed to ``step-N.<pid>.del.tmp`` (atomic, so it stops being a step at once) and
    the directory is fsynced; the returned paths are what is left to delete (``remove_trees``),
    which can happen in the background: a crash before then leaves ``*.tmp``, removed later.
    """
    if keep_last is None:
        return []
    steps = [s for s in committed_steps(root) if os.path.isdir(os.path.join(root, step_name(s)))]
    doomed = [s for s in steps[: max(0, len(steps) - keep_last)] if s not in protect]
    out = []
    for s in doomed:
        dst = os.path.join(root, _del_name(step_name(s)))
        _fs.rename(os.path.join(root, step_name(s)), dst)
        out.append(dst)
    if out:
        _fs.fsync_dir(root)
    return out


def remove_trees(paths: list[str]) -> None:
    for p in paths:
        _fs.remove_tree(p)
