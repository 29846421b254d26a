"""tools/fla_op_tests.py: FLA's test_kda.py is run with its two ops taken from cula, nothing else changed."""

from __future__ import annotations

import pytest

from tools import fla_op_tests

HEADER = "import torch\n\nfrom fla.ops.kda import chunk_kda, fused_recurrent_kda\nfrom fla.ops.kda.naive import x\n"


def test_only_the_import_of_the_ops_under_test_changes():
    body = "def test_a():\n    assert chunk_kda is not None\n"
    out = fla_op_tests.point_at_cula(HEADER + body)
    assert out == ("import torch\n\n" + fla_op_tests.CULA_IMPORT + "\nfrom fla.ops.kda.naive import x\n" + body)
    assert fla_op_tests.CULA_IMPORT.startswith("from cula import chunk_kda, fused_recurrent_kda")


@pytest.mark.parametrize("source", ["import torch\n", HEADER + HEADER])
def test_a_file_that_does_not_import_the_ops_once_is_refused(source):
    with pytest.raises(ValueError, match="expected exactly one line 'from fla.ops.kda import chunk_kda, "
                                         "fused_recurrent_kda' in FLA's test file, found [02]"):
        fla_op_tests.point_at_cula(source)


def test_the_rewritten_file_runs_under_pytest_with_culas_ops(tmp_path):
    # a stand-in for FLA's file: the ops it imports must be cula's, and pytest's status comes back
    (tmp_path / "test_kda.py").write_text(
        "from fla.ops.kda import chunk_kda, fused_recurrent_kda\n\n"
        "import cula\n\n"
        "def test_ops_are_culas():\n"
        "    assert chunk_kda is cula.chunk_kda and fused_recurrent_kda is cula.fused_recurrent_kda\n\n"
        "def test_fails():\n"
        "    assert False\n")
    assert fla_op_tests.main([str(tmp_path / "test_kda.py"), "-q", "-k", "culas"]) == 0
    assert fla_op_tests.main([str(tmp_path / "test_kda.py"), "-q"]) == 1
