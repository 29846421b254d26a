# Sourced by tools/test.sh and tools/demo.sh: make .venv (reusing a torch already on the machine through
# --system-site-packages), install torch if it is missing, then cula's packages in editable mode. Each step
# prints a line before it starts (the first torch install downloads ~1 GB and can take minutes), and pip shows
# its own progress for the downloads.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
step() { echo "[cula setup] $*" >&2; }
if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $("$PYTHON" --version 2>&1) (--system-site-packages: a torch already installed is reused)"
    "$PYTHON" -m venv --system-site-packages .venv
fi
PY="$ROOT/.venv/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    step "installing torch==2.13.0 (not found; a large download, pip shows its progress)"
    "$PY" -m pip install --progress-bar on "torch==2.13.0"
else
    step "torch $("$PY" -c 'import torch; print(torch.__version__)') found"
fi
# Build tools for the editable installs (no build isolation: nothing is fetched per package).
step "installing build tools (hatchling, editables, pybind11) and pytest"
"$PY" -m pip install -q "hatchling>=1.21" editables "pybind11>=2.12" pytest
# Editable installs, core first. An arch package whose build fails (e.g. no nvcc) is reported, not fatal:
# the tests of that package then say why they skip.
step "installing cula-core and cula (editable)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e packages/cula-core -e packages/cula
for pkg in packages/cula-sm89 packages/cula-sm90 packages/cula-sm100; do
    case "$pkg" in
        */cula-sm89) step "installing cula-sm89 (editable; compiles its CUDA code when nvcc is present: a few minutes)" ;;
        *) step "installing ${pkg#packages/} (editable)" ;;
    esac
    if ! "$PY" -m pip install -q --no-build-isolation --no-deps -e "$pkg"; then
        echo "warning: editable install of $pkg failed; its tests will report why" >&2
    fi
done
step "setup done"
