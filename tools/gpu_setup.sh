# Source on the GPU machine from the repository root (carry ".gpu" and ".whl"):
#     source tools/gpu_setup.sh && python -m pytest -m gpu tests/core
# It sources the kit (.gpu/setup.sh: CuTe DSL, FLA 0.6.0, hatchling), adds the two small wheels hatchling
# needs there and the image lacks (pathspec; editables for editable installs), then installs cula's
# packages with no build isolation. Prepare .whl once on the CPU machine:
#     mkdir -p .whl && pip download --no-deps -d .whl pathspec editables
# Arch packages to install are taken from CULA_GPU_PACKAGES (default: all of them).
source .gpu/setup.sh || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .whl/*.whl || return 1
for pkg in cula-core cula ${CULA_GPU_PACKAGES:-cula-sm89 cula-sm90 cula-sm100}; do
    python3 -m pip install -q --no-build-isolation --no-deps "packages/$pkg" || { echo "install of $pkg failed" >&2; return 1; }
done
