"""Session-scoped fixtures of the packaging tests (the helpers they use are in pkgtest.py):

  packages     the package table (tools/packages.toml, read by tools/release.py) with each pyproject
  dists        every package's sdist and wheel, built once per run (see pkgtest.build)
  wheelhouse   one folder holding every wheel that built
  make_venv    make_venv(name): a fresh venv (see pkgtest.Venv)
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
from pathlib import Path

import pytest
from pkgtest import PACKAGES, Built, Venv, build, run


@pytest.fixture(scope="session")
def packages():
    return PACKAGES


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict[str, Built]:
    """name -> Built, for every package in the table. Native packages start first: they take longest."""
    root = tmp_path_factory.mktemp("dists")
    order = sorted(PACKAGES, key=lambda p: not p.native)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {p.name: pool.submit(build, p, root / p.name) for p in order}
        built = {name: f.result() for name, f in futures.items()}
    return {p.name: built[p.name] for p in PACKAGES}


@pytest.fixture(scope="session")
def wheelhouse(dists, tmp_path_factory) -> Path:
    """One folder with every wheel that built (and nothing else), as a release's wheelhouse would be."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    for b in dists.values():
        if b.wheel is not None:
            shutil.copy2(b.wheel, folder / b.wheel.name)
    return folder


RUNTIME_DEPENDENCIES = {"torch": "torch==2.13.0", "cutlass": "nvidia-cutlass-dsl==4.8.1",
                        "tvm_ffi": "apache-tvm-ffi==0.1.15.post2"}


@pytest.fixture(scope="session")
def make_venv(tmp_path_factory):
    """Call make_venv(name) for a fresh venv (see the module docstring)."""
    base = getattr(sys, "_base_executable", sys.executable)

    def make(name: str) -> Venv:
        venv = Venv(tmp_path_factory.mktemp(name) / "venv")
        # --without-pip: ensurepip would also put its own old setuptools in the venv, shadowing the
        # system's one that torch requires (and then pip wants to fetch a newer one). The base
        # interpreter's pip, seen through the system site-packages, installs into the venv's prefix.
        run([base, "-m", "venv", "--system-site-packages", "--without-pip", venv.path], timeout=300)
        if venv.run("-m", "pip", "--version", check=False).returncode != 0:
            venv.run("-m", "ensurepip", timeout=300)
        # The third-party runtime dependencies of our wheels (torch; CuTe DSL for sm90/sm100) are seen in
        # the base interpreter's site-packages where it has them, else installed into this venv, so that the
        # wheels under test then install with --no-index.
        for module, requirement in RUNTIME_DEPENDENCIES.items():
            if venv.run("-c", f"import {module}", check=False).returncode != 0:
                venv.pip_install(requirement)
        leftovers = venv.cula_distributions()
        if leftovers:
            pytest.fail(f"the base interpreter {base} already has cula packages installed, which would shadow "
                        f"the wheels under test: {leftovers}")
        return venv

    return make
