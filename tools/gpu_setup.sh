# Source on the lent GPU machine from the repository root: installs cula there and puts the GPU kit on the path.
#     source tools/gpu_setup.sh && python -m pytest -m gpu tests/core
# What to carry (prepare .whl and .rtlib once with tools/gpu_prepare.sh on the development machine). The kit
# (carried as .gpu: CuTe DSL, FLA 0.6.0, FlashKDA, hatchling; 59 MiB) and .whl + .rtlib (about 30 MiB with the
# prebuilt cula-sm90 wheel) exceed one call's 64 MiB together, so a fresh machine takes two calls back to back
# (the machine stays warm about 30 s between calls):
#     1. carry [".gpu"]:           source tools/gpu_setup.sh             (installs the kit into /tmp/gpu-site)
#     2. carry [".whl", ".rtlib"]: source tools/gpu_setup.sh && ...      (the kit found installed; cula installed)
# Later calls on the same warm machine carry [".whl", ".rtlib"] (or nothing new) and reinstall cula only when
# packages/ or .whl changed. Arch packages to install: CULA_GPU_PACKAGES (default: cula-sm90 cula-sm100; cula-sm89
# compiles CUDA C++ for minutes); a cula_sm90 wheel in .whl (tools/gpu_prepare.sh --aot) is installed instead of
# packages/cula-sm90.
_gpu_site=/tmp/gpu-site
if [ -f .gpu/setup.sh ]; then
    source .gpu/setup.sh || return 1
elif [ -f "$_gpu_site/.ready" ]; then
    export PYTHONPATH="$_gpu_site:$_gpu_site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$_gpu_site/bin:$PATH" PYTHONUNBUFFERED=1
else
    echo "gpu_setup: the kit is neither carried (.gpu) nor installed on this machine (a fresh machine: carry .gpu)" >&2
    return 1
fi
if [ ! -d .whl ]; then
    echo "gpu_setup: kit ready; carry .whl and .rtlib (tools/gpu_prepare.sh) in the next call to install cula" >&2
    return 0
fi
if [ -f .rtlib/libcute_dsl_runtime.so.xz ] && [ ! -f "$_gpu_site/.real-runtime" ]; then
    xz -dc .rtlib/libcute_dsl_runtime.so.xz > "$_gpu_site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so" \
        && touch "$_gpu_site/.real-runtime" || return 1
fi
_cula_tree=$(find packages .whl -type f \( -name '*.py' -o -name '*.cc' -o -name '*.toml' -o -name '*.whl' \) \
    | sort | xargs md5sum | md5sum)
if [ "$(cat "$_gpu_site/.cula-installed" 2>/dev/null)" != "$_cula_tree" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$_gpu_site" \
        $(ls .whl/*.whl | grep -v '/cula') || return 1
    _pkgs="packages/cula-core packages/cula"
    for _pkg in ${CULA_GPU_PACKAGES:-cula-sm90 cula-sm100}; do
        _wheel=$(ls .whl/${_pkg//-/_}-*.whl 2>/dev/null | head -1)
        _pkgs="$_pkgs ${_wheel:-packages/$_pkg}"
    done
    python3 -m pip install -q --no-build-isolation --no-deps --force-reinstall $_pkgs || return 1
    echo "$_cula_tree" > "$_gpu_site/.cula-installed"
fi
python3 -c "import torch, cula_core; print('gpu_setup: cula on', torch.cuda.get_device_name())"
