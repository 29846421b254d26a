"""cibuildwheel settings: each package with native code (a [tool.cibuildwheel] table) selects the intended
builds (tools/packages.toml [wheels]: CPython 3.10-3.13, manylinux, x86_64 and optionally aarch64) and does
what the release issue asks of it; a package without one has no native code (it builds py3-none-any).
"""

from __future__ import annotations

import re

import pytest
from pkgtest import PACKAGES, REPO_ROOT, clean_env, release, run, tool

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

with open(REPO_ROOT / "tools" / "packages.toml", "rb") as _f:
    POLICY = tomllib.load(_f)["wheels"]
NATIVE = [p for p in PACKAGES if p.native]
PURE = [p for p in PACKAGES if not p.native]
NATIVE_SOURCES = ("*.cu", "*.cuh", "*.cpp", "*.cc", "*.c", "*.h", "*.hpp", "*.pyx", "CMakeLists.txt")
IDENT = re.compile(r"^cp3(?P<minor>\d+)-manylinux_(?P<arch>[a-z0-9_]+)$")


def build_identifiers(package_dir, **env) -> list[str]:
    proc = run([tool("cibuildwheel"), "--platform", "linux", "--print-build-identifiers", package_dir],
               env=clean_env(**env), cwd=REPO_ROOT, timeout=120)
    return proc.stdout.split()


def cibw_linux_option(package, key: str):
    """An option as cibuildwheel reads it for Linux: [tool.cibuildwheel.linux] over [tool.cibuildwheel]."""
    table = package.pyproject["tool"]["cibuildwheel"]
    return table.get("linux", {}).get(key, table.get(key))


def native_sources(package) -> list[str]:
    found = []
    for pattern in NATIVE_SOURCES:
        found += [str(p.relative_to(package.path)) for p in package.path.rglob(pattern)
                  if not {"build", "dist", ".venv"} & set(p.relative_to(package.path).parts)]
    return sorted(found)


def has_build_hook(package) -> bool:
    """Whether a default build runs a build hook. An opt-in hook (`enable-by-default = false`: cula-sm90's
    ahead-of-time kernel build, switched on with HATCH_BUILD_HOOK_ENABLE_CUSTOM=true) leaves the default wheel pure."""
    hatch_build = package.pyproject.get("tool", {}).get("hatch", {}).get("build", {})
    hooks = {**hatch_build.get("hooks", {}), **hatch_build.get("targets", {}).get("wheel", {}).get("hooks", {})}
    return any(conf.get("enable-by-default", True) for conf in hooks.values())


@pytest.mark.parametrize("package", PURE, ids=[p.name for p in PURE])
def test_package_without_cibuildwheel_table_is_pure_python(package):
    assert native_sources(package) == [], f"{package.name} has native sources but no [tool.cibuildwheel] table"
    assert not has_build_hook(package), f"{package.name} has a build hook but no [tool.cibuildwheel] table"


@pytest.mark.parametrize("package", NATIVE, ids=[p.name for p in NATIVE])
def test_build_identifiers_are_the_intended_set(package):
    idents = build_identifiers(package.path)
    parsed = [IDENT.match(i) for i in idents]
    assert all(parsed), f"unexpected identifiers (musllinux, PyPy, free-threaded?): {idents}"
    by_arch: dict[str, set[str]] = {}
    for m in parsed:
        by_arch.setdefault(m["arch"], set()).add(f"3.{m['minor']}")
    assert set(POLICY["required-archs"]) <= set(by_arch) <= set(POLICY["allowed-archs"]), by_arch
    for arch, pythons in by_arch.items():
        assert pythons == set(POLICY["python"]), f"{arch}: builds for {sorted(pythons)}, want {POLICY['python']}"
    # the release workflow runs one job per arch tools/release.py finds: the same archs
    assert sorted(package.linux_archs()) == sorted(by_arch)
    info = release.tag_info(REPO_ROOT, package.tag)
    assert info["native"] == "true" and all(a in info["build-matrix"] for a in by_arch)


@pytest.mark.parametrize("package", NATIVE, ids=[p.name for p in NATIVE])
def test_one_arch_per_release_job(package):
    """release.yml sets CIBW_ARCHS_LINUX per job: that must narrow the build to that arch."""
    for arch in package.linux_archs():
        idents = build_identifiers(package.path, CIBW_ARCHS_LINUX=arch)
        assert idents and all(i.endswith(f"-manylinux_{arch}") for i in idents), idents


@pytest.mark.parametrize("package", NATIVE, ids=[p.name for p in NATIVE])
def test_native_settings_follow_the_release_rules(package):
    image = cibw_linux_option(package, "manylinux-x86_64-image") or "manylinux_2_28"  # cibuildwheel's default
    assert re.search(r"manylinux_?2_28", image), f"x86_64 image {image!r} is not manylinux_2_28"
    test_command = cibw_linux_option(package, "test-command") or ""
    assert package.import_name in test_command or "cula" in test_command, \
        f"test-command {test_command!r} does not import the package / check its backend"
    repair = cibw_linux_option(package, "repair-wheel-command") or ""
    assert "auditwheel repair" in repair and "--exclude libcuda.so" in repair, \
        f"repair-wheel-command {repair!r} must exclude the CUDA driver (libcuda.so.1) from the wheel"


def test_cibuildwheel_reads_the_settings(tmp_path):
    """A check that the checks above can fail: a table that drops a Python version and adds musllinux."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "x"\nversion = "0.1.0"\n'
        '[tool.cibuildwheel]\nbuild = "cp311-* cp312-*"\n')
    idents = build_identifiers(pkg, CIBW_ARCHS_LINUX="x86_64")
    assert set(idents) == {"cp311-manylinux_x86_64", "cp312-manylinux_x86_64",
                           "cp311-musllinux_x86_64", "cp312-musllinux_x86_64"}
    assert not all(IDENT.match(i) for i in idents)
