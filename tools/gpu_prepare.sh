#!/usr/bin/env bash
# Run on the development (CPU) machine, from the repository root, after tools/test.sh has made .venv: prepares what
# a run on this project's lent GPU machine needs beside the GPU kit (carried as .gpu) and cannot download there
# (that machine reaches no registry):
#   .whl/   pathspec and editables (hatchling's needs for installs without build isolation) and apache-tvm-ffi for
#           the GPU machine's Python 3.12 (the runtime layer loads kernels through it); with --aot also a cula-sm90
#           wheel with every kernel configuration compiled ahead of time (CULA_AOT_JOBS workers; about 10 minutes
#           on 2 cores), so that GPU runs compile nothing;
#   .rtlib/ CuTe DSL's real runtime library, xz-compressed (13.5 MB): the kit's stand-in forwards the CUDA runtime
#           only, and the TVM-FFI kernels need the rest of it (docs/runtime.md, "What has run on a GPU").
# The kit (59 MiB) and .rtlib + .whl do not fit one call's 64 MiB carry: tools/gpu_setup.sh says how to split.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
aot=0
for arg in "$@"; do
    case "$arg" in
        --aot) aot=1 ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument $arg (--aot, --help)" >&2; exit 2 ;;
    esac
done
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl .rtlib
"$PY" -m pip download -q --no-deps -d .whl pathspec editables
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d .whl "apache-tvm-ffi==$(version apache-tvm-ffi)"
dsl=$(version nvidia-cutlass-dsl)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$tmp" "nvidia-cutlass-dsl-libs-cu13==$dsl"
"$PY" -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/x"
xz -T0 -9 -c "$tmp/x/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so" > .rtlib/libcute_dsl_runtime.so.xz
if [ "$aot" = 1 ]; then
    rm -f .whl/cula_sm90-*.whl
    HATCH_BUILD_HOOK_ENABLE_CUSTOM=true "$PY" -m pip wheel -q --no-build-isolation --no-deps -w .whl packages/cula-sm90
fi
du -sh .whl .rtlib
