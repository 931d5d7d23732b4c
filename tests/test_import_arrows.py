"""The architecture's "never" arrows, checked by parsing every import of dsio's source.

- dsio never imports dstrain;
- dsio's I/O modules (everything but the metrics layer, the CLI and its reports) never import
  prometheus-client or the metrics layer, directly or through another dsio module;
- dsio.checkpoint never imports dstrain;
- the I/O core (handles, files, pools, engine face, bridge, registry) never imports dsio.checkpoint;
- only dsio._native imports the native core dsio._C, and ``import dsio`` works without it;
- no import circle among the modules of dsio, dstrain and bench (type-only imports count here: a
  circle of types is a concept cut in two), and no module reads another module's ``_private``
  name (``from m import _x``, or ``obj._x`` where this module defines no ``_x``).

Imports inside functions count (they run sooner or later); imports under ``if TYPE_CHECKING:`` do
not for the never-arrows (they never run), but do for circles.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dsio"

#: The metrics layer and the command line: allowed to import prometheus-client and dsio.metrics.
OUTER = {"dsio.metrics", "dsio._exporter", "dsio.cli", "dsio._report", "dsio._tune", "dsio.__main__"}
#: Modules above the I/O core (they may import dsio.checkpoint; the core may not).
NOT_CORE = OUTER | {"dsio.compat"}


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports at run time (``from a import b`` gives both
    ``a`` and ``a.b``: b may be a submodule)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                out.add(target)
                out.update(f"{target}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}


def _closure(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from ``start`` (dsio modules followed, with their parent packages),
    mapped to the module that imported it."""
    seen: dict[str, str] = {start: ""}
    todo = [start]
    while todo:
        m = todo.pop()
        for dep in graph.get(m, ()):
            names = [dep]
            parts = dep.split(".")
            names += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b runs a
            for n in names:
                if n and n not in seen:
                    seen[n] = m
                    if n in graph:
                        todo.append(n)
    return seen


def _path(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen.get(chain[-1]):
        chain.append(seen[chain[-1]])
    return " <- ".join(chain)


GRAPH = _graph()


def test_the_parser_sees_real_arrows():
    # Guards the guard: known arrows must be found, or every check below would pass vacuously.
    assert "dsio.file" in GRAPH["dsio.handle"] and "dsio._registry" in GRAPH["dsio.handle"]
    assert "prometheus_client" in _closure(GRAPH, "dsio.metrics")
    assert "dsio.handle" in _closure(GRAPH, "dsio.checkpoint.checkpointer")
    assert len(GRAPH) > 20


@pytest.mark.parametrize("mod", sorted(GRAPH))
def test_dsio_never_imports_dstrain(mod):
    seen = _closure(GRAPH, mod)
    bad = [m for m in seen if m == "dstrain" or m.startswith("dstrain.")]
    assert not bad, _path(seen, bad[0])


@pytest.mark.parametrize("mod", sorted(m for m in GRAPH if m not in OUTER))
def test_io_modules_never_import_prometheus_or_the_metrics_layer(mod):
    seen = _closure(GRAPH, mod)
    bad = [m for m in seen if m.split(".")[0] == "prometheus_client" or m in OUTER]
    assert not bad, _path(seen, bad[0])


@pytest.mark.parametrize(
    "mod", sorted(m for m in GRAPH if not m.startswith("dsio.checkpoint") and m not in NOT_CORE)
)
def test_io_core_never_imports_checkpoint(mod):
    seen = _closure(GRAPH, mod)
    bad = [m for m in seen if m == "dsio.checkpoint" or m.startswith("dsio.checkpoint.")]
    assert not bad, _path(seen, bad[0])


def test_only_the_native_face_imports_the_native_core():
    importers = sorted(m for m, deps in GRAPH.items() if "dsio._C" in deps)
    assert importers == ["dsio._native"]


def test_import_dsio_works_without_the_native_core():
    """A meta-path finder refuses dsio._C: every package imports, configs and errors work, and the
    first real use raises BackendUnavailableError (not ImportError)."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "dsio._C":
                    raise ImportError("dsio._C blocked by the test")
                return None

        sys.meta_path.insert(0, Block())
        import dsio, dsio.checkpoint, dsio.compat, dsio.metrics, dsio.cli, dsio._native
        assert dsio.IOConfig.from_deepspeed({"queue_depth": 16}).queue_depth == 16
        assert not dsio._native.available()
        for make in (dsio.AsyncIOHandle, lambda: dsio.PinnedPool(1 << 20, 1 << 20), dsio.backend_status):
            try:
                make()
            except dsio.BackendUnavailableError:
                pass
            else:
                raise AssertionError(f"{make} worked without the native core")
        assert "dsio._C" not in sys.modules
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# -- circles and private reads (dsio, dstrain, bench) ------------------------------------------------

HOUSE = ("dsio", "dstrain", "bench")


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _from_target(package: str, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <node.module> import ...`` written in ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _house_arrows(path: Path) -> set[str]:
    """Modules of the house that ``path`` imports, TYPE_CHECKING ones included (``from a import b``:
    ``a.b`` when that is a module, else ``a``), less its own packages."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            for a in node.names:
                out.add(f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target)
    # a module's own ancestor packages run before it anyway: an import of one is no arrow back up
    return {
        m for m in out if m.split(".")[0] in HOUSE and _is_module(m) and not (mod + ".").startswith(m + ".")
    }


def _house_files() -> list[Path]:
    return [p for top in HOUSE for p in sorted((ROOT / top).rglob("*.py"))]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@functools.cache
def _house_graph() -> dict[str, set[str]]:
    """Every house module's arrows, parsed on first use by a test rather than at import: collection
    (each xdist worker's, `make test`'s `alone` run's, tests/test_collection.py's child's) skips ~1 s."""
    return {_module_name(p): _house_arrows(p) for p in _house_files()}


def test_the_circle_finder_finds_a_circle():
    # Guards the guard: a made-up circle is found, and the real graph has its known arrows.
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "dstrain.offload.swap.swapper" in _house_graph()["dstrain.offload.optimizer.adam"]
    assert "dsio.handle" in _house_graph()["dstrain.offload.swap.swapper"]  # a TYPE_CHECKING arrow


def test_no_import_circles():
    assert _circles(_house_graph()) == []


#: Private names of objects the house does not define, read where no type says whose they are.
FOREIGN_PRIVATE = {
    "_version": "torch.Tensor._version, the in-place version counter (dsio.checkpoint's copy-on-save check)",
}


def _private_reads(path: Path, base: Path = ROOT) -> list[str]:
    """``from m import _x`` of a name (not a module) of another house module, and ``obj._x`` where
    ``obj`` is not self/cls/super() or an imported outside package, and this module defines no
    ``_x`` (a method, an attribute it assigns, a function, a class). ``base``: the folder ``path`` is
    named relative to (the checkout; a test's scratch copy)."""
    mod = _module_name(path, base)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    own: set[str] = set()
    outside: set[str] = set()
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Import):
            outside.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] not in HOUSE
            )
        elif isinstance(node, ast.ImportFrom):
            if not node.level and (node.module or "").split(".")[0] not in HOUSE:
                outside.update(a.asname or a.name for a in node.names)
                continue
            target = _from_target(package, node)
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and not _is_module(f"{target}.{a.name}") and f"{target}.{a.name}" != "dsio._C":
                    bad.append(f"{path.relative_to(base)}:{node.lineno}: from {target} import {a.name}")
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        ):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if isinstance(root, ast.Name) and root.id in outside:
            continue
        if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super":
            continue
        if node.attr in own or node.attr in FOREIGN_PRIVATE:
            continue
        bad.append(f"{path.relative_to(base)}:{node.lineno}: {ast.unparse(node.value)}.{node.attr}")
    return bad


def test_the_private_read_finder_finds_one(tmp_path):
    # Guards the guard: the scan of offload's checkpoint side before SwappedState would have failed.
    # (a scratch tree, not the checkout: a checkout may be read-only to the user running the tests)
    fake = tmp_path / "dstrain" / "_arrow_probe_tmp.py"
    fake.parent.mkdir()
    fake.write_text(
        "from dsio._bridge import LoopThread\nfrom dsio.checkpoint._read import _x\n\ndef f(opt):\n    return opt._swapper, self_._y\n"
    )
    found = _private_reads(fake, tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "from dsio.checkpoint._read import _x",
        "opt._swapper",
        "self_._y",
    ]


#: (bench file, the expression read) -> why it is still read. Drivers and experiments use the public
#: API like any user (statistics() snapshots, leases, Checkpointer): a private read breaks silently
#: when the library renames the attribute.
BENCH_PRIVATE = {
    # the raw-write ceiling writes the Checkpointer's staging region itself (the file's bytes, with no
    # second copy of the 2.8 GiB state beside it); dsio.checkpoint has no public face for it yet
    ("bench/checkpoint.py", "self.ckpt._staging"): "the Checkpointer's staging region (raw write)",
    ("bench/checkpoint.py", "self.ckpt._staging._view"): "the Checkpointer's staging region (raw write)",
}


@pytest.mark.parametrize("top", ["dsio", "dstrain", "bench"])
def test_no_module_reads_another_modules_privates(top):
    bad = [hit for p in sorted((ROOT / top).rglob("*.py")) for hit in _private_reads(p)]
    left = [hit for hit in bad if tuple(hit.split(":", 1)[:1] + hit.split(": ", 1)[1:]) not in BENCH_PRIVATE]
    assert left == []


def test_every_allowed_bench_private_read_still_exists():
    # the bench allow-list cannot go stale into an exemption
    seen = {
        (hit.split(":", 1)[0], hit.split(": ", 1)[1])
        for p in sorted((ROOT / "bench").rglob("*.py"))
        for hit in _private_reads(p)
    }
    assert set(BENCH_PRIVATE) <= seen, sorted(set(BENCH_PRIVATE) - seen)


def test_dstrain_imports_no_private_dsio_module():
    # dsio's public faces (dsio, dsio.metrics, dsio.checkpoint, ...) are what dstrain builds on
    bad = {
        m: sorted(d for d in deps if d.startswith("dsio.") and any(p.startswith("_") for p in d.split(".")))
        for m, deps in _house_graph().items()
        if m.startswith("dstrain.")
    }
    assert {m: d for m, d in bad.items() if d} == {}
