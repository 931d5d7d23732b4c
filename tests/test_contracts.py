"""The rooms' optional capabilities are declared, never probed (in dsio and in dstrain).

A part that may or may not offer something (a ZeRO strategy's shard store or its "unit reduced"
events, a stepper that a checkpoint save can gate, a checkpoint part that streams its state) says
so with a ``runtime_checkable`` Protocol beside its base type, and callers ask ``isinstance``.
A config section's optional schema (``_ALIASES``, ``_UNBUILT``, ``_NO_EFFECT``) is declared by its base
class `dstrain._parse.Section`; a user's model that may have Hugging Face's ``save_pretrained`` is asked
with the `SavesPretrained` Protocol. On the dsio side an object `dsio.metrics.track` exports is asked with
``HasStatistics`` / ``NamesItsKind``, a snapshot with ``PerBackend`` (dsio._registry), a lazy checkpoint
source's ``stable`` is a member of its base class `LazyTensor`, and a half-built object's ``__del__``
reads a class-level default. ``getattr(x, "name", default)`` / ``hasattr(x, "name")`` remain only for
objects the house does not define and whose contract is an attribute's presence (`ALLOWED`, each with
why).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The packages scanned: everything the house defines, and bench/ (a tool over them, which uses
#: their declared types like any user; it also drives DeepSpeed's objects, the allowed probes below).
SCANNED = ("dsio", "dstrain", "bench")

#: (file, attribute) -> why probing is right there. What stays is a look at an object the house does not
#: define and whose contract is an attribute's presence; every part declares its capabilities (config
#: sections subclass `dstrain._parse.Section`, rooms' parts satisfy runtime_checkable Protocols).
ALLOWED = {
    # torch's DCP _StorageInfo: DsioStorageWriter adds a crc32c attribute to torch's class (stock DCP
    # ignores it, and pickles it with the entry); entries of stock FileSystemWriter have none
    ("dsio/checkpoint/dcp.py", "crc32c"): "torch's _StorageInfo with dsio's extra attribute",
    # torch's module, in the one place that picks the names: torch 2.13 renamed the collectives (and
    # warns on every call of the old names), pyproject's 2.11 and 2.12 have only the old ones
    (
        "dstrain/dist/comm.py",
        "reduce_scatter_single",
    ): "the torch.distributed module of another torch version",
    ("dstrain/dist/comm.py", "all_gather_single"): "the torch.distributed module of another torch version",
    # DeepSpeed's initialize(args=...): an argparse namespace that may or may not carry the attribute,
    # which is how DeepSpeed's API spells "the config path, if the user's parser added --deepspeed_config"
    ("dstrain/initialize.py", "deepspeed_config"): "the user's argparse namespace (DeepSpeed's args=)",
    # DeepSpeed's marker on torch Parameters (``allreduce = False``): set by the MoE room, read by
    # DeepSpeed's own split_params_into_different_moe_groups_for_optimizer and by users' code; a
    # Parameter is torch's class, and the marker survives deepcopy and pickling as a registry would not
    ("dstrain/moe/experts.py", "allreduce"): "DeepSpeed's marker attribute on torch Parameters",
    # the user's model: "auto" sizes are read as HF's DeepSpeed integration reads them, from any model
    # with a config carrying hidden_size (or hidden_sizes); which keys a config has depends on the model
    ("dstrain/config_auto.py", "config"): "the user's model (HF's integration duck-types model.config)",
    ("dstrain/config_auto.py", "hidden_size"): "a model config's data (its keys depend on the model type)",
    ("dstrain/config_auto.py", "hidden_sizes"): "a model config's data (its keys depend on the model type)",
    # bench/offload_worker.py runs one training loop over dstrain's engine and DeepSpeed's alike (the
    # side-by-side offload driver): what DeepSpeed's objects lack (statistics(), drain(), zero.store,
    # close()) it asks their presence; and it sums the counters of the statistics() snapshots it walks
    # (swappers' and read-aheads' dataclasses of several kinds, told apart by their fields)
    ("bench/offload_worker.py", "statistics"): "DeepSpeed's or dstrain's engine, optimizer, store",
    ("bench/offload_worker.py", "drain"): "DeepSpeed's or dstrain's optimizer",
    ("bench/offload_worker.py", "zero"): "DeepSpeed's or dstrain's engine",
    ("bench/offload_worker.py", "store"): "DeepSpeed's or dstrain's engine",
    ("bench/offload_worker.py", "close"): "DeepSpeed's or dstrain's engine and optimizer",
    ("bench/offload_worker.py", "pinned_bytes"): "a walked statistics() snapshot: swappers' kinds differ",
    (
        "bench/offload_worker.py",
        "stepped_in_backward",
    ): "a walked statistics() snapshot: steppers' kinds differ",
}


def probes(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every ``getattr(x, "name", default)`` and ``hasattr(x, "name")``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        args = node.args
        named = len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
        if named and ((node.func.id == "getattr" and len(args) == 3) or node.func.id == "hasattr"):
            out.append((node.lineno, args[1].value))
    return out


def test_the_probe_finder_finds_probes():
    # Guards the guard: the review's examples are found, a plain attribute access is not.
    src = 'a = getattr(zero, "store", None)\nb = hasattr(s, "step_seconds")\nc = getattr(x, name)\nd = x.store\n'
    assert probes(src) == [(1, "store"), (2, "step_seconds")]


def _sources() -> list[Path]:
    return [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]


@pytest.mark.parametrize("top", SCANNED)
def test_no_capability_probes(top):
    found = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, name in probes(path.read_text()):
            if (rel, name) not in ALLOWED:
                found[f"{rel}:{line}"] = name
    assert found == {}, "declare the capability as a runtime_checkable Protocol and ask isinstance"


def test_every_allowed_probe_still_exists():
    # the allow-list cannot go stale into a blanket exemption
    seen = {(p.relative_to(ROOT).as_posix(), name) for p in _sources() for _, name in probes(p.read_text())}
    assert set(ALLOWED) <= seen, sorted(set(ALLOWED) - seen)


def test_every_config_section_declares_its_schema():
    # the parser and the reference table read the schema as attributes of `Section`, never probe it
    from dstrain._parse import Section
    from dstrain.config_reference import SECTIONS

    assert SECTIONS and all(issubclass(cls, Section) for cls in SECTIONS.values())


# -- the rooms' plug: every room composed in initialize has one shape ---------------------------------

ROOMS = sorted(p.parent.name for p in (ROOT / "dstrain").glob("*/compose.py"))


def test_every_room_says_when_it_applies():
    import importlib
    import inspect

    assert {"moe", "pipe", "offload", "onebit", "checkpointing", "monitor", "profiling"} <= set(ROOMS)
    for room in ROOMS:
        compose = importlib.import_module(f"dstrain.{room}.compose")
        assert "applies" in compose.__all__, room
        assert list(inspect.signature(compose.applies).parameters)[:2] == ["config", "model"], room


def test_initialize_asks_every_room():
    # initialize imports each room's compose module (never names out of it) and asks its applies()
    tree = ast.parse((ROOT / "dstrain" / "initialize.py").read_text())
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dstrain."):
            assert not node.module.endswith(".compose"), (
                f"import the room: from {node.module[:-8]} import compose"
            )
            imported |= {
                a.asname or a.name: node.module.split(".")[1] for a in node.names if a.name == "compose"
            }
    asked = {
        node.func.value.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "applies"
        and isinstance(node.func.value, ast.Name)
    }
    assert sorted(imported.values()) == ROOMS
    assert set(imported) <= asked, sorted(set(imported) - asked)


def test_the_rooms_apply_to_their_models_and_sections():
    import torch

    from dstrain.config import DSConfig
    from dstrain.moe import MoE
    from dstrain.moe import compose as moe
    from dstrain.monitor import compose as monitors
    from dstrain.pipe import PipelineModule
    from dstrain.pipe import compose as pipeline
    from dstrain.profiling import compose as profiling

    plain = DSConfig.load({"train_micro_batch_size_per_gpu": 1})
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not moe.applies(plain, dense) and not pipeline.applies(plain, dense)
    assert moe.applies(plain, torch.nn.Sequential(MoE(4, torch.nn.Linear(4, 4), num_experts=2)))
    assert pipeline.applies(plain, PipelineModule([torch.nn.Linear(4, 4)], num_stages=1, stage_id=0))
    with pytest.raises(TypeError):
        pipeline.build(dense, None, None, {}, plain)  # type: ignore[arg-type]
    assert not monitors.applies(plain) and not profiling.applies(plain)
    on = DSConfig.load(
        {
            "train_micro_batch_size_per_gpu": 1,
            "csv_monitor": {"enabled": True},
            "flops_profiler": {"enabled": True},
        }
    )
    assert monitors.applies(on) and profiling.applies(on)


def test_bench_never_probes_a_private_attribute():
    # bench/ drives objects of dstrain and of DeepSpeed alike, so some duck typing stays there; but a
    # getattr(x, "_name", default) of a private name turns silently into its default once the library
    # renames it: bench/ckpt_blocked.py read OffloadAdam._swapper after it became `swapped.swapper` and
    # dropped its NVMe-only method from every run without a word
    found = {
        f"{p.relative_to(ROOT).as_posix()}:{line}": name
        for p in sorted((ROOT / "bench").rglob("*.py"))
        for line, name in probes(p.read_text())
        if name.startswith("_") and not name.startswith("__")
    }
    assert found == {}
