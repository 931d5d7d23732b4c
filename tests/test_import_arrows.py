"""The architecture's "never" arrows, checked by parsing every import of dsio's source.

- dsio never imports dstrain;
- dsio's I/O modules (everything but the metrics layer, the CLI and its reports) never import
  prometheus-client or the metrics layer, directly or through another dsio module;
- dsio.checkpoint never imports dstrain;
- the I/O core (handles, files, pools, engine face, bridge, registry) never imports dsio.checkpoint;
- only dsio._native imports the native core dsio._C, and ``import dsio`` works without it.

Imports inside functions count (they run sooner or later); imports under ``if TYPE_CHECKING:`` do
not (they never run).
"""

from __future__ import annotations

import ast
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


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
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
