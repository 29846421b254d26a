"""Run flash-linear-attention's own KDA op tests against cula: FLA's `tests/ops/test_kda.py` with its import of
`chunk_kda` and `fused_recurrent_kda` pointed at `cula`, everything else as FLA wrote it (FLA's naive references,
tolerances and error-text checks). Needs a GPU, FLA 0.6.0 and a checkout of FLA's tests (the file is not shipped
in FLA's wheel and not copied here).

    python -m tools.fla_op_tests /path/to/flash-linear-attention/tests/ops/test_kda.py [pytest arguments ...]

The rewritten copy goes to a temporary folder and pytest runs there (FLA's own conftest.py is not used: it
poisons torch.empty for FLA's kernels, which are not the ones under test). Tests of FLA internals in the same file
(its gate helpers, `fused_recurrent_kda_fwd`, the FlashKDA / Ascend routing) still run FLA's code. The exit
status is pytest's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

#: the line of FLA's test_kda.py that imports the two ops under test, and what it becomes
FLA_IMPORT = "from fla.ops.kda import chunk_kda, fused_recurrent_kda"
CULA_IMPORT = "from cula import chunk_kda, fused_recurrent_kda  # cula in place of FLA (tools/fla_op_tests.py)"


def point_at_cula(source: str) -> str:
    """`source` (FLA's test_kda.py) with its import of the ops under test replaced by cula's; ValueError when the
    file does not import them on one line of its own (another FLA version: check what it imports)."""
    lines = source.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == FLA_IMPORT]
    if len(hits) != 1:
        raise ValueError(f"expected exactly one line {FLA_IMPORT!r} in FLA's test file, found {len(hits)}")
    i = hits[0]
    lines[i] = lines[i].replace(FLA_IMPORT, CULA_IMPORT)
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file", type=Path, help="FLA's tests/ops/test_kda.py")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed to pytest (e.g. -q -k chunk)")
    args = ap.parse_args(argv)
    source = args.test_file.read_text()
    with tempfile.TemporaryDirectory(prefix="cula-fla-tests-") as tmp:
        target = Path(tmp) / "test_kda_cula.py"
        target.write_text(point_at_cula(source))
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", tmp, str(target),
               *args.pytest_args]
        return subprocess.call(cmd, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
