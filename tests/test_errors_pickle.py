"""Every exception type defined anywhere in dsio and dstrain round-trips through pickle.

A multiprocessing pool (or a torch.distributed object collective) that receives an exception which pickles
but does not unpickle hangs or dies with an unrelated TypeError, so each type is found by walking both
packages (a new error module is covered without editing this file), built with a value for every argument
of its ``__init__``, pickled, unpickled and compared: same type, same message and args, same attributes
(and for OSError subclasses the same errno, strerror and filename).

The types to test are read from the source at collection (`_declared`: every collecting process, each
xdist worker, would otherwise import every module, transformers and torch.distributed.checkpoint among
them: ~5 CPU-s); the walk that imports every module runs in one test and must find exactly those.
"""

from __future__ import annotations

import ast
import builtins
import errno
import importlib
import inspect
import pickle
import pkgutil
from pathlib import Path

import pytest

import dsio
import dstrain


def _modules(pkg) -> list[str]:
    names = [pkg.__name__]
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            names.append(info.name)
    return names


def _exception_types() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules(dsio) + _modules(dstrain):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # an optional integration whose third-party package is not installed (transformers...): its
            # errors cannot reach anyone here. A missing dsio/dstrain module is a real failure.
            if (e.name or "").split(".")[0] in ("dsio", "dstrain"):
                raise
            continue
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def _declared() -> list[tuple[str, str]]:
    """(module, class) of every top-level class of dsio and dstrain whose bases reach a builtin exception,
    read from the source (nothing imported); a base is matched by its last name (``errors.DsioError``)."""
    classes: dict[tuple[str, str], set[str]] = {}
    for pkg in (dsio, dstrain):
        top = Path(pkg.__file__).parent
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(top.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[-1] == "__main__":
                continue
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef):
                    names = {
                        b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases
                    }
                    classes[(".".join(parts), node.name)] = names
    exceptions = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    found: set[tuple[str, str]] = set()
    grew = True
    while grew:
        grew = False
        for key, bases in classes.items():
            if key not in found and bases & exceptions:
                found.add(key)
                exceptions.add(key[1])
                grew = True
    return sorted(found)


DECLARED = _declared()


def test_the_source_scan_finds_every_exception_type_the_import_walk_finds() -> None:
    """The parametrization below comes from the source; the walk that imports every module is the truth."""
    walked = {(t.__module__, t.__qualname__) for t in _exception_types()}
    assert walked == set(DECLARED)


def _value(param: inspect.Parameter):
    """A distinctive value of the annotated type (annotations are strings: ``from __future__``)."""
    ann = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
    if "dict" in ann:
        return {0: {"capacity": 3}, 1: {"capacity": 4}}
    if "str" in ann or ann == "":
        return f"<{param.name}>"
    if "int" in ann:
        return errno.ENOSPC if param.name in ("err", "errno") else 11
    if "float" in ann:
        return 2.5
    if "bool" in ann:
        return True
    return f"<{param.name}>"


def _instance(cls: type[BaseException]) -> BaseException:
    init = cls.__init__
    if not inspect.isfunction(init):  # the builtin __init__ of Exception / OSError
        if issubclass(cls, OSError):
            return cls(errno.EIO, "I/O failed", "/some/file")
        return cls("something went wrong")
    args, kwargs = [], {}
    for p in list(inspect.signature(init).parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD:
            continue
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = _value(p)
        else:
            args.append(_value(p))
    return cls(*args, **kwargs)


def test_the_walk_finds_the_errors_that_did_not_unpickle() -> None:
    names = {f"{m}.{c}" for m, c in DECLARED}
    # dstrain.ConfigError(field, message) and CheckpointLockedError(directory, pid, host) both failed to
    # unpickle before exceptions rebuilt themselves from their state
    assert {"dstrain.errors.ConfigError", "dsio.checkpoint._errors.CheckpointLockedError"} <= names
    assert len(DECLARED) >= 30, names


@pytest.mark.parametrize("declared", DECLARED, ids=lambda d: f"{d[0]}.{d[1]}")
def test_exception_round_trips_through_pickle(declared: tuple[str, str]) -> None:
    cls = getattr(importlib.import_module(declared[0]), declared[1])
    assert isinstance(cls, type) and issubclass(cls, BaseException), declared
    exc = _instance(cls)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert back.args == exc.args
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)
    if isinstance(exc, OSError):
        assert (back.errno, back.strerror, back.filename) == (exc.errno, exc.strerror, exc.filename)
