"""The shape of the code is the architecture: who may import whom, and how big a file may grow.

Read from the source, every import counted: at module level, inside functions, and under
``if TYPE_CHECKING:`` (an annotation is a dependency a reader must follow too). No exemptions:
- ``fdplug.plugin_api`` (the contract) imports nothing of ``core``, ``server`` or ``plugins``;
- ``fdplug.core`` imports neither ``server`` nor ``plugins``;
- a plugin imports the contract, ``fdplug.errors``, its own package, and of the core only the
  portable components it may extend (``fdplug.core.portable``);
- no import cycle between modules, and none between packages (a package: the modules of one
  directory; the loose modules of ``fdplug/`` itself each count as their own);
- no file over 300 lines (a guide for splitting by concept, held here so it is noticed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fdplug"
MAX_LINES = 300


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every fdplug module ``path`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}; fdplug imports absolutely"
            found.update(_from_import(node))
    return {name for name in found if name.split(".")[0] == "fdplug"}


def _from_import(node: ast.ImportFrom) -> set[str]:
    """``from pkg import sub`` imports the module ``pkg.sub`` (the package's ``__init__`` is already
    being imported when a submodule does this, so it is not an arrow back); ``from mod import name``
    imports ``mod``."""
    submodules = {f"{node.module}.{alias.name}" for alias in node.names}
    found = {m for m in submodules if m in MODULE_FILES}
    return found if found == submodules else found | {node.module}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULE_FILES = {name for name, path in MODULES.items() if path.name != "__init__.py"}
GRAPH = {name: {m for m in imports_of(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def package_of(name: str) -> str:
    """The directory a module lives in; a loose module of ``fdplug/`` is its own package."""
    if MODULES[name].name == "__init__.py" or name.count(".") == 1:
        return name
    return name.rpartition(".")[0]


def arrows(source: str, target: str) -> list[str]:
    return [f"{a} -> {b}" for a, targets in GRAPH.items() if a.startswith(source)
            for b in targets if b.startswith(target)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("source, forbidden", [
    ("fdplug.plugin_api", "fdplug.core"), ("fdplug.plugin_api", "fdplug.server"),
    ("fdplug.plugin_api", "fdplug.plugins"), ("fdplug.core", "fdplug.server"), ("fdplug.core", "fdplug.plugins"),
])
def test_no_arrow(source, forbidden):
    assert arrows(source, forbidden) == []


def test_plugins_import_only_the_contract_and_the_portable_components():
    allowed = ("fdplug.plugin_api", "fdplug.errors", "fdplug.core.portable")
    bad = []
    for name, targets in GRAPH.items():
        if name.startswith("fdplug.plugins."):
            own = ".".join(name.split(".")[:3])
            bad += [f"{name} -> {t}" for t in targets
                    if not t.startswith(own) and not t.startswith(allowed) and t != "fdplug.plugins"]
    assert bad == []


def test_no_import_cycle_between_modules():
    assert cycles(GRAPH) == []


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        packages.setdefault(package_of(name), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(name))
    assert cycles(packages) == []


def test_the_graph_is_read_whole():
    """Imports inside functions and under TYPE_CHECKING are arrows too: a check that skipped them
    would pass with the cycles they hide."""
    assert "fdplug.core.worker.model_runner" in GRAPH["fdplug.core.plugin_loading.core_plugin"]   # in a function
    assert "fdplug.plugin_api.engine_config" in GRAPH["fdplug.plugin_api.specs"]                  # TYPE_CHECKING
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_over_300_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
