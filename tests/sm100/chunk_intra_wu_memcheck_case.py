"""Run under compute-sanitizer by test_chunk_intra_wu_gpu.py::test_fused_memcheck_clean_on_odd_shapes: the fused
chunk_intra + recompute_w_u kernel on odd shapes: T = 1, 63, 65 (rows past the chunk end), N = 1, GVA 1 / 2 / 4,
beta activations none / sigmoid, a varlen batch with empty and length-1 sequences, extreme decay (every diagonal
block through the fp32 sub-block path). Prints "cases ok" at the end; memcheck reports any out-of-bounds or
misaligned access.

    python tests/sm100/chunk_intra_wu_memcheck_case.py                 # the cases alone
    compute-sanitizer --tool memcheck --error-exitcode 9 --leak-check no --report-api-errors no \\
        python tests/sm100/chunk_intra_wu_memcheck_case.py
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

from sm100_cases import flat, make_inputs, seqlens_to_cu

from cula_sm100.forward import launch


def one(q, k, v, g, beta, B, T, cu, cu_cpu, beta_activation):
    HV = v.shape[2]
    ctab, _ = launch.tables(B, T, cu, cu_cpu, q.device)
    G = launch.gate_cumsum(flat(g).contiguous(), None, None, ctab, gate="precomputed", lower_bound=None)
    launch.chunk_intra_wu(q, k, v, G.reshape(-1, HV, 128), beta, ctab, scale=0.1, beta_activation=beta_activation)


def main():
    n = 0
    for T, HQK, HV, B in ((1, 1, 1, 1), (63, 2, 4, 2), (65, 1, 4, 1), (65, 2, 2, 1)):
        for act in ("none", "sigmoid"):
            q, k, v, g, beta, _ = make_inputs(B, T, HQK, HV, seed=T)
            one(q, k, v, g, beta, B, T, None, None, act)
            n += 1
    lengths = [0, 1, 63, 0, 65, 1]
    cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), 2, 8, seed=1, N=len(lengths))
    one(q, k, v, g, beta, 1, sum(lengths), cu, cu_cpu, "none")
    n += 1
    for T, HQK, HV in ((1, 1, 2), (65, 2, 4)):
        q, k, v, g, beta, _ = make_inputs(1, T, HQK, HV, seed=T, decay="extreme")
        one(q, k, v, g, beta, 1, T, None, None, "none")
        n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


def run_under_memcheck(script=None, **env):
    """`script` (default: this file) under `compute-sanitizer --tool memcheck`, with `env` added to the environment;
    returns the CompletedProcess (API errors not reported: the DSL probes device attributes through calls that may
    fail by design; every access of every kernel launch is checked). The caller skips when compute-sanitizer is
    absent."""
    here = Path(__file__).resolve().parent
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
           "--report-api-errors", "no", sys.executable, str(script or here / "chunk_intra_wu_memcheck_case.py")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=here, env=dict(os.environ, **env))


def assert_memcheck_clean(script):
    """The body of a memcheck test: skip without compute-sanitizer, else run `script` (its own memcheck cases, which
    end by printing "... cases ok") under run_under_memcheck and assert a clean exit and 0 errors."""
    import shutil

    import pytest

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    proc = run_under_memcheck(script=script)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[:6000] + proc.stderr[-3000:]
    assert "cases ok" in proc.stdout
    assert "ERROR SUMMARY: 0 errors" in proc.stdout


if __name__ == "__main__":
    main()
