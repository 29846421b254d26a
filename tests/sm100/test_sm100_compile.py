"""CPU: every cula-sm100 forward kernel compiles (CuTe DSL, fake pointers) for sm_90a and sm_100a."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sm100_compile_check import KERNELS

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernels_compile(arch):
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    proc = subprocess.run([sys.executable, str(HERE / "sm100_compile_check.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(KERNELS), proc.stdout
