"""`python -m cula info` and `python -m cula demo` run and print what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

import pytest
import torch


def run_cula(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "cula", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_info():
    out = run_cula("info")
    assert f"cula-core    {metadata.version('cula-core')}" in out
    assert f"torch {torch.__version__}" in out
    for op in ("chunk_kda", "kda_prefill", "kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer",
               "kda_flush_kvbuffer", "kda_flush_kvbuffer_all_layers"):
        assert re.search(rf"^    {op}\s+\S", out, re.M), f"no dispatch line for {op}"
    # The arch packages of this checkout are installed (tools/_venv.sh) and report whether they loaded.
    for name in ("sm89", "sm90", "sm100"):
        assert re.search(rf"^  {name}\s+(loaded|FAILED)", out, re.M), out
    # what the CuTe runtime ships and caches, and that anything else compiles just in time
    assert re.search(r"^  \d+ shipped in the wheels.*, \d+ in the disk cache .*just in time", out, re.M), out
    if not torch.cuda.is_available():
        assert "no CUDA device visible" in out
        assert "kda_prefill                    reference (inputs are on cpu; cula kernels run on CUDA devices)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU route; the GPU route is checked in tests/sm*")
def test_demo_on_cpu_runs_the_reference_and_reports_errors():
    out = run_cula("demo")
    lines = out.splitlines()
    assert lines[0].startswith("cula demo on cpu")
    rows = {name: line for line in lines for name in ("kda_prefill", "kda_decode", "chunk_kda fwd+bwd")
            if line.strip().startswith(name)}
    assert set(rows) == {"kda_prefill", "kda_decode", "chunk_kda fwd+bwd"}
    for _name, line in rows.items():
        assert "backend reference" in line, line
        assert re.search(r"\d+\.\d+ ms", line), line
        err = float(re.search(r"vs (?:fp64 )?reference ([0-9.e+-]+)", line).group(1))
        # fp32 on CPU: the reference against itself is exact; fp32 gradients vs fp64 to fp32 rounding.
        assert err < (1e-4 if "grad" in line else 1e-6), line


def test_help_lists_the_commands():
    out = run_cula("--help")
    assert "info" in out and "demo" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_demo_on_cuda_without_cuda_says_why():
    """`python -m cula demo --device cuda` on a machine without CUDA: exit status 2 and one clear line on stderr
    (no traceback), before any workload runs."""
    proc = subprocess.run([sys.executable, "-m", "cula", "demo", "--device", "cuda"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "--device cuda: no CUDA device is available here" in proc.stderr
    assert "leave --device out" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_demo_device_names_what_is_wrong():
    from cula_core import cli

    assert cli.demo_device("cpu") == torch.device("cpu")
    assert cli.demo_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device 'nonsense' is not a torch device"):
        cli.demo_device("nonsense")
    with pytest.raises(ValueError, match="--device meta: the demo runs on cpu or cuda, got meta"):
        cli.demo_device("meta")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"this machine has {n} CUDA device"):
            cli.demo_device(f"cuda:{n}")
    else:
        with pytest.raises(ValueError, match="no CUDA device is available here"):
            cli.demo_device("cuda:0")
