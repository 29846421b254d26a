"""The packages' modules import each other without a circle, and in layers: cula_core imports no other cula
package, and an arch package (cula_sm89, cula_sm90, cula_sm100) imports no other arch package (anywhere, functions
included).

The graph is read from the source with `ast` (nothing is imported): an edge A -> B for each import of a module B of
the same package that runs when A is imported (module level, inside `if` / `try` / `with` / class bodies; not inside
functions, not under `if TYPE_CHECKING:`). Importing ``a.b.c`` also runs the package ``a.b``'s ``__init__``, so
that is an edge too; the root package (``cula_core``) itself is left out of those implicit edges (every module would
have one, and the root only re-exports), and so are the packages enclosing the importing module (their inits ran
before it); an explicit ``from cula_core import name`` of a non-module name is an edge to the root. Imports across
packages cannot close a circle while the layering holds, so each package's graph is checked alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pkgtest import REPO_ROOT

PACKAGES = {"cula_core": "cula-core", "cula_sm89": "cula-sm89", "cula_sm90": "cula-sm90", "cula_sm100": "cula-sm100",
            "cula": "cula"}
ARCH_PACKAGES = ("cula_sm89", "cula_sm90", "cula_sm100")


def source_of(root: str) -> Path:
    return REPO_ROOT / "packages" / PACKAGES[root] / "src"


def module_files(source: Path, root: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package `root` under `source`."""
    modules = {}
    for path in sorted((source / root).rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_time_statements(body: list[ast.stmt]):
    """The statements of `body` that run when the module is imported (function bodies do not)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from import_time_statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from import_time_statements(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from import_time_statements(handler.body)


def imported_modules(name: str, path: Path, modules: dict[str, Path], root: str) -> set[str]:
    """The cula_core modules that importing `name` (file `path`) imports, directly or through package inits."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in import_time_statements(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    edges = set()
    for target in targets:
        if target != root and not target.startswith(root + "."):
            continue
        edges.add(target)
        parent = target.rpartition(".")[0]
        # the package inits that importing `target` runs; those enclosing `name` already ran before it
        while parent and parent != root and not (name == parent or name.startswith(parent + ".")):
            edges.add(parent)
            parent = parent.rpartition(".")[0]
    edges.discard(name)
    return {e for e in edges if e in modules}


def import_graph(source: Path, root: str) -> dict[str, set[str]]:
    modules = module_files(source, root)
    return {name: imported_modules(name, path, modules, root) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same node, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once all of its successors are
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == "open":
                return [*path[path.index(succ):], succ]
            if succ not in state and (cycle := visit(succ)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("root", sorted(PACKAGES))
def test_package_imports_form_no_cycle(root):
    graph = import_graph(source_of(root), root)
    assert len(graph) > 1 or root == "cula", f"no modules found for {root}"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {root}: " + " -> ".join(cycle)


def test_dispatch_imports_the_reference_backend_at_import_time():
    """The edge that used to be a lazy import inside a method, hiding a circle through cula_core.ops."""
    assert "cula_core.reference_backend" in import_graph(source_of("cula_core"), "cula_core")["cula_core.dispatch"]


def imported_packages(root: str) -> dict[str, set[str]]:
    """For each module of `root`, the top-level cula packages it imports anywhere (module level or in functions)."""
    found = {}
    for name, path in module_files(source_of(root), root).items():
        tops = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        found[name] = {t for t in tops if t in PACKAGES and t != root}
    return found


@pytest.mark.parametrize("root", ["cula_core", *ARCH_PACKAGES])
def test_packages_import_in_layers(root):
    allowed = set() if root == "cula_core" else {"cula_core"}
    wrong = {name: sorted(tops - allowed) for name, tops in imported_packages(root).items() if tops - allowed}
    assert not wrong, f"{root} may import only {sorted(allowed) or 'no other cula package'}: {wrong}"


def test_the_graph_sees_a_cycle_through_a_package_init(tmp_path):
    """A module that imports a submodule of a package whose __init__ imports the module back is a cycle; a
    function-level import and a TYPE_CHECKING import are not edges."""
    pkg = tmp_path / "cula_core"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from cula_core import dispatch\n")
    (pkg / "dispatch.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from cula_core import cli\n"
        "def kernel():\n    from cula_core import cli\n"
        "from cula_core.ops.impls import f\n"
    )
    (pkg / "cli.py").write_text("from cula_core import dispatch\n")
    (pkg / "ops" / "__init__.py").write_text("from .chunk import chunk\n")
    (pkg / "ops" / "chunk.py").write_text("from cula_core import dispatch\n")
    (pkg / "ops" / "impls.py").write_text("import torch\n")
    graph = import_graph(tmp_path, "cula_core")
    assert graph["cula_core.dispatch"] == {"cula_core.ops", "cula_core.ops.impls"}
    assert graph["cula_core.ops"] == {"cula_core.ops.chunk"}
    assert find_cycle(graph) == ["cula_core.dispatch", "cula_core.ops", "cula_core.ops.chunk", "cula_core.dispatch"]
