"""docs/releasing.md stays true to the code: its compatibility table has a row per arch package whose
compute capabilities are the ones the backend declares, its package table lists every package with how it
builds, and the tools/release.py commands it shows exist."""

from __future__ import annotations

import ast
import re

import pytest
from pkgtest import PACKAGES, REPO_ROOT, by_role, release

DOC = (REPO_ROOT / "docs" / "releasing.md").read_text()
ARCHES = by_role("arch")


def table_after(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table after `heading`."""
    rows: list[list[str]] = []
    for line in DOC.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table after {heading!r}"
    return rows[2:]  # header and separator


def declared_capabilities(package) -> set[tuple[int, int]]:
    """The `capabilities` class attribute of the package's backend class, read from its source."""
    module = package.pyproject["project"]["entry-points"]["cula.backends"][package.arch].split(":")[0]
    path = package.path / "src" / (module.replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "capabilities" for t in node.targets):
            return set(ast.literal_eval(node.value))
    pytest.fail(f"no literal `capabilities = ...` in {path}")


@pytest.mark.parametrize("package", ARCHES, ids=[p.arch for p in ARCHES])
def test_compatibility_row_matches_the_backend(package):
    rows = {r[0]: r for r in table_after("## Compatibility")}
    row = rows.get(f"`{package.name}`")
    assert row, f"docs/releasing.md: no compatibility row for {package.name}"
    assert row[1] == f"`pip install cula[{package.arch}]`"
    caps = {tuple(int(x) for x in c.split(".")) for c in re.findall(r"\b\d+\.\d+\b", row[3])}
    assert caps == declared_capabilities(package), f"row says {sorted(caps)}"
    wheel_tags = row[4]
    assert ("manylinux_2_28" in wheel_tags) == package.native and ("py3-none-any" in wheel_tags) != package.native


def test_package_table_lists_every_package_with_its_build():
    rows = {r[0]: r for r in table_after("# Releasing cula")}
    assert set(rows) == {f"`{p.name}`" for p in PACKAGES}
    for p in PACKAGES:
        build = rows[f"`{p.name}`"][2]
        assert build.startswith("cibuildwheel" if p.native else "`python -m build`"), (p.name, build)
        assert re.fullmatch(rf"`{re.escape(p.name)}-v\d+\.\d+\.\d+`", rows[f"`{p.name}`"][3])


def test_release_commands_shown_exist():
    options = {s for a in release.build_parser()._actions for s in a.option_strings}
    shown = set(re.findall(r"tools/release\.py[^\n`]*?(--[a-z-]+)", DOC))
    assert shown and shown <= options, f"docs show options tools/release.py lacks: {shown - options}"
