"""Nested training state <-> (named tensors, JSON structure).

``flatten`` walks dicts, lists and tuples (a model ``state_dict``, an optimizer ``state_dict``
with int keys and ``param_groups``, scheduler state, RNG states, counters) and returns the
tensors by name plus a JSON tree that records everything else, so ``unflatten`` rebuilds the
exact structure: dict key types and order, list vs tuple, ints vs floats, tensors shared between
two places (tied weights) stay shared.

JSON tree nodes: ``{"t": name}`` tensor, ``{"a": name}`` numpy array, ``{"v": x}`` JSON scalar,
``{"f": "nan"|"inf"|"-inf"}``, ``{"b": base64}`` bytes, ``{"d": [[key, node], ...]}`` dict,
``{"l": [...]}`` list, ``{"u": [...]}`` tuple, ``{"dt": "float32"}`` torch.dtype,
``{"sz": [...]}`` torch.Size, ``{"dev": "cpu"}`` torch.device, ``{"ns": [dtype, x]}`` numpy
scalar, ``{"p": base64}`` a pickled value (only with ``allow_pickle=True``).
"""

from __future__ import annotations

import base64
import math
import pickle
from collections import OrderedDict
from typing import Any

import torch

from ..errors import CheckpointFormatError, UnsupportedStateError
from ._format import dtype_name
from ._lazy import LazyTensor

__all__ = ["flatten", "unflatten"]

_SCALARS = (int, str, bool, type(None))
_KEY_TYPES = (int, str, bool, float, type(None))


def _np() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover
        return None


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor | LazyTensor] = {}
        self._seen: dict[tuple, str] = {}

    def _name(self, path: str) -> str:
        name = path or "tensor"
        if name in self.tensors:
            i = 1
            while f"{name}#{i}" in self.tensors:
                i += 1
            name = f"{name}#{i}"
        return name

    def _pickled(self, value: object, where: str, why: str) -> dict[str, Any]:
        if not self.allow_pickle:
            raise UnsupportedStateError(
                f"state{where}: {why}; convert it to tensors/JSON values or pass allow_pickle=True"
            )
        return {"p": base64.b64encode(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).decode()}

    def tensor(self, t: torch.Tensor, path: str, where: str) -> str:
        if t.layout is not torch.strided or t.is_quantized or t.device.type == "meta":
            raise UnsupportedStateError(f"state{where}: {t.layout} / {t.device} tensors cannot be stored")
        if dtype_name(t.dtype) is None:
            raise UnsupportedStateError(f"state{where}: dtype {t.dtype} has no safetensors equivalent")
        # The same view stored twice (tied weights) is written once and comes back shared.
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if key is not None and key in self._seen:
            return self._seen[key]
        name = self._name(path)
        self.tensors[name] = t.detach()
        if key is not None:
            self._seen[key] = name
        return name

    def lazy(self, t: LazyTensor, path: str) -> str:
        key = ("lazy", id(t))  # the same source stored twice is written once
        if key in self._seen:
            return self._seen[key]
        name = self._name(path)
        self.tensors[name] = t
        self._seen[key] = name
        return name

    def node(self, v: Any, path: str, where: str) -> dict[str, Any]:
        if isinstance(v, torch.Tensor):
            return {"t": self.tensor(v, path, where)}
        if isinstance(v, LazyTensor):  # stored as a plain tensor: it loads back as one
            return {"t": self.lazy(v, path)}
        tv = type(v)
        if tv is float:
            return {"v": v} if math.isfinite(v) else {"f": repr(v)}
        if tv in _SCALARS:
            return {"v": v}
        if tv is dict or tv is OrderedDict:
            items = []
            for k, x in v.items():
                if type(k) not in _KEY_TYPES:
                    return self._pickled(v, where, f"dict key {k!r} of type {type(k).__name__}")
                kn: Any = k if type(k) is not float or math.isfinite(k) else repr(k)
                sub = f"{path}/{k}" if path else str(k)
                items.append([kn, self.node(x, sub, f"{where}[{k!r}]")])
            return {"d": items, "o": 1} if tv is OrderedDict else {"d": items}
        if tv is list or tv is tuple:
            nodes = [
                self.node(x, f"{path}/{i}" if path else str(i), f"{where}[{i}]") for i, x in enumerate(v)
            ]
            return {"l": nodes} if tv is list else {"u": nodes}
        if tv is bytes:
            return {"b": base64.b64encode(v).decode()}
        if tv is torch.dtype:
            return {"dt": str(v).removeprefix("torch.")}
        if tv is torch.Size:
            return {"sz": list(v)}
        if tv is torch.device:
            return {"dev": str(v)}
        np = _np()
        if np is not None:
            if tv is np.ndarray and v.dtype != object:
                t = torch.from_numpy(np.ascontiguousarray(v).reshape(v.shape))  # 0-d stays 0-d
                return {"a": self.tensor(t, path, where), "npdt": v.dtype.str}
            if isinstance(v, np.generic) and not isinstance(v, np.object_):
                return {
                    "ns": [
                        v.dtype.str,
                        v.item() if not isinstance(v, np.floating) or math.isfinite(v) else repr(float(v)),
                    ]
                }
        return self._pickled(
            v, where, f"value of type {tv.__module__}.{tv.__qualname__} is not JSON-representable"
        )


def flatten(
    state: Any, *, allow_pickle: bool = False
) -> tuple[dict[str, torch.Tensor | LazyTensor], dict[str, Any]]:
    """Split ``state`` into named tensors and a JSON-serialisable structure tree.

    A flat ``{str: tensor}`` dict keeps its keys as tensor names, so stock safetensors users see
    the names they expect. A `LazyTensor` is named like a tensor (its bytes are read when the file is
    written). Anything JSON cannot hold raises ``UnsupportedStateError`` naming
    where it is, unless ``allow_pickle``.
    """
    f = _Flattener(allow_pickle)
    tree = f.node(state, "", "")
    return f.tensors, tree


#: Nesting deeper than any training state has; a deeper tree is refused, not recursed into.
MAX_DEPTH = 200
_NP_KINDS = "biufc"


def unflatten(
    tree: Any, tensors: dict[str, torch.Tensor], *, allow_pickle: bool = False, where: str = ""
) -> Any:
    """Rebuild the state recorded by ``flatten`` from ``tree`` and the loaded ``tensors``.

    ``tree`` comes from a file: any node of a shape ``flatten`` never writes (wrong types, bad
    base64, an unknown dtype, nesting deeper than ``MAX_DEPTH``) is ``CheckpointFormatError``;
    a pickled value without ``allow_pickle`` is ``UnsupportedStateError``.
    """
    try:
        return _Decoder(tensors, allow_pickle).node(tree, where, 0)
    except (CheckpointFormatError, UnsupportedStateError):
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError, AttributeError) as e:
        raise CheckpointFormatError(f"state{where}: malformed structure ({type(e).__name__})") from None
    except RuntimeError as e:  # torch refusing a size, a device string...
        raise CheckpointFormatError(f"state{where}: malformed structure ({type(e).__name__})") from None


def _bad(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"state{where}: {what}")


def _b64(v: Any, where: str) -> bytes:
    if not isinstance(v, str):
        raise _bad(where, "bytes node does not hold a base64 string")
    try:
        return base64.b64decode(v.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise _bad(where, "bytes node holds invalid base64") from None


def _key(k: Any, where: str) -> Any:
    if type(k) not in _KEY_TYPES:
        raise _bad(where, f"dict key of type {type(k).__name__}")
    return k


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], allow_pickle: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle

    def _list(self, v: Any, where: str, depth: int) -> list[Any]:
        if not isinstance(v, list):
            raise _bad(where, "list node does not hold a list")
        return [self.node(n, f"{where}[{i}]", depth + 1) for i, n in enumerate(v)]

    def node(self, tree: Any, where: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _bad(where, f"structure nested deeper than {MAX_DEPTH} levels")
        if not isinstance(tree, dict) or len(tree) == 0:
            raise _bad(where, "malformed structure node")
        if "t" in tree:
            return _tensor(self.tensors, tree["t"], where)
        if "v" in tree:
            v = tree["v"]
            if type(v) not in (int, str, bool, float, type(None)):
                raise _bad(where, "scalar node holds a container")
            return v
        if "f" in tree:
            if tree["f"] not in ("nan", "inf", "-inf"):
                raise _bad(where, "float node is not nan/inf/-inf")
            return float(tree["f"])
        if "d" in tree:
            items = tree["d"]
            if not isinstance(items, list):
                raise _bad(where, "dict node does not hold a list of pairs")
            out: dict[Any, Any] = OrderedDict() if tree.get("o") else {}
            for pair in items:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _bad(where, "dict node entry is not a [key, node] pair")
                k = _key(pair[0], where)
                out[k] = self.node(pair[1], f"{where}[{k!r}]", depth + 1)
            return out
        if "l" in tree:
            return self._list(tree["l"], where, depth)
        if "u" in tree:
            return tuple(self._list(tree["u"], where, depth))
        if "b" in tree:
            return _b64(tree["b"], where)
        if "dt" in tree:
            name = tree["dt"]
            dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
            if not isinstance(dt, torch.dtype):
                raise _bad(where, "dtype node names no torch dtype")
            return dt
        if "sz" in tree:
            sz = tree["sz"]
            if not isinstance(sz, list) or not all(type(d) is int and 0 <= d < 1 << 63 for d in sz):
                raise _bad(where, "torch.Size node is not a list of non-negative ints")
            return torch.Size(sz)
        if "dev" in tree:
            if not isinstance(tree["dev"], str):
                raise _bad(where, "device node does not hold a string")
            return torch.device(tree["dev"])
        if "a" in tree:
            np = _np()
            t = _tensor(self.tensors, tree["a"], where)
            if np is None:
                return t
            dt = self._np_dtype(np, tree.get("npdt"), where)
            if t.element_size() != dt.itemsize:
                raise _bad(where, "array node's dtype does not match its tensor")
            return t.numpy().view(dt).copy()
        if "ns" in tree:
            np = _np()
            ns = tree["ns"]
            if not isinstance(ns, list) or len(ns) != 2:
                raise _bad(where, "numpy scalar node is not [dtype, value]")
            dt = self._np_dtype(np, ns[0], where)
            x = ns[1]
            if isinstance(x, str):
                x = float(x)
            elif type(x) not in (int, float, bool):
                raise _bad(where, "numpy scalar node holds a non-number")
            return dt.type(x)
        if "p" in tree:
            if not self.allow_pickle:
                raise UnsupportedStateError(
                    f"state{where} was stored pickled; pass allow_pickle=True to load it (only for trusted files)"
                )
            return pickle.loads(_b64(tree["p"], where))
        raise _bad(where, "unknown structure node")

    @staticmethod
    def _np_dtype(np: Any, s: Any, where: str) -> Any:
        if not isinstance(s, str) or len(s) > 8:
            raise _bad(where, "numpy dtype is not a short string")
        dt = np.dtype(s)
        if dt.kind not in _NP_KINDS:
            raise _bad(where, "numpy dtype is not numeric")
        return dt


def _tensor(tensors: dict[str, torch.Tensor], name: Any, where: str) -> torch.Tensor:
    if not isinstance(name, str) or name not in tensors:
        raise CheckpointFormatError(f"state{where}: a tensor it names is missing from the file")
    return tensors[name]
