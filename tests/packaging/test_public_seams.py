"""Tools and tests reach the cula packages through public names only.

The scan reads every Python file under tools/ and tests/ with `ast` (nothing is imported) and reports each place
that names a private member of a cula package: an `_name` (not a dunder) as an imported module or name, as an
attribute of something imported from a cula package, as the string argument of getattr / setattr / hasattr /
delattr / monkeypatch.setattr on such a module, or inside a dotted `"cula...._name"` string (monkeypatch's and
importlib's form). A private name is free to change without notice; a seam a tool or test needs is public.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pkgtest import REPO_ROOT, is_private, names_bound_by_imports, private_attribute_uses, private_imports

SCANNED = ("tools", "tests")
DOTTED_CULA_PATH = re.compile(r"cula[a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


def is_cula(dotted: str) -> bool:
    return dotted.split(".")[0].startswith("cula")


def private_part(dotted: str) -> str | None:
    return next((part for part in dotted.split(".") if is_private(part)), None)


def private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    cula_names = names_bound_by_imports(tree, is_cula)
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {what}")

    for node, what in private_imports(tree, is_cula) + private_attribute_uses(tree, cula_names):
        report(node, what)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and DOTTED_CULA_PATH.fullmatch(node.value)
            and private_part(node.value)
        ):
            report(node, repr(node.value))
    return found


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO_ROOT / top).rglob("*.py") if "build" not in p.parts)


def test_tools_and_tests_use_no_private_cula_name():
    found = [use for path in scanned_files() for use in private_uses(path)]
    assert not found, "private cula names used outside the packages:\n" + "\n".join(found)


def test_the_scan_catches_each_form(tmp_path, monkeypatch):
    """Each form the scan is meant to catch is caught, and public or dunder names are not."""
    sample = tmp_path / "tools" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import cula_core._private_mod\n"
        "from cula_sm90.decode import _config\n"
        "from cula_sm90._x.y import z\n"
        "from cula_sm100.forward import launch\n"
        "from cula_core.reference import chunk as ref\n"
        "import torch\n"
        "launch._ptr(1)\n"
        "ref.chunk_kda_reference.__name__\n"
        "torch._C\n"
        "getattr(launch.fwd, '_stream')\n"
        "monkeypatch.setattr('cula_core.dispatch._table', {})\n"
        "monkeypatch.setattr(launch, 'forward', None)\n"
        "'cula_core.dispatch.select'\n"
    )
    monkeypatch.setattr(f"{__name__}.REPO_ROOT", tmp_path)
    lines = sorted(use.split(": ", 1)[1] for use in private_uses(sample))
    assert lines == sorted([
        "import cula_core._private_mod",
        "from cula_sm90.decode import _config",
        "from cula_sm90._x.y import ...",
        "launch._ptr",
        "getattr(launch.fwd, '_stream')",
        "'cula_core.dispatch._table'",
    ]), lines
