#!/usr/bin/env bash
# The README's demo command: set up .venv (see tools/_venv.sh) and run `python -m cula demo`, a small KDA
# workload on the best backend of this machine (the reference on a CPU machine). Extra arguments go to it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
step "running python -m cula demo $*"
exec "$PY" -m cula demo "$@"
