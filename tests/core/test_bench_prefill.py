"""The CPU side of tools/bench/prefill.py: the rendering of a card's table from synthetic rows (no GPU, no FLA),
with FLA timed on every shape, on a subset (`--fla-subset`) or on none (`--no-fla`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import prefill as bench  # noqa: E402

ENV = {"gpu": "Test GPU", "torch": "t", "cuda": "c", "triton": "tr", "fla-core": "f", "cula-sm90": "s"}


def rows(fla_on):
    out = []
    for i, (cula, fk, fla) in enumerate([(1.0, 2.0, 4.0), (2.0, 1.0, 3.0), (1.0, 1.0, 8.0)]):
        r = {"shape": f"shape {i}", "cula_ms": cula, "flashkda_ms": fk, "err_flashkda": 1e-2}
        if i in fla_on:
            r["fla_ms"] = fla
        out.append(r)
    return out


def table(text):
    return [line for line in text.splitlines() if line.startswith("| shape ") and not line.startswith("| shape |")]


def test_every_shape_with_fla():
    text = bench.render(rows({0, 1, 2}), ENV, "cmd")
    assert "| shape | cula ms | FlashKDA ms | FLA ms | vs FlashKDA | vs FLA | err vs FlashKDA |" in text
    assert table(text)[1] == "| shape 1 | 2.000 | 1.000 | 3.000 | 0.50x | 1.50x | 1.0e-02 |"
    assert "vs FlashKDA: geomean 1.00x, min 0.50x over 3 shapes." in text
    assert "vs FLA: geomean 3.63x, min 1.50x over 3 shapes." in text  # (4 * 1.5 * 8) ** (1 / 3)


def test_fla_on_a_subset_leaves_dashes_and_averages_over_the_subset():
    text = bench.render(rows({0, 2}), ENV, "cmd")
    assert table(text)[1] == "| shape 1 | 2.000 | 1.000 | - | 0.50x | - | 1.0e-02 |"
    assert table(text)[2] == "| shape 2 | 1.000 | 1.000 | 8.000 | 1.00x | 8.00x | 1.0e-02 |"
    assert "vs FLA: geomean 5.66x, min 4.00x over 2 shapes." in text


def test_without_fla_no_fla_columns():
    text = bench.render(rows(set()), ENV, "cmd")
    assert "FLA ms" not in text and "vs FLA" not in text
    assert table(text)[0] == "| shape 0 | 1.000 | 2.000 | 2.00x | 1.0e-02 |"


def test_the_fla_subset_is_part_of_the_grid():
    grid = bench.FIXED + bench.VARLEN + bench.EXTRA
    assert len(bench.FLA_SUBSET) == 6 and all(s in grid for s in bench.FLA_SUBSET)


def test_no_fla_and_fla_subset_exclude_each_other():
    with pytest.raises(SystemExit):
        bench.main(["--no-fla", "--fla-subset"])
