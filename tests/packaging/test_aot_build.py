"""Ahead-of-time kernel builds of the arch wheels (cula_core.cute_runtime.aot, the build hooks of cula-sm90 and
cula-sm100): the build settings read from the environment, the parallel compile (every configuration handed out,
a failure named), cula-sm100's per-arch names resolving to a shipped manifest, and (slow) a real opt-in wheel
build of a few configurations per package, installed and loaded with no compile."""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from pkgtest import REPO_ROOT, clean_env
from packaging.utils import parse_wheel_filename

from cula_core import cute_runtime as rt
from cula_core.cute_runtime import aot

PROBE_DIR = REPO_ROOT / "tests" / "core"


# ---------------------------------------------------------------- build settings

def test_jobs_come_from_the_environment_else_the_machine():
    assert aot.jobs_from_env({"CULA_AOT_JOBS": "16"}) == 16
    assert aot.jobs_from_env({}) == aot.jobs_from_env({"CULA_AOT_JOBS": " "}) == aot.default_jobs()
    assert 1 <= aot.default_jobs() <= len(os.sched_getaffinity(0))
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError, match=f"CULA_AOT_JOBS must be a positive integer, got '{bad}'"):
            aot.jobs_from_env({"CULA_AOT_JOBS": bad})


def test_limit_comes_from_the_environment():
    assert aot.limit_from_env({}) is None
    assert aot.limit_from_env({"CULA_AOT_LIMIT": "3"}) == 3
    with pytest.raises(ValueError, match="CULA_AOT_LIMIT must be a positive integer, got '0'"):
        aot.limit_from_env({"CULA_AOT_LIMIT": "0"})


def test_archs_come_from_the_environment_in_served_order():
    served = ("sm_90a", "sm_100a", "sm_103a")
    assert aot.archs_from_env("ARCHS", served, {}) == served
    assert aot.archs_from_env("ARCHS", served, {"ARCHS": "sm_103a, sm_90a"}) == ("sm_90a", "sm_103a")
    assert aot.archs_from_env("ARCHS", served, {"ARCHS": "sm_100a"}) == ("sm_100a",)
    with pytest.raises(ValueError, match=r"ARCHS: unknown arch 'sm_80' \(this package serves sm_90a, sm_100a, "
                                         r"sm_103a\)"):
        aot.archs_from_env("ARCHS", served, {"ARCHS": "sm_100a sm_80"})


def test_wheel_tag_is_python_independent():
    tag = aot.wheel_tag()
    assert tag.startswith("py3-none-") and tag != "py3-none-any"
    assert "-" not in tag.removeprefix("py3-none-") and "." not in tag


# ---------------------------------------------------------------- parallel compile (CuTe DSL)

@pytest.fixture
def probe(monkeypatch):
    """tests/core/cute_runtime_probe.py registered here and importable by the build's worker interpreters."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    monkeypatch.syspath_prepend(str(PROBE_DIR))
    import cute_runtime_probe

    return cute_runtime_probe


@pytest.mark.slow
def test_workers_build_every_configuration(probe, tmp_path):
    items = [(probe.NAME, (d,)) for d in (torch.float32, torch.bfloat16, torch.float16)]
    seen = []
    paths = rt.build_objects(items, tmp_path, jobs=2, progress=lambda done, total: seen.append((done, total)))
    assert paths == [tmp_path / (rt.artifact_id(*item) + ".o") for item in items]
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # nothing else left


@pytest.mark.slow
def test_a_failing_configuration_stops_the_build_and_is_named(probe, tmp_path):
    items = [(probe.NAME, (torch.float32,)), (probe.NAME, ("not-a-dtype",))]
    with pytest.raises(RuntimeError, match=r'compiling CuTe DSL kernel probe\.fill \["not-a-dtype"\] failed '
                                           r"\(worker exit status 1\)") as info:
        rt.build_objects(items, tmp_path, jobs=2)
    assert "Traceback" in str(info.value)


# ---------------------------------------------------------------- cula-sm100: per-arch names -> shipped artifacts

SM100_RESOLVE = """
import json, sys
from pathlib import Path
from cula_core import cute_runtime as rt
from cula_core.cute_runtime import aot
import cula_sm100
from cula_sm100 import kernels, runtime

folder = Path(cula_sm100.__file__).parent / "_aot"
assert folder.parent == Path(sys.argv[1]), cula_sm100.__file__
folder.mkdir()
items = kernels.aot_configurations()
rt.write_manifest(folder, "cula-sm100", sys.argv[2], " ".join(runtime.ARCHS), items)
(folder / "kernels.so").write_bytes(b"")  # never loaded: resolving reads the manifest only
rt.reset()
base = list(dict.fromkeys(kernels.forward_kernels() + kernels.backward_kernels()))
launched = {cap: [(runtime.kernel_name(n, runtime.arch_of(cap)), c) for n, c in base]
            for cap in ((9, 0), (10, 0), (10, 3))}
import torch
from cula_sm100.forward import launch
name, config = launch.l2norm_kernel(torch.float16)  # q/k in fp16: outside the served setups
outside = [(runtime.kernel_name(name, "sm_100a"), config)]
one = rt.resolve(*items[0])
print(json.dumps({
    "items": len(items), "base": len(base), "unshipped": len(aot.unshipped(items)),
    "launched_unshipped": {f"{a}.{b}": len(aot.unshipped(v)) for (a, b), v in launched.items()},
    "outside_unshipped": len(aot.unshipped(outside)),
    "one": [one.origin, one.path, one.symbol == rt.registry.symbol(rt.artifact_id(*items[0]))],
}))
"""


def test_sm100_launch_names_of_every_arch_resolve_to_the_shipped_manifest(tmp_path):
    """A copy of cula_sm100 with a manifest listing aot_configurations() (all archs; a placeholder library): every
    kernel its launch code names for a device of capability 9.0, 10.0 or 10.3 (`<name>@<arch>`) resolves as
    shipped, from that library; a configuration outside the set does not. No compile."""
    pytest.importorskip("cula_sm100")
    site = tmp_path / "site"
    shutil.copytree(REPO_ROOT / "packages/cula-sm100/src/cula_sm100", site / "cula_sm100",
                    ignore=shutil.ignore_patterns("__pycache__", "_aot"))
    env = dict(clean_env(), PYTHONPATH=os.pathsep.join([str(site), *sys.path]),
               CULA_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", SM100_RESOLVE, str(site / "cula_sm100"), version("cula-sm100")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["items"] == 3 * out["base"] and out["base"] > 0
    assert out["unshipped"] == 0
    assert out["launched_unshipped"] == {"9.0": 0, "10.0": 0, "10.3": 0}
    assert out["outside_unshipped"] == 1
    assert out["one"] == ["shipped", str(site / "cula_sm100" / "_aot" / "kernels.so"), True]
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- a real opt-in wheel build (slow)

LOAD_SHIPPED = """
import json, os, sys, warnings
from cula_core import cute_runtime as rt
warnings.simplefilter("error", rt.JitCompileWarning)  # a compile fails the run
from cula_core.cute_runtime import aot
import importlib
kernels = importlib.import_module(sys.argv[1] + ".kernels")
args = json.loads(sys.argv[2])
items = kernels.aot_configurations(*args)
built, rest = items[:int(sys.argv[3])], items[int(sys.argv[3]):]
fns = [rt.get(*item) for item in built]
print(json.dumps({
    "package_file": importlib.import_module(sys.argv[1]).__file__,
    "unshipped_built": len(aot.unshipped(built)), "unshipped_next": len(aot.unshipped(rest[:3])),
    "origins": sorted({rt.resolve(*item).origin for item in built}),
    "functions": sorted({type(f).__name__ for f in fns}), "dsl_imported": "cutlass" in sys.modules,
    "names": [n for n, _ in built],
    "plan_table": str(__import__("cula_core.cute_runtime.plan_table").cute_runtime.plan_table.library_path()),
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dist, package, archs_env, args", [
    ("cula-sm90", "cula_sm90", {}, []),
    ("cula-sm100", "cula_sm100", {"CULA_SM100_AOT_ARCHS": "sm_103a"}, [["sm_103a"]]),
])
def test_opt_in_wheel_ships_kernels_that_load_without_compiling(tmp_path, dist, package, archs_env, args):
    """HATCH_BUILD_HOOK_ENABLE_CUSTOM=true with CULA_AOT_LIMIT=2 and 2 jobs: a py3-none-<platform> wheel holding
    <package>/_aot/ (2 kernels), requiring the CuTe DSL it was built with; installed into a folder of its own, its
    kernels resolve as shipped and load with no compile (no notice, no DSL import, empty cache), the next
    configurations of the set do not resolve; the compiled plan table ships beside them and is found there."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    pytest.importorskip(package)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to link the kernels")
    env = clean_env(HATCH_BUILD_HOOK_ENABLE_CUSTOM="true", CULA_AOT_LIMIT="2", CULA_AOT_JOBS="2", **archs_env)
    dist_dir = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w",
                           str(dist_dir), str(REPO_ROOT / "packages" / dist)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist_dir.glob("*.whl")
    assert {str(t) for t in parse_wheel_filename(wheel.name)[3]} == {aot.wheel_tag()}
    with zipfile.ZipFile(wheel) as z:
        aot_files = sorted(n for n in z.namelist() if "/_aot/" in n)
        meta = email.parser.Parser().parsestr(
            z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
        manifest = json.loads(z.read(f"{package}/_aot/manifest.json"))
    from cula_core.cute_runtime import plan_table

    table = f"{package}/_aot/{plan_table.library_name()}"
    assert aot_files == sorted([f"{package}/_aot/kernels.so", f"{package}/_aot/manifest.json", table])
    assert f"nvidia-cutlass-dsl=={version('nvidia-cutlass-dsl')}" in meta.get_all("Requires-Dist")
    assert len(manifest["kernels"]) == 2 and manifest["distribution"] == dist

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, env=clean_env(), timeout=300)
    run_env = dict(clean_env(), PYTHONPATH=os.pathsep.join([str(site), *sys.path]),
                   CULA_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", LOAD_SHIPPED, package, json.dumps(args), "2"],
                          capture_output=True, text=True, env=run_env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert Path(out["package_file"]).is_relative_to(site)
    assert out["unshipped_built"] == 0 and out["unshipped_next"] == 3
    assert out["origins"] == ["shipped"] and out["functions"] == ["Function"] and out["dsl_imported"] is False
    if archs_env:
        assert all(n.endswith("@sm_103a") for n in out["names"]), out["names"]
    assert out["plan_table"] == str(site / table)  # the shipped plan table: nothing built
    assert not (tmp_path / "cache").exists()
