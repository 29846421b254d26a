"""Every package builds an sdist and a wheel whose metadata is its pyproject's; core + meta + one arch
wheel install into a fresh venv and work there: `import cula`, the backend entry point, the extras
metadata, the installed versions.
"""

from __future__ import annotations

import email.parser
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from pkgtest import PACKAGES, builds_pure_by_default, by_role
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

# The arch package the fresh-venv test installs: one whose default wheel is pure Python, which builds everywhere.
VENV_ARCH = next(p for p in by_role("arch") if builds_pure_by_default(p) and not p.build_tools)
IDS = [p.name for p in PACKAGES]


def metadata_of_wheel(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(name).decode())


def entry_points_of_wheel(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return z.read(names[0]).decode() if names else ""


def source_modules(package) -> set[str]:
    """Every .py file of the package's import package, relative to src/."""
    src = package.path / "src"
    return {p.relative_to(src).as_posix() for p in (src / package.import_name).rglob("*.py")
            if "__pycache__" not in p.parts}


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_and_sdist_carry_the_pyproject_name_and_version(dists, package):
    b = dists[package.name].require()
    wname, wversion, _, tags = parse_wheel_filename(b.wheel.name)
    sname, sversion = parse_sdist_filename(b.sdist.name)
    assert wname == sname == canonicalize_name(package.name)
    assert wversion == sversion == Version(package.version)
    meta = metadata_of_wheel(b.wheel)
    assert meta["Name"] == package.name and meta["Version"] == package.version
    assert meta["Requires-Python"] == package.pyproject["project"]["requires-python"]
    if not builds_pure_by_default(package):  # built for this interpreter; cibuildwheel makes the manylinux ones
        assert all(t.interpreter.startswith("cp") and t.platform.startswith("linux") for t in tags), tags
    else:
        assert {str(t) for t in tags} == {"py3-none-any"}


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_and_sdist_hold_every_module(dists, package):
    b = dists[package.name].require()
    modules = source_modules(package)
    assert f"{package.import_name}/__init__.py" in modules
    with zipfile.ZipFile(b.wheel) as z:
        in_wheel = {n for n in z.namelist() if n.endswith(".py")}
    assert modules <= in_wheel, f"missing from the wheel: {sorted(modules - in_wheel)}"
    assert not [n for n in in_wheel if n.startswith(("tests/", "src/"))], "wheel has files outside the package"
    with tarfile.open(b.sdist) as t:
        top = b.sdist.name.removesuffix(".tar.gz")
        in_sdist = {n.removeprefix(f"{top}/") for n in t.getnames()}
    assert {"pyproject.toml", "PKG-INFO", "README.md"} <= in_sdist
    assert {f"src/{m}" for m in modules} <= in_sdist
    # build output never ships in an sdist (an editable build leaves .so files in src/), nor caches in either
    compiled = (".so", ".o", ".pyc", ".pyd", ".dll")
    assert not [n for n in in_sdist if n.endswith(compiled)], "sdist holds build output"
    with zipfile.ZipFile(b.wheel) as z:
        names = z.namelist()
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]
    extensions = [n for n in names if n.startswith(f"{package.import_name}/") and n.endswith(".so")]
    native = not builds_pure_by_default(package)  # an opt-in hook (ahead-of-time kernels) is off here
    assert bool(extensions) == native, f"native by default={native} but compiled files: {extensions}"


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_requirements_are_the_pyproject_dependencies(dists, package):
    meta = metadata_of_wheel(dists[package.name].require().wheel)
    got = sorted(str(Requirement(r)) for r in meta.get_all("Requires-Dist") or [])
    project = package.pyproject["project"]
    want = [str(Requirement(r)) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        want += [str(Requirement(f'{r}; extra == "{extra}"')) for r in reqs]
    assert got == sorted(want)
    assert sorted(meta.get_all("Provides-Extra") or []) == sorted(project.get("optional-dependencies", {}))


@pytest.mark.parametrize("package", by_role("arch"), ids=[p.name for p in by_role("arch")])
def test_arch_wheel_registers_its_backend(dists, package):
    eps = entry_points_of_wheel(dists[package.name].require().wheel)
    assert "[cula.backends]" in eps
    assert f"{package.arch} = {package.import_name}.backend:backend" in eps


def test_meta_extras_select_the_arch_wheels(dists):
    (meta_pkg,) = by_role("meta")
    meta = metadata_of_wheel(dists[meta_pkg.name].require().wheel)
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    extras = meta.get_all("Provides-Extra")
    arches = by_role("arch")
    assert set(extras) == {p.arch for p in arches} | {"all"}
    for extra in extras:
        selected = {canonicalize_name(r.name) for r in reqs if r.marker and r.marker.evaluate({"extra": extra})}
        want = {canonicalize_name(p.name) for p in arches if extra in (p.arch, "all")}
        assert selected == want, f"cula[{extra}] requires {selected}, expected {want}"
    for p in arches:  # cula[sm90] admits the cula-sm90 that is being released beside it
        (req,) = [r for r in reqs if canonicalize_name(r.name) == canonicalize_name(p.name)
                  and r.marker.evaluate({"extra": p.arch})]
        assert req.specifier.contains(p.version, prereleases=True), f"cula[{p.arch}]: {req} excludes {p.version}"
    (core_req,) = [r for r in reqs if not r.marker]
    assert canonicalize_name(core_req.name) == "cula-core"


PROBE = """
import json, sys, importlib.metadata as m
import cula, cula_core
from cula_core import registry
eps = {e.name: e.value for e in m.entry_points(group="cula.backends")}
entries = {e.entry_name: {"loaded": e.loaded, "error": str(e.error or ""), "dist": e.distribution}
           for e in registry.entries()}
print(json.dumps({
    "versions": {d.metadata["Name"]: d.version for d in m.distributions()
                 if d.metadata["Name"].lower().startswith("cula")},
    "cula_version": cula.__version__,
    "cula_file": cula.__file__, "core_file": cula_core.__file__, "prefix": sys.prefix,
    "api_reexported": sorted(set(cula_core.__all__) - set(dir(cula))),
    "entry_points": eps,
    "registry": entries,
    "requires": m.requires("cula"),
}))
"""


@pytest.fixture(scope="session")
def core_meta_arch_venv(dists, make_venv):
    """A fresh venv with cula-core, cula and one arch wheel (VENV_ARCH), installed with --no-deps."""
    wheels = [dists[p.name].require().wheel for p in (*by_role("core"), *by_role("meta"), VENV_ARCH)]
    venv = make_venv("core-meta-arch")
    venv.pip_install("--no-deps", "--no-index", *wheels)
    return venv, json.loads(venv.run("-c", PROBE).stdout)


def test_fresh_venv_imports_cula_from_the_installed_wheels(core_meta_arch_venv):
    venv, probe = core_meta_arch_venv
    prefix = Path(probe["prefix"])
    assert prefix == venv.path
    for f in (probe["cula_file"], probe["core_file"]):
        assert Path(f).is_relative_to(prefix), f"{f} is not from the venv"
    assert probe["api_reexported"] == [], "cula lacks names of cula_core.__all__"


def test_fresh_venv_versions_equal_the_pyprojects(core_meta_arch_venv):
    _, probe = core_meta_arch_venv
    installed = (*by_role("core"), *by_role("meta"), VENV_ARCH)
    assert probe["versions"] == {p.name: p.version for p in installed}
    assert probe["cula_version"] == by_role("meta")[0].version


def test_fresh_venv_entry_point_and_backend_load(core_meta_arch_venv):
    _, probe = core_meta_arch_venv
    assert probe["entry_points"] == {VENV_ARCH.arch: f"{VENV_ARCH.import_name}.backend:backend"}
    assert probe["registry"] == {VENV_ARCH.arch: {"loaded": True, "error": "", "dist": VENV_ARCH.name}}


def test_fresh_venv_extras_metadata(core_meta_arch_venv):
    _, probe = core_meta_arch_venv
    reqs = [Requirement(r) for r in probe["requires"]]
    for p in by_role("arch"):
        for extra in (p.arch, "all"):
            assert any(canonicalize_name(r.name) == canonicalize_name(p.name) and r.marker
                       and r.marker.evaluate({"extra": extra}) for r in reqs), f"cula[{extra}] lacks {p.name}"
