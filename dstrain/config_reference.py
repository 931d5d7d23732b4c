"""The config reference: what dstrain does with each DeepSpeed config key, generated from the schema.

Every section parser contributes its rows: its dataclass fields are honoured unless its
``_NO_EFFECT`` says why not, and its ``_UNBUILT`` keys are accepted only where they ask for nothing
(see `dstrain._parse`). A section a room adds (e.g. ``flops_profiler``) is one line in
`dstrain.config.SECTIONS`, which `DSConfig.load` builds and this module walks.

    python -m dstrain.config_reference            # print the Markdown table
    python -m dstrain.config_reference --write README.md   # rewrite README's generated block

tests/dstrain/test_config_schema.py fails when README's table drifts from the schema, or when a
key DeepSpeed reads (tests/dstrain/fixtures/deepspeed_keys.json) has no row.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from dsio.config import DEEPSPEED_AIO_DEFAULTS
from dstrain._parse import Section
from dstrain.config import SECTIONS as CONFIG_SECTIONS
from dstrain.config import DSConfig
from dstrain.config_sections import OPTIMIZER_TYPES, SCHEDULER_TYPES, UNBUILT_OPTIMIZER_TYPES
from dstrain.offload.config import OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["SECTIONS", "Row", "markdown", "rows", "write_readme"]

SECTIONS: dict[str, type[Section]] = {
    "": DSConfig,
    **{k: v for k, v in CONFIG_SECTIONS.items() if k not in ("optimizer", "scheduler")},
    "zero_optimization.offload_optimizer": OffloadOptimizerConfig,
    "zero_optimization.offload_param": OffloadParamConfig,
}
"""Each parsed section's dataclass, by its dotted key ("" is the top level)."""

HONOURED = "honoured"
NO_EFFECT = "accepted, no effect"
WHEN_OFF = "accepted when off, else refused"
REFUSED = "refused"

START = "<!-- config-reference:start (generated: python -m dstrain.config_reference --write README.md) -->"
END = "<!-- config-reference:end -->"


@dataclass(frozen=True, slots=True)
class Row:
    """One key of the reference table."""

    key: str
    status: str
    note: str = ""


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def rows() -> list[Row]:
    """Every key the schema knows, sorted: honoured, accepted with no effect (why), or refused."""
    out: dict[str, Row] = {}
    for prefix, cls in SECTIONS.items():
        no_effect, aliases = cls._NO_EFFECT, cls._ALIASES
        for f in dataclasses.fields(cls):
            if f.name == "world_size" or not f.init:
                continue
            key = _key(prefix, f.name)
            if f.name in no_effect:
                out[key] = Row(key, NO_EFFECT, no_effect[f.name])
            elif key in SECTIONS or f.name in ("aio", "optimizer", "scheduler"):
                out[key] = Row(key, HONOURED, "section")
            else:
                out[key] = Row(key, HONOURED)
        for alias, target in aliases.items():
            key = _key(prefix, alias)
            out[key] = Row(key, out[_key(prefix, target)].status, f"alias of {target}")
        for name, spec in cls._UNBUILT.items():
            key = _key(prefix, name)
            if spec.any_value:
                out[key] = Row(key, NO_EFFECT, spec.why)
            else:
                out[key] = Row(key, WHEN_OFF, f"{spec.why}; accepted: {spec.accepted_values()}")
    for name in DEEPSPEED_AIO_DEFAULTS:
        out[f"aio.{name}"] = Row(f"aio.{name}", HONOURED, "dsio's IOConfig of the offload swappers")
    out["aio.thread_count"] = Row("aio.thread_count", HONOURED, "alias of intra_op_parallelism")
    out["optimizer.type"] = Row(
        "optimizer.type",
        HONOURED,
        f"{', '.join(OPTIMIZER_TYPES)}; refused: {', '.join(UNBUILT_OPTIMIZER_TYPES)}",
    )
    out["optimizer.params"] = Row("optimizer.params", HONOURED, "the optimizer's keyword arguments")
    out["optimizer.params.torch_adam"] = Row(
        "optimizer.params.torch_adam", NO_EFFECT, "dstrain always steps with torch's Adam(W) kernels"
    )
    for name in ("cuda_aware", "comm_backend_name"):
        out[f"optimizer.params.{name}"] = Row(
            f"optimizer.params.{name}", NO_EFFECT, "1-bit Adam's transport choice; dstrain's needs none"
        )
    out["scheduler.type"] = Row("scheduler.type", HONOURED, ", ".join(SCHEDULER_TYPES))
    out["scheduler.params"] = Row("scheduler.params", HONOURED, "the schedule's keyword arguments")
    return [out[k] for k in sorted(out)]


def markdown() -> str:
    """The reference as a Markdown table."""
    lines = ["| key | dstrain | note |", "| --- | --- | --- |"]
    for r in rows():
        note = r.note.replace("|", "\\|")
        lines.append(f"| `{r.key}` | {r.status} | {note} |")
    return "\n".join(lines) + "\n"


def write_readme(path: str | Path, *, check: bool = False) -> bool:
    """Rewrite the generated block of ``path`` (between `START` and `END`); with ``check``, only
    report whether it is up to date. Returns True when the file already matched."""
    text = Path(path).read_text()
    pattern = re.compile(re.escape(START) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path} has no {START!r} ... {END!r} block")
    new = pattern.sub(lambda _: f"{START}\n{markdown()}{END}", text)
    if new == text:
        return True
    if not check:
        Path(path).write_text(new)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="README", help="rewrite this file's generated block")
    parser.add_argument("--check", action="store_true", help="with --write: exit 1 if it is not up to date")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(markdown())
        return 0
    ok = write_readme(args.write, check=args.check)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
