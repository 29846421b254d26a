"""validate-pyproject on every pyproject.toml of the repository (with cibuildwheel's schema for
[tool.cibuildwheel] tables), and the checks that show the validator really rejects bad ones."""

from __future__ import annotations

import copy
import subprocess

import pytest
from pkgtest import PACKAGES, REPO_ROOT, tool

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib



def pyproject_files() -> list[str]:
    """Every pyproject.toml git knows of or would add (tracked, or untracked and not ignored)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "pyproject.toml", "*/pyproject.toml"],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({line for line in out.splitlines() if (REPO_ROOT / line).is_file()})


FILES = pyproject_files()


@pytest.fixture(scope="module")
def validator():
    try:
        from validate_pyproject import api
    except ImportError:
        pytest.fail("validate-pyproject is not installed: pip install -r tools/requirements-test.txt")
    return api.Validator()


def test_every_package_pyproject_is_covered():
    assert {f"{p.rel_path}/pyproject.toml" for p in PACKAGES} <= set(FILES)


@pytest.mark.parametrize("path", FILES)
def test_pyproject_is_valid(validator, path):
    with open(REPO_ROOT / path, "rb") as f:
        data = tomllib.load(f)
    validator(data)  # raises ValidationError naming the field


def test_validate_pyproject_command_line_agrees():
    proc = subprocess.run([tool("validate-pyproject"), *FILES], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Valid file:") == len(FILES), proc.stdout


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d["project"].update(version="one point oh"), "project.version"),
    (lambda d: d["project"].update(license="Apache 2"), "project.license"),
    (lambda d: d["project"].update(classifiers=["Programming Language :: Klingon"]), "project.classifiers"),
    (lambda d: d["project"].update(dependencies=["cula-core>=>0.1"]), "project.dependencies"),
    (lambda d: d.setdefault("tool", {}).update(cibuildwheel={"build": 3}), "tool.cibuildwheel.build"),
    (lambda d: d.setdefault("tool", {}).update(cibuildwheel={"manylinux-x86_64-imag": "manylinux_2_28"}),
     "tool.cibuildwheel"),
], ids=["version", "license", "classifier", "dependency", "cibuildwheel-type", "cibuildwheel-key"])
def test_validator_rejects_broken_pyprojects(validator, breakage, message):
    from validate_pyproject.errors import ValidationError

    with open(REPO_ROOT / PACKAGES[0].rel_path / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    broken = copy.deepcopy(data)
    breakage(broken)
    with pytest.raises(ValidationError, match=message.replace(".", r"\.")):
        validator(broken)
