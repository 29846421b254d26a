"""`python -m cula_core.cute_runtime.aot_worker JOBS`: one worker interpreter of cute_runtime.build_objects.

JOBS is a pickled list of (registering module, kernel name, configuration, output folder). The worker reads
indices into it from stdin, one per line; for each it compiles and exports that configuration (registry.export_one)
and then writes the same line to stdout. It exits at the end of its input, or with status 1 and the traceback on
stderr at the first failure. One compile at a time per worker, so a build's parallelism and peak memory are its
number of workers."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from cula_core.cute_runtime.registry import export_one


def main(job_file: str) -> None:
    work = pickle.loads(Path(job_file).read_bytes())
    for line in sys.stdin:
        export_one(*work[int(line)])
        sys.stdout.write(line)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
