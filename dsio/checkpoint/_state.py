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
        self.tensors: dict[str, torch.Tensor] = {}
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

    def node(self, v: Any, path: str, where: str) -> dict[str, Any]:
        if isinstance(v, torch.Tensor):
            return {"t": self.tensor(v, path, where)}
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
                t = torch.from_numpy(np.ascontiguousarray(v))
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


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``state`` into named tensors and a JSON-serialisable structure tree.

    A flat ``{str: tensor}`` dict keeps its keys as tensor names, so stock safetensors users see
    the names they expect. Anything JSON cannot hold raises ``UnsupportedStateError`` naming
    where it is, unless ``allow_pickle``.
    """
    f = _Flattener(allow_pickle)
    tree = f.node(state, "", "")
    return f.tensors, tree


def unflatten(
    tree: Any, tensors: dict[str, torch.Tensor], *, allow_pickle: bool = False, where: str = ""
) -> Any:
    """Rebuild the state recorded by ``flatten`` from ``tree`` and the loaded ``tensors``."""
    if not isinstance(tree, dict) or len(tree) == 0:
        raise CheckpointFormatError(f"state{where}: malformed structure node {tree!r}")
    if "t" in tree:
        return _tensor(tensors, tree["t"], where)
    if "v" in tree:
        return tree["v"]
    if "f" in tree:
        return float(tree["f"])
    if "d" in tree:
        out: dict[Any, Any] = OrderedDict() if tree.get("o") else {}
        for k, node in tree["d"]:
            out[k] = unflatten(node, tensors, allow_pickle=allow_pickle, where=f"{where}[{k!r}]")
        return out
    if "l" in tree:
        return [
            unflatten(n, tensors, allow_pickle=allow_pickle, where=f"{where}[{i}]")
            for i, n in enumerate(tree["l"])
        ]
    if "u" in tree:
        return tuple(
            unflatten(n, tensors, allow_pickle=allow_pickle, where=f"{where}[{i}]")
            for i, n in enumerate(tree["u"])
        )
    if "b" in tree:
        return base64.b64decode(tree["b"])
    if "dt" in tree:
        dt = getattr(torch, tree["dt"], None)
        if not isinstance(dt, torch.dtype):
            raise UnsupportedStateError(f"state{where}: unknown dtype {tree['dt']!r}")
        return dt
    if "sz" in tree:
        return torch.Size(tree["sz"])
    if "dev" in tree:
        return torch.device(tree["dev"])
    if "a" in tree:
        np = _np()
        t = _tensor(tensors, tree["a"], where)
        return t.numpy().view(np.dtype(tree["npdt"])).copy() if np is not None else t
    if "ns" in tree:
        np = _np()
        dt, x = tree["ns"]
        return np.dtype(dt).type(float(x) if isinstance(x, str) else x)
    if "p" in tree:
        if not allow_pickle:
            raise UnsupportedStateError(
                f"state{where} was stored pickled; pass allow_pickle=True to load it (only for trusted files)"
            )
        return pickle.loads(base64.b64decode(tree["p"]))
    raise CheckpointFormatError(f"state{where}: unknown structure node {sorted(tree)}")


def _tensor(tensors: dict[str, torch.Tensor], name: Any, where: str) -> torch.Tensor:
    try:
        return tensors[name]
    except (KeyError, TypeError):
        raise CheckpointFormatError(f"state{where}: tensor {name!r} is missing from the file") from None
