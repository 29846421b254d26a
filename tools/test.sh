#!/usr/bin/env bash
# The README's test command: set up .venv (see tools/_venv.sh), install the test requirements, run pytest
# over tests/. GPU tests (marker `gpu`) skip cleanly where no CUDA device is. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
if [ -f tools/requirements-test.txt ]; then
    "$PY" -m pip install -q -r tools/requirements-test.txt
fi
exec "$PY" -m pytest "$@"
