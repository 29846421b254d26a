"""Ahead-of-time builds of an arch wheel's CuTe DSL kernels: the one implementation behind the hatch build hooks of
cula-sm90 and cula-sm100 (their `hatch_build.py` list the configurations and call `build_into_wheel`).

`hatch_initialize` is the whole of a hook's `initialize`. A build compiles every listed (kernel name, configuration) (`build_objects`, in parallel worker interpreters),
links them into one `kernels.so`, writes `manifest.json` beside it, and adds both to the wheel as
`<package>/_aot/`, where `registry.get` finds them. The library holds no Python extension, so the wheel is tagged
`py3-none-<platform>`: one build serves every Python version (cibuildwheel reuses it for the later versions and
only tests it there). The manifest is valid only with the CuTe DSL version it was built with, so the wheel also
requires exactly that version.

Build settings read from the environment (they change how the set is built, never which kernel a call runs):
  CULA_AOT_JOBS    worker interpreters (default `default_jobs()`: the CPUs this process may use, at most one per
                   JOB_MEMORY bytes of available memory)
  CULA_AOT_LIMIT   build only the first N configurations (a quick check of the packaging path)
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from cula_core.cute_runtime import plan_table, registry

JOBS_ENV = "CULA_AOT_JOBS"
LIMIT_ENV = "CULA_AOT_LIMIT"
#: memory set aside per worker interpreter (one CuTe DSL compile peaks at about half of it)
JOB_MEMORY = 1 << 30


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_jobs() -> int:
    """Worker count for this machine: the CPUs this process may run on, lowered so that each worker has
    JOB_MEMORY bytes of the available memory; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = _available_memory()
    if memory is not None:
        cpus = min(cpus, memory // JOB_MEMORY)
    return max(1, cpus)


def _positive_int(environ: Mapping[str, str], variable: str) -> int | None:
    text = environ.get(variable, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{variable} must be a positive integer, got {text!r}")
    return value


def jobs_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """CULA_AOT_JOBS when set (a positive integer, else ValueError), else `default_jobs()`."""
    return _positive_int(environ, JOBS_ENV) or default_jobs()


def limit_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """CULA_AOT_LIMIT when set (a positive integer, else ValueError), else None (build everything)."""
    return _positive_int(environ, LIMIT_ENV)


def archs_from_env(variable: str, served: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The archs named by `variable` (comma- or space-separated, in `served` order), else all of `served`.
    ValueError names the variable, an unknown arch and the served ones."""
    text = environ.get(variable, "").replace(",", " ").split()
    if not text:
        return tuple(served)
    unknown = [a for a in text if a not in served]
    if unknown:
        raise ValueError(f"{variable}: unknown arch {unknown[0]!r} (this package serves {', '.join(served)})")
    return tuple(a for a in served if a in text)


def wheel_tag() -> str:
    """`py3-none-<platform>` of this interpreter's platform (linux_x86_64 before auditwheel makes it manylinux)."""
    return "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")


def build_artifacts(items: Sequence[tuple[str, tuple]], out_dir: Path | str, *, distribution: str, version: str,
                    archs: Sequence[str], jobs: int, say: Callable[[str], None] = print) -> list[Path]:
    """Compile `items` with `jobs` workers, link `<out_dir>/kernels.so`, write `<out_dir>/manifest.json`
    (format of registry.write_manifest; its arch field names `archs`, space-separated) and build the compiled plan
    table beside them (plan_table.library_name(), found there at run time). Returns [library, manifest, plan
    table]. `say` receives progress lines."""
    out_dir = Path(out_dir)
    items = list(items)
    t0 = time.monotonic()
    step = max(1, len(items) // 20)

    def progress(done: int, total: int) -> None:
        if done == total or done % step == 0:
            say(f"{distribution} AOT: {done}/{total} kernels compiled ({time.monotonic() - t0:.0f} s, {jobs} jobs)")

    with tempfile.TemporaryDirectory(prefix=f"{distribution}-aot-obj-") as tmp:
        objects = registry.build_objects(items, tmp, jobs=jobs, progress=progress)
        registry.link_library(objects, out_dir / registry.LIBRARY)
    manifest = registry.write_manifest(out_dir, distribution, version, " ".join(archs), items)
    table = plan_table.build(out_dir / plan_table.library_name())
    say(f"{distribution} AOT: {len(items)} kernels for {' '.join(archs)} built in {time.monotonic() - t0:.0f} s")
    return [out_dir / registry.LIBRARY, manifest, table]


def build_into_wheel(build_data: dict, *, distribution: str, version: str, package: str,
                     items: Sequence[tuple[str, tuple]], archs: Sequence[str],
                     say: Callable[[str], None] = print, environ: Mapping[str, str] = os.environ) -> list[Path]:
    """A hatch build hook's work: build `items` (cut to CULA_AOT_LIMIT, with CULA_AOT_JOBS workers) into a
    temporary folder, and set hatch's `build_data` so the wheel ships them as `<package>/_aot/`, is tagged
    `wheel_tag()` and requires the CuTe DSL version they were built with. Returns the shipped files."""
    limit = limit_from_env(environ)
    items = list(items)[:limit] if limit else list(items)
    out_dir = Path(tempfile.mkdtemp(prefix=f"{distribution}-aot-"))
    files = build_artifacts(items, out_dir, distribution=distribution, version=version, archs=archs,
                            jobs=jobs_from_env(environ), say=say)
    for path in files:
        build_data["force_include"][str(path)] = f"{package}/{registry.AOT_FOLDER}/{path.name}"
    build_data["pure_python"] = False
    build_data["tag"] = wheel_tag()
    build_data.setdefault("dependencies", []).append(f"nvidia-cutlass-dsl=={registry.dsl_version()}")
    return files


def hatch_initialize(hook, build_data: dict, package: str, *, archs: Sequence[str] | None = None,
                     archs_env: str | None = None) -> None:
    """The `initialize` of an arch package's hatch build hook (`hook`: the BuildHookInterface instance): for a
    wheel, put the hook's source tree (`<root>/src`) first on sys.path, list the configurations of
    `<package>.kernels.aot_configurations` and `build_into_wheel` them. Single-arch packages pass `archs` (the
    function takes no argument); a multi-arch one passes `archs_env`, the variable choosing among
    `<package>.runtime.ARCHS` (`archs_from_env`), which are then passed to the function."""
    if hook.target_name != "wheel":
        return
    sys.path.insert(0, str(Path(hook.root) / "src"))  # this source tree's package, whatever is installed
    kernels = importlib.import_module(f"{package}.kernels")
    if archs_env is not None:
        archs = archs_from_env(archs_env, importlib.import_module(f"{package}.runtime").ARCHS)
        items = kernels.aot_configurations(archs)
    elif archs is not None:
        items = kernels.aot_configurations()
    else:
        raise TypeError("hatch_initialize: pass archs (single-arch package) or archs_env (multi-arch package)")
    build_into_wheel(build_data, distribution=hook.metadata.name, version=hook.metadata.version, package=package,
                     items=items, archs=archs, say=hook.app.display_info)


def unshipped(items: Sequence[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """The (registered kernel name, configuration) of `items` that do not resolve to a shipped artifact (the
    installed wheel's manifest: its DSL version, package version and source hashes current). Compiles nothing."""
    out = []
    for name, config in items:
        art = registry.resolve(name, config)
        if art is None or art.origin != "shipped":
            out.append((name, config))
    return out
