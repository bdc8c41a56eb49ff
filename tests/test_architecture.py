"""The shape of the code is the architecture: who may import whom, and how big a file may grow.

Read from the source (runtime imports only: those under ``if TYPE_CHECKING:`` are annotations):
- ``fdplug.plugin_api`` (the contract) imports nothing of ``core``, ``server`` or ``plugins``;
- ``fdplug.core`` imports neither ``server`` nor ``plugins``;
- a plugin imports the contract, ``fdplug.errors``, its own package, and of the core only the
  portable components it may extend (``fdplug.core.portable``);
- no import cycles between modules; no file over 300 lines.
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


def runtime_imports(path: Path) -> set[str]:
    """Every fdplug module ``path`` imports at run time (function-level imports included)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If) and _is_type_checking(stmt.test)
               for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(_from_import(node))
    return {name for name in found if name.split(".")[0] == "fdplug"}


def _from_import(node: ast.ImportFrom) -> set[str]:
    """``from pkg import sub`` imports the module ``pkg.sub`` (the package's ``__init__`` is already
    being imported when a submodule does this, so it is not an arrow back); ``from mod import name``
    imports ``mod``."""
    submodules = {f"{node.module}.{alias.name}" for alias in node.names}
    found = {m for m in submodules if m in MODULE_FILES}
    return found if found == submodules else found | {node.module}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULE_FILES = {name for name, path in MODULES.items() if path.name != "__init__.py"}
GRAPH = {name: {m for m in runtime_imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def arrows(source: str, target: str) -> list[str]:
    return [f"{a} -> {b}" for a, targets in GRAPH.items() if a.startswith(source)
            for b in targets if b.startswith(target)]


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


def test_no_import_cycles():
    """Module-level cycles only: an import inside a function is deferred on purpose and cannot deadlock."""
    top_level = {name: {m for m in _top_level_imports(path) if m in MODULES and m != name}
                 for name, path in MODULES.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(top_level[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def _top_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(_from_import(node))
    return found


def test_no_file_over_300_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
