#!/usr/bin/env bash
# The README's test command: set up .venv (see tools/_venv.sh), install the test requirements, run pytest
# over tests/. GPU tests (marker `gpu`) skip cleanly where no CUDA device is. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
if [ -f tools/requirements-test.txt ]; then
    step "installing the test requirements (tools/requirements-test.txt: CuTe DSL and the packaging tools, a few hundred MB the first time)"
    "$PY" -m pip install -r tools/requirements-test.txt
fi
step "running pytest $*"
exec "$PY" -m pytest "$@"
