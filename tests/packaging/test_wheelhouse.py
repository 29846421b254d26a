"""The wheelhouse test of the release issue: every package's wheel in one folder; `cula[sm89]` and each
other extra whose wheel builds here install from it with `--no-index --find-links` into a fresh venv, and
`python -m cula info` there reports what was installed.
"""

from __future__ import annotations

import re

import pytest
from pkgtest import PACKAGES, by_role, run

ARCHES = by_role("arch")


@pytest.fixture(scope="session")
def wheelhouse_venv(dists, wheelhouse, make_venv):
    """The venv, the arch packages installed through their extras, and what `python -m cula info` printed."""
    for p in (*by_role("core"), *by_role("meta")):
        dists[p.name].require()
    installed = [p for p in ARCHES if dists[p.name].wheel is not None]
    for p in ARCHES:  # a build that failed fails here; only a missing build tool leaves a package out
        if dists[p.name].failed:
            pytest.fail(dists[p.name].failed)
    venv = make_venv("wheelhouse")
    extras = ",".join(p.arch for p in installed)
    # torch (cula-core's dependency) comes from the system site-packages the venv sees: nothing is fetched
    venv.pip_install("--no-index", "--find-links", wheelhouse, f"cula[{extras}]" if extras else "cula")
    info = venv.run("-m", "cula", "info")
    return venv, installed, info.stdout


def test_wheelhouse_holds_one_wheel_per_package_that_builds(dists, wheelhouse):
    names = sorted(p.name for p in wheelhouse.iterdir())
    assert names == sorted(b.wheel.name for b in dists.values() if b.wheel is not None)
    assert all(n.endswith(".whl") for n in names)
    built = {p.name for p in PACKAGES if dists[p.name].wheel is not None}
    unbuilt = {p.name for p in PACKAGES if dists[p.name].skipped}
    assert built | unbuilt == {p.name for p in PACKAGES}, "a package failed to build"


def test_extras_install_every_built_arch_package_from_the_wheelhouse(wheelhouse_venv):
    venv, installed, _ = wheelhouse_venv
    dists = venv.cula_distributions()
    want = {p.name for p in (*by_role("core"), *by_role("meta"), *installed)}
    assert set(dists) == want
    assert all(str(venv.path) in where for where in dists.values()), dists


@pytest.mark.parametrize("package", ARCHES, ids=[p.arch for p in ARCHES])
def test_info_lists_the_backend_installed_through_its_extra(dists, wheelhouse_venv, package):
    dists[package.name].require()  # skips cula-sm89 (with the reason) where nvcc is missing
    _, _, info = wheelhouse_venv
    line = re.search(rf"^  {package.arch} +(\S+) +\(([^)]*)\)", info, re.M)
    assert line, f"no backend line for {package.arch} in:\n{info}"
    assert line.group(1) == "loaded", line.group(0)
    assert line.group(2) == f"{package.name} {package.version}"


def test_info_prints_the_installed_versions(wheelhouse_venv):
    _, installed, info = wheelhouse_venv
    section = info.split("cula packages:\n", 1)[1].split("\n", len(PACKAGES))[: len(PACKAGES)]
    versions = dict(line.split(None, 1) for line in section)
    for p in PACKAGES:
        want = p.version if p in (*by_role("core"), *by_role("meta"), *installed) else "not installed"
        assert versions[p.name] == want, f"{p.name}: info says {versions[p.name]!r}, expected {want!r}"


def test_info_dispatches_to_the_reference_without_a_gpu(wheelhouse_venv):
    info = wheelhouse_venv[2]
    assert "no CUDA device visible" in info
    dispatch = info.split("dispatch", 1)[1].splitlines()[2:]
    ops = [line.split()[0] for line in dispatch if line.startswith("    ")]
    assert "chunk_kda" in ops and "kda_decode" in ops
    assert all("reference (" in line for line in dispatch if line.startswith("    ")), dispatch


def test_console_script_matches_python_m_cula(wheelhouse_venv):
    venv, _, info = wheelhouse_venv
    assert run([venv.bin / "cula", "info"]).stdout == info
