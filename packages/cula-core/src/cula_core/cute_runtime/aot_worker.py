"""`python -m cula_core.cute_runtime.aot_worker JOBS`: compile and export the pickled job list JOBS (one worker of
cute_runtime.build_objects; a separate interpreter so that compiles run in parallel on separate cores)."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from cula_core.cute_runtime.registry import export_jobs

if __name__ == "__main__":
    export_jobs(pickle.loads(Path(sys.argv[1]).read_bytes()))
