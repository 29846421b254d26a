"""Wheel build hook of cula-sm90: its CuTe DSL kernels compiled ahead of time for sm_90a.

Builds every configuration of `cula_sm90.kernels.aot_configurations()` into `cula_sm90/_aot/` (kernels.so and its
manifest, found by cula_core.cute_runtime at run time); the wheel is then tagged py3-none-<platform>. The work is
`cula_core.cute_runtime.aot.hatch_initialize`, shared with cula-sm100's hook. Compiling needs no GPU.

Opt-in (release builds): `HATCH_BUILD_HOOK_ENABLE_CUSTOM=true`, with cula-core, torch, nvidia-cutlass-dsl,
apache-tvm-ffi and a C compiler in the build environment (`--no-isolation`). Worker count: CULA_AOT_JOBS
(docs/runtime.md).
"""

from __future__ import annotations

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class AotKernelsHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        from cula_core.cute_runtime import aot

        aot.hatch_initialize(self, build_data, "cula_sm90", archs=("sm_90a",))
