# Sourced by tools/test.sh and tools/demo.sh: make .venv (reusing a torch already on the machine through
# --system-site-packages), install torch if it is missing, then cula's packages in editable mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
PY="$ROOT/.venv/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
# Build tools for the editable installs (no build isolation: nothing is fetched per package).
"$PY" -m pip install -q "hatchling>=1.21" editables "pybind11>=2.12" pytest
# Editable installs, core first. An arch package whose build fails (e.g. no nvcc) is reported, not fatal:
# the tests of that package then say why they skip.
"$PY" -m pip install -q --no-build-isolation --no-deps -e packages/cula-core -e packages/cula
for pkg in packages/cula-sm89 packages/cula-sm90 packages/cula-sm100; do
    if ! "$PY" -m pip install -q --no-build-isolation --no-deps -e "$pkg"; then
        echo "warning: editable install of $pkg failed; its tests will report why" >&2
    fi
done
