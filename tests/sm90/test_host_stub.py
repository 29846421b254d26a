"""CPU tests of tools/bench/host_stub.py: it runs every public op's repeated call with the launches stubbed, prints a
row per op with a positive time, and each stubbed launch gets its kernel's argument count."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
OPS = ("kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer", "kda_prefill", "chunk_kda no grad")

pytest.importorskip("tvm_ffi")
pytest.importorskip("cutlass")


def _run_tool(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tools.bench.host_stub", "--calls", "20", "--runs", "1", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _table(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^\| ((?:op|piece): [^|]+?) \| ([0-9.]+) \|$", out, re.M)}


@pytest.mark.parametrize("launch", ["check", "nop"])
def test_tool_times_every_op_with_the_launches_stubbed(launch):
    out = _run_tool("--launch", launch)
    assert "NOT a GPU measurement" in out
    table = _table(out)
    for op in OPS:
        rows = [name for name in table if name.startswith(f"op: {op} (")]
        assert rows, f"no row for {op}:\n{out}"
        assert all(table[name] > 0 for name in rows), out
    assert any(name.startswith("piece: plan signature") for name in table), out
    if launch == "check":  # every launch passed its kernel's argument count (a mismatch raises in the tool)
        assert int(re.search(r"launches checked: (\d+)", out)[1]) > 0
        kernels = dict(re.findall(r"(sm90\.[a-z.]+) \((\d+) arguments\)", out))
        assert {"sm90.prefill.intra", "sm90.prefill.state"} <= set(kernels), out
        assert any(name.startswith("sm90.decode.") for name in kernels), out


def test_check_launch_refuses_a_wrong_argument_count():
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch

    from cula_sm90.prefill import forward
    from tools.bench.host_stub import Launches

    config = forward.state_config(False, torch.bfloat16, 128)
    launch = Launches("check").get(forward.STATE, config)
    launch(*range(18))  # 10 addresses, 7 sizes (the CTAs among them), the stream
    with pytest.raises(TypeError, match="takes 18 arguments"):
        launch(*range(17))
