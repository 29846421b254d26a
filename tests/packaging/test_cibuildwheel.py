"""cibuildwheel settings: each package with native code (a [tool.cibuildwheel] table) selects the intended
builds (tools/packages.toml [wheels]: CPython 3.10-3.13, manylinux, x86_64 and optionally aarch64) and does
what the release issue asks of it; a package without one has no native code (it builds py3-none-any; cula-core's
plan-table source is shipped as data, compiled by the arch wheels and the runtime).
The packages whose native part is an opt-in build hook (cula-sm90 and cula-sm100: CuTe DSL kernels compiled
ahead of time) switch it on in their cibuildwheel settings, build it once per arch job and test that the built
wheel ships every configuration of their set.
"""

from __future__ import annotations

import re
import shlex

import pytest
from pkgtest import PACKAGES, REPO_ROOT, build_hooks, clean_env, release, run, tool

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

with open(REPO_ROOT / "tools" / "packages.toml", "rb") as _f:
    POLICY = tomllib.load(_f)["wheels"]
NATIVE = [p for p in PACKAGES if p.native]
PURE = [p for p in PACKAGES if not p.native]
#: native packages whose native part is an opt-in hook (the ahead-of-time CuTe DSL kernels)
AOT = [p for p in NATIVE if build_hooks(p, by_default=False)]
NATIVE_SOURCES = ("*.cu", "*.cuh", "*.cpp", "*.cc", "*.c", "*.h", "*.hpp", "*.pyx", "CMakeLists.txt")
#: sources a pure package ships as data for others to compile (never built into its own wheel): cula-core's plan
#: table, which the arch wheels' AOT hook builds into their _aot folder and the runtime builds into its cache
SHIPPED_AS_DATA = {"cula-core": ["src/cula_core/cute_runtime/plan_table.cc"]}
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
    """Whether a build hook can run: one that is on by default, or an opt-in one (a release switches it on)."""
    return bool(build_hooks(package, by_default=True) or build_hooks(package, by_default=False))


def pinned(requirement_name: str) -> str:
    """The `name==version` pin of tools/requirements-test.txt (the versions the CPU tests run)."""
    text = (REPO_ROOT / "tools" / "requirements-test.txt").read_text()
    (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(f"{requirement_name}==")]
    return line


@pytest.mark.parametrize("package", PURE, ids=[p.name for p in PURE])
def test_package_without_cibuildwheel_table_is_pure_python(package):
    shipped_as_data = SHIPPED_AS_DATA.get(package.name, [])
    assert [s for s in native_sources(package) if s not in shipped_as_data] == [], (
        f"{package.name} has native sources but no [tool.cibuildwheel] table")
    assert not has_build_hook(package), f"{package.name} has a build hook but no [tool.cibuildwheel] table"


def test_sources_shipped_as_data_are_the_ones_compiled_at_run_time():
    """Each source a pure package ships as data is one its runtime compiles (nothing else is exempt)."""
    from cula_core.cute_runtime import plan_table

    core = next(p for p in PACKAGES if p.name == "cula-core")
    assert SHIPPED_AS_DATA == {"cula-core": [str(plan_table.SOURCE.relative_to(core.path))]}
    assert plan_table.SOURCE.is_file()


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


def test_aot_packages_are_the_cute_dsl_ones():
    assert sorted(p.name for p in AOT) == ["cula-sm100", "cula-sm90"]


@pytest.mark.parametrize("package", AOT, ids=[p.name for p in AOT])
def test_aot_release_build_switches_the_hook_on(package):
    """The release build runs the opt-in hook (hatch's HATCH_BUILD_HOOK_ENABLE_<HOOK>) without build isolation,
    in a build environment holding what the hook imports, at the versions the CPU tests use."""
    (hook,) = build_hooks(package, by_default=False)
    env = cibw_linux_option(package, "environment")
    assert env[f"HATCH_BUILD_HOOK_ENABLE_{hook.upper()}"] == "true", env
    assert {"CULA_AOT_JOBS", "CULA_AOT_LIMIT"} <= set(cibw_linux_option(package, "environment-pass"))
    frontend = cibw_linux_option(package, "build-frontend")
    assert frontend["name"] == "build" and "--no-isolation" in frontend["args"], frontend
    before = cibw_linux_option(package, "before-build")
    words = [w for cmd in ([before] if isinstance(before, str) else before) for w in shlex.split(cmd)]
    for pin in (pinned("nvidia-cutlass-dsl"), pinned("apache-tvm-ffi")):
        assert pin in words, f"before-build does not install {pin}: {before}"
    assert "torch" in words and "hatchling" in words and "{package}/../cula-core" in words


@pytest.mark.parametrize("package", AOT, ids=[p.name for p in AOT])
def test_aot_wheel_is_built_once_and_tested_per_python(package):
    """The hook tags its wheel py3-none-<platform> (cula_core.cute_runtime.aot.wheel_tag); after auditwheel it is
    manylinux, and cibuildwheel reuses it for every later identifier (it compiles the kernels once per job)."""
    from cibuildwheel.util.packaging import find_compatible_wheel
    from packaging.utils import parse_wheel_filename

    from cula_core.cute_runtime import aot

    tag = aot.wheel_tag()
    assert tag.startswith("py3-none-linux_")
    repaired = tag.replace("-linux_", "-manylinux_2_28_")
    wheel = type("Wheel", (), {"name": f"{package.import_name}-{package.version}-{repaired}.whl"})()
    assert {str(t) for t in parse_wheel_filename(wheel.name)[3]} == {repaired}
    idents = build_identifiers(package.path, CIBW_ARCHS_LINUX=tag.split("-linux_")[1])
    assert len(idents) == len(POLICY["python"])
    assert all(find_compatible_wheel([wheel], i) is wheel for i in idents[1:]), idents
    # a per-interpreter tag would not be reused: the check above can fail
    cp310 = type("Wheel", (), {"name": wheel.name.replace("py3-none", "cp310-cp310")})()
    assert find_compatible_wheel([cp310], idents[-1]) is None


@pytest.mark.parametrize("package", AOT, ids=[p.name for p in AOT])
def test_aot_wheel_test_checks_every_configuration_is_shipped(package):
    """test-command: in the installed wheel's venv, every configuration of the package's set (cut as the build
    was: CULA_AOT_LIMIT) resolves to a shipped artifact (cula_core.cute_runtime.aot.unshipped is empty); the
    repair keeps the libraries the kernels link against (the installed CuTe DSL's and TVM-FFI's) out."""
    test_command = cibw_linux_option(package, "test-command")
    assert f"from {package.import_name}.kernels import aot_configurations" in test_command
    assert "aot.unshipped(items)" in test_command and "assert not missing" in test_command
    assert "aot.limit_from_env()" in test_command
    repair = cibw_linux_option(package, "repair-wheel-command")
    assert "--exclude libcute_dsl_runtime.so" in repair and "--exclude libtvm_ffi.so" in repair
    before_test = " ".join(cibw_linux_option(package, "before-test"))
    assert "{package}/../cula-core" in before_test  # the checkout's core, which the wheel may need


def test_sm100_release_builds_every_served_arch():
    """cula-sm100's release wheel carries the kernels of every arch its backend serves (CULA_SM100_AOT_ARCHS),
    and its test-command checks the same list."""
    pytest.importorskip("cula_sm100")
    from cula_sm100 import runtime

    from cula_core.cute_runtime import aot

    (package,) = [p for p in AOT if p.name == "cula-sm100"]
    env = cibw_linux_option(package, "environment")
    assert aot.archs_from_env("CULA_SM100_AOT_ARCHS", runtime.ARCHS, env) == runtime.ARCHS
    assert set(env["CULA_SM100_AOT_ARCHS"].split(",")) == set(runtime.ARCHS)
    assert "aot.archs_from_env('CULA_SM100_AOT_ARCHS', runtime.ARCHS)" in cibw_linux_option(package, "test-command")
