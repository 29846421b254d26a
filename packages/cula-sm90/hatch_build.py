"""Wheel build hook of cula-sm90: compiles every CuTe DSL kernel configuration of
`cula_sm90.kernels.aot_configurations()` for sm_90a ahead of time (on a CPU machine: CuTe DSL compiles without a
GPU), links them into one library and ships it with its manifest as `cula_sm90/_aot/` (read by
cula_core.cute_runtime). The wheel is then platform-tagged.

Opt-in (a release build step, not every build): `HATCH_BUILD_HOOK_ENABLE_CUSTOM=true` (hatch's switch for a hook
that is off by default; the cibuildwheel configuration in pyproject.toml sets it). Needs nvidia-cutlass-dsl,
apache-tvm-ffi and a C compiler in the build environment (`python -m build --no-isolation`).

Build settings (they change how the set is built, never which kernel a call runs):
  CULA_AOT_JOBS    compile processes (default: the CPUs available); each configuration compiles on one core
  CULA_AOT_LIMIT   build only the first N configurations (tests of the packaging path)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class AotKernelsHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        sys.path.insert(0, str(root / "src"))  # this package's source, whatever is installed
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        from cula_core import cute_runtime as rt

        from cula_sm90.kernels import aot_configurations

        items = aot_configurations()
        limit = os.environ.get("CULA_AOT_LIMIT")
        if limit:
            items = items[: int(limit)]
        jobs = int(os.environ.get("CULA_AOT_JOBS") or len(os.sched_getaffinity(0)))
        out = Path(tempfile.mkdtemp(prefix="cula-sm90-aot-"))
        t0 = time.monotonic()

        def progress(done: int, total: int) -> None:
            if done == total or done % 25 == 0:
                self.app.display_info(f"cula-sm90 AOT: {done}/{total} kernels compiled "
                                      f"({time.monotonic() - t0:.0f} s, {jobs} jobs)")

        objects = rt.build_objects(items, out / "obj", jobs=jobs, progress=progress)
        rt.link_library(objects, out / rt.registry.LIBRARY)
        rt.write_manifest(out, self.metadata.name, self.metadata.version, "sm_90a", items)
        self.app.display_info(f"cula-sm90 AOT: {len(items)} kernels in {time.monotonic() - t0:.0f} s")
        for name in (rt.registry.LIBRARY, rt.registry.MANIFEST):
            build_data["force_include"][str(out / name)] = f"cula_sm90/{rt.registry.AOT_FOLDER}/{name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
