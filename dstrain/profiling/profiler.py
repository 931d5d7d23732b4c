"""`FlopsProfiler` and `get_model_profile`: DeepSpeed's flops profiler over torch's own flop counter.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (torch's formulas for matmul, convolution,
attention and their backward; elementwise ops count 0), attributed to modules by its module tracker.
MACs are FLOPs / 2 (every counted op is a multiply-accumulate). Latency is each module's forward wall
time (CUDA synchronised around it), from forward hooks. `peak_flops` measures the FLOP/s of a square
matmul on a device and dtype: the probe MFU is measured against when no peak is given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dstrain.zero.units import whole_shape

__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile", "number_to_string", "peak_flops"]


@dataclass(slots=True)
class ModuleProfile:
    """One module of the profile tree."""

    name: str
    """Dotted path from the root (``""`` for the root)."""
    type: str
    depth: int
    params: int
    """Parameters of the module and its children (elements)."""
    flops: int
    """FLOPs of everything that ran inside it (its children included)."""
    latency_s: float
    """Forward wall time (summed over calls)."""
    children: list[ModuleProfile] = field(default_factory=list)

    @property
    def macs(self) -> int:
        return self.flops // 2

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.latency_s if self.latency_s > 0 else 0.0


def number_to_string(n: float, unit: str = "", precision: int = 2) -> str:
    """``12.35 G`` style (DeepSpeed's formatting)."""
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.{precision}f} {prefix}{unit}"
    return f"{n:.{precision}f} {unit}".rstrip()


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _numel(param: torch.Tensor) -> int:
    """``param``'s elements as the model defines it (a released ZeRO-3 parameter is empty between uses)."""
    return math.prod(whole_shape(param))


class FlopsProfiler:
    """DeepSpeed's ``FlopsProfiler(model)``: `start_profile`, run, `stop_profile`, read totals,
    `print_model_profile`, `end_profile`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._mode: FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._latency: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._duration = 0.0
        self._start = 0.0
        self.started = False
        p = next(iter(model.parameters()), None)
        self._device = p.device if p is not None else None

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Count from now on (forward, backward and anything else this thread runs)."""
        ignore = tuple(ignore_list or ())
        self._latency = {}
        for name, m in self.model.named_modules():
            if isinstance(m, ignore):
                continue
            self._hooks.append(m.register_forward_pre_hook(self._pre(name)))
            self._hooks.append(m.register_forward_hook(self._post(name)))
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()
        _sync(self._device)
        self._start = time.perf_counter()
        self.started = True

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            _sync(self._device)
            self._latency[name] = self._latency.get(name, 0.0) - time.perf_counter()

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            _sync(self._device)
            self._latency[name] += time.perf_counter()

        return hook

    def stop_profile(self) -> None:
        """Stop counting (the counts stay readable)."""
        if not self.started:
            return
        _sync(self._device)
        self._duration = time.perf_counter() - self._start
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        root = type(self.model).__name__
        self._counts = {}
        for key, ops in self._mode.get_flop_counts().items():
            if key == "Global":
                continue
            name = key[len(root) + 1 :] if key != root else ""
            self._counts[name] = int(sum(ops.values()))
        self._total = int(self._mode.get_total_flops())
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.started = False

    def end_profile(self) -> None:
        """Stop and forget (DeepSpeed's end_profile)."""
        self.stop_profile()
        self._counts = {}
        self._latency = {}

    def get_total_flops(self, as_string: bool = False) -> int | str:
        return number_to_string(self._total) if as_string else self._total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        return number_to_string(self._total // 2, "MACs") if as_string else self._total // 2

    def get_total_params(self, as_string: bool = False) -> int | str:
        n = sum(_numel(p) for p in self.model.parameters())
        return number_to_string(n) if as_string else n

    def get_total_duration(self, as_string: bool = False) -> float | str:
        return f"{self._duration * 1e3:.2f} ms" if as_string else self._duration

    def tree(self) -> ModuleProfile:
        """The profile of every module, as a tree rooted at the model."""
        nodes: dict[str, ModuleProfile] = {}
        for name, m in self.model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            node = ModuleProfile(
                name=name,
                type=type(m).__name__,
                depth=depth,
                params=sum(_numel(p) for p in m.parameters()),
                flops=self._counts.get(name, 0),
                latency_s=self._latency.get(name, 0.0),
            )
            nodes[name] = node
            if name:
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                nodes[parent].children.append(node)
        return nodes[""]

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        *,
        peak_flops_per_s: float | None = None,
        step_seconds: float | None = None,
    ) -> str:
        """DeepSpeed's profile text: totals, the aggregated top modules per depth, the module tree.
        Written to ``output_file`` when given; returned."""
        root = self.tree()
        total = self._total
        lines = [
            "-------------------------- DeepSpeed Flops Profiler (dstrain) --------------------------",
            f"Profile Summary at step {profile_step}:",
            f"params per device:                       {number_to_string(root.params)}",
            f"fwd MACs per device:                     {number_to_string(root.macs, 'MACs')}",
            f"FLOPs per device (counted):              {number_to_string(total)}",
            f"fwd latency:                             {root.latency_s * 1e3:.2f} ms",
            f"profiled duration:                       {self._duration * 1e3:.2f} ms",
        ]
        if step_seconds:
            lines.append(
                f"FLOPS per device (step):                 {number_to_string(total / step_seconds, 'FLOPS')}"
            )
            if peak_flops_per_s:
                lines.append(
                    f"MFU:                                     {total / step_seconds / peak_flops_per_s:.4f}"
                )
        lines.append("")
        lines.append(
            f"----------------------------- Aggregated Profile (top {top_modules} per depth) -----------------------------"
        )
        by_depth: dict[int, list[ModuleProfile]] = {}
        stack = [root]
        while stack:
            n = stack.pop()
            by_depth.setdefault(n.depth, []).append(n)
            stack.extend(n.children)
        for depth in sorted(by_depth):
            if module_depth != -1 and depth > module_depth:
                break
            top = sorted(by_depth[depth], key=lambda n: -n.flops)[:top_modules]
            lines.append(
                f"depth {depth}: "
                + ", ".join(f"{n.name or n.type} ({n.type}) {number_to_string(n.flops)}FLOPs" for n in top)
            )
        if detailed:
            lines.append("")
            lines.append(
                "------------------------------ Detailed Profile per Module ------------------------------"
            )
            lines.append("params, % params, MACs, % MACs, fwd latency, FLOP/s")

            def walk(n: ModuleProfile) -> None:
                if module_depth != -1 and n.depth > module_depth:
                    return
                pct_p = 100.0 * n.params / root.params if root.params else 0.0
                pct_m = 100.0 * n.flops / total if total else 0.0
                lines.append(
                    "  "
                    * n.depth
                    + f"({n.name or 'model'}): {n.type}, {number_to_string(n.params)}, {pct_p:.2f}% Params, "
                    f"{number_to_string(n.macs, 'MACs')}, {pct_m:.2f}% MACs, {n.latency_s * 1e3:.2f} ms, "
                    f"{number_to_string(n.flops_per_s, 'FLOPS')}"
                )
                for c in n.children:
                    walk(c)

            walk(root)
        text = "\n".join(lines) + "\n"
        if output_file:
            with open(output_file, "w") as f:
                f.write(text)
        return text


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """DeepSpeed's ``get_model_profile``: ``(flops, macs, params)`` of one forward of ``model`` on a
    random ``input_shape`` batch (fp32, on the model's device) or on ``args`` / ``kwargs``; ``warm_up``
    forwards run first, uncounted. ``mode="forward"`` only (DeepSpeed's other modes call HF's generate)."""
    if mode != "forward":
        raise ValueError(f"mode must be 'forward', got {mode!r}")
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("give input_shape or args/kwargs, not both")
        p = next(iter(model.parameters()), None)
        args = (torch.ones((), device=p.device if p is not None else None).new_empty(input_shape).normal_(),)
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        model(*args, **kwargs)
        prof.stop_profile()
    if print_profile:
        text = prof.print_model_profile(
            module_depth=module_depth, top_modules=top_modules, detailed=detailed, output_file=output_file
        )
        if not output_file:
            print(text)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if as_string:
        return (
            number_to_string(int(flops)),
            number_to_string(int(macs), "MACs"),
            number_to_string(int(params)),
        )
    return flops, macs, params


def peak_flops(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int | None = None
) -> float:
    """Measured FLOP/s of an ``n x n`` matmul (best of 5 after a warm-up; n: 4096 on CUDA, 512 on CPU)."""
    device = torch.device(device)
    n = n or (4096 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best
