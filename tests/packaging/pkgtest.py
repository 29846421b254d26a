"""Helpers of the packaging tests (imported by conftest.py and the test modules). The session-scoped
fixtures in conftest.py use them:

  packages     the package table (tools/packages.toml, read by tools/release.py) with each pyproject
  dists        every package's sdist, and its wheel built from that sdist (`python -m build --no-isolation`),
               built in parallel into one temporary folder; a package whose build tools are missing (nvcc
               for cula-sm89) is not built and the tests that need it skip, saying why
  wheelhouse   one folder holding every wheel that built
  make_venv    a fresh venv from the base interpreter with --system-site-packages (so the machine's torch
               and CuTe DSL are reused; conftest.RUNTIME_DEPENDENCIES are installed into it only where the
               base has none), checked to
               hold no cula distribution before the tests install theirs

Our wheels install with --no-deps or --no-index --find-links: only those third-party dependencies can be fetched.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = {"pure": 300, "native": 1800}


def _load_release():
    spec = importlib.util.spec_from_file_location("cula_release_tool", REPO_ROOT / "tools" / "release.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


release = _load_release()
PACKAGES = release.load_packages(REPO_ROOT)  # at import: test modules parametrize over it


def by_role(role: str) -> list:
    return [p for p in PACKAGES if p.role == role]


def tool(name: str) -> str:
    """A command-line tool installed from tools/requirements-test.txt: next to this interpreter (the test
    venv's bin/, which may not be on PATH), else on PATH. Missing is a failure, not a skip."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -r tools/requirements-test.txt")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: nothing that would make it see this test venv's packages."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONUSERBASE")
           and not k.startswith("CIBW_")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1", **extra)
    return env


def run(cmd: list, *, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("env", clean_env())
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
                    f"--- stdout (tail)\n{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-4000:]}")
    return proc


def build_hooks(package, *, by_default: bool) -> list[str]:
    """Names of the package's hatch build hooks that a default build runs (by_default True), or that run only when
    switched on (by_default False: `enable-by-default = false`, e.g. the ahead-of-time kernel hooks of cula-sm90
    and cula-sm100, switched on with HATCH_BUILD_HOOK_ENABLE_CUSTOM=true by their cibuildwheel settings)."""
    hatch_build = package.pyproject.get("tool", {}).get("hatch", {}).get("build", {})
    hooks = {**hatch_build.get("hooks", {}), **hatch_build.get("targets", {}).get("wheel", {}).get("hooks", {})}
    return sorted(name for name, conf in hooks.items() if conf.get("enable-by-default", True) == by_default)


def builds_pure_by_default(package) -> bool:
    """Whether its default build (`python -m build`, no hook switched on) makes a py3-none-any wheel."""
    return not build_hooks(package, by_default=True)


# ---------------------------------------------------------------- building


@dataclass
class Built:
    """The result of building one package: its files, or why it was not built or failed."""

    package: object
    wheel: Path | None = None
    sdist: Path | None = None
    skipped: str | None = None  # a build tool is missing: the tests that need it skip with this reason
    failed: str | None = None  # the build ran and failed: the tests that need it fail with this log
    seconds: float = 0.0

    def require(self) -> Built:
        """This package's files, or skip (missing build tool) / fail (build error) the calling test."""
        if self.skipped:
            pytest.skip(self.skipped)
        if self.failed:
            pytest.fail(self.failed)
        return self


def find_build_tool(name: str) -> str | None:
    """On PATH, or in the CUDA toolkit's bin/ ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda) where build hooks
    also look for nvcc."""
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).is_file():
            return str(Path(home) / "bin" / name)
    return None


def missing_build_tools(package) -> list[str]:
    return [t for t in package.build_tools if find_build_tool(t) is None]


def build(package, outdir: Path) -> Built:
    import time

    missing = missing_build_tools(package)
    if missing:
        return Built(package, skipped=f"{package.name}: not built: {', '.join(missing)} not found on PATH or in "
                                      f"$CUDA_HOME/bin (its wheel build needs {', '.join(package.build_tools)})")
    outdir.mkdir(parents=True)
    # No flags: the sdist first, then the wheel built from the unpacked sdist, which proves the sdist
    # holds everything a build needs (and keeps build output out of the source tree).
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir), str(package.path)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(),
                              timeout=BUILD_TIMEOUT_S["native" if package.native else "pure"])
    except subprocess.TimeoutExpired as exc:
        return Built(package, failed=f"{package.name}: build timed out after {exc.timeout} s")
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        return Built(package, seconds=seconds, failed=(
            f"{package.name}: `{' '.join(cmd)}` failed ({proc.returncode})\n"
            f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}"))
    wheels, sdists = sorted(outdir.glob("*.whl")), sorted(outdir.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        got = sorted(p.name for p in outdir.iterdir())
        return Built(package, seconds=seconds, failed=f"{package.name}: expected one wheel and one sdist, got {got}")
    return Built(package, wheel=wheels[0], sdist=sdists[0], seconds=seconds)


# ---------------------------------------------------------------- fresh venvs


@dataclass
class Venv:
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / ("Scripts" if os.name == "nt" else "bin")

    @property
    def python(self) -> Path:
        return self.bin / ("python.exe" if os.name == "nt" else "python")

    def run(self, *args, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return run([self.python, *args], check=check, timeout=timeout, cwd=self.path)

    def pip_install(self, *args) -> subprocess.CompletedProcess:
        return self.run("-m", "pip", "install", "--no-input", *args, timeout=900)

    def cula_distributions(self) -> dict[str, str]:
        """cula* distribution name -> the folder it is installed in."""
        code = ("import json, importlib.metadata as m\n"
                "print(json.dumps({d.metadata['Name']: str(d.locate_file('')) for d in m.distributions()"
                " if d.metadata['Name'].lower().startswith('cula')}))")
        return json.loads(self.run("-c", code).stdout)


# ---------------------------------------------------------------- source scans (ast, nothing imported)

def is_private(name: str) -> bool:
    """An `_name` that is not a dunder."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def names_bound_by_imports(tree: ast.AST, is_wanted_module) -> set[str]:
    """Local names a module binds (in any scope) to a module whose dotted path satisfies `is_wanted_module`, or to
    an object imported from one (absolute imports only)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if is_wanted_module(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_wanted_module(node.module):
            bound.update(alias.asname or alias.name for alias in node.names if alias.name != "*")
    return bound


def root_name(node: ast.expr) -> str | None:
    """`a` for a pure chain `a.b.c`; None when the chain holds a call, subscript or anything else."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_imports(tree: ast.AST, is_wanted_module) -> list[tuple[ast.AST, str]]:
    """(node, text) for each absolute import of a module satisfying `is_wanted_module` whose dotted path has a
    private component (`import a._b`, `from a._b import c`), and each private name imported from one."""
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, f"import {alias.name}") for alias in node.names
                      if is_wanted_module(alias.name) and any(map(is_private, alias.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_wanted_module(node.module):
            if any(map(is_private, node.module.split("."))):
                found.append((node, f"from {node.module} import ..."))
            found += [(node, f"from {node.module} import {alias.name}") for alias in node.names
                      if is_private(alias.name)]
    return found


ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def private_attribute_uses(tree: ast.AST, bound: set[str]) -> list[tuple[ast.AST, str]]:
    """(node, text) for each private attribute in a chain rooted at one of the names `bound`: `a.b._c`, and the
    string form of getattr / setattr / hasattr / delattr, as functions or methods (monkeypatch.setattr(a, "_c"))."""
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and root_name(node.value) in bound:
            found.append((node, ast.unparse(node)))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            target, attr = node.args[0], node.args[1]
            if (name in ATTRIBUTE_CALLS and root_name(target) in bound and isinstance(attr, ast.Constant)
                    and isinstance(attr.value, str) and is_private(attr.value)):
                found.append((node, f"{name}({ast.unparse(target)}, {attr.value!r})"))
    return found
