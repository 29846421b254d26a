"""Wheel build hook of cula-sm100: its CuTe DSL kernels compiled ahead of time, once per arch it serves.

Builds every configuration of `cula_sm100.kernels.aot_configurations(archs)` into `cula_sm100/_aot/` (one
kernels.so and its manifest, every arch's kernels under their `<name>@<arch>` names, found by
cula_core.cute_runtime at run time); the wheel is then tagged py3-none-<platform>. The work is
`cula_core.cute_runtime.aot.hatch_initialize`, shared with cula-sm90's hook. Compiling needs no GPU.

Opt-in (release builds): `HATCH_BUILD_HOOK_ENABLE_CUSTOM=true`, with cula-core, torch, nvidia-cutlass-dsl,
apache-tvm-ffi and a C compiler in the build environment (`--no-isolation`).
  CULA_SM100_AOT_ARCHS  the archs to build, comma- or space-separated (default: all of cula_sm100.runtime.ARCHS);
                        an arch left out still runs, compiled on its first launch
  CULA_AOT_JOBS         worker count (docs/runtime.md)
"""

from __future__ import annotations

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class AotKernelsHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        from cula_core.cute_runtime import aot

        aot.hatch_initialize(self, build_data, "cula_sm100", archs_env="CULA_SM100_AOT_ARCHS")
