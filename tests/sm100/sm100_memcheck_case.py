"""Run under compute-sanitizer by test_sm100_forward_gpu.py::test_memcheck_clean_on_odd_shapes: the whole
forward (every kernel, every gate mode, q/k L2 norm, states) on odd shapes: T = 1, 63, 65, N = 1, GVA 1/2/4,
a varlen batch with empty and length-1 sequences, extreme decay (chunk_intra's fp32 sub-block path), and
chunk_delta_h both as clusters and as plain CTAs. Prints "cases ok" at the end; memcheck reports any out-of-bounds
or misaligned access."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from sm100_cases import make_inputs, seqlens_to_cu

from cula_sm100.forward import launch


def main():
    n = 0
    gates = [("precomputed", None), ("softplus", None), ("safe", -5.0)]
    for T, HQK, HV, B in ((1, 1, 1, 1), (63, 2, 4, 2), (65, 1, 4, 1)):
        for gate, lb in gates:
            q, k, v, g, beta, h0 = make_inputs(B, T, HQK, HV, seed=T, h0=True)
            A_log = torch.zeros(HV, device="cuda")
            dt_bias = torch.zeros(HV * 128, device="cuda")
            launch.forward(q, k, v, g, beta, A_log, dt_bias, h0, None, None, scale=0.1, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, gate=gate, lower_bound=lb, beta_activation="sigmoid")
            n += 1
    lengths = [0, 1, 63, 0, 65, 1]
    cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 8, seed=1, h0=True, N=len(lengths))
    for final in (False, True):
        _, _, it = launch.forward(q, k, v, g, beta, None, None, h0 if final else None, cu, cu_cpu, scale=0.1,
                                  output_final_state=final, use_qk_l2norm_in_kernel=False, gate="precomputed",
                                  lower_bound=None, beta_activation="none")
        n += 1
        ctab, stab = launch.tables(1, sum(lengths), cu, cu_cpu, q.device)
        # every launch form of chunk_delta_h, whatever the dispatch picks here
        for cluster, stages in ((True, 1), (False, 1), (False, 2)):
            launch.chunk_delta_h(it.w, it.u, it.kg, it.g_cumsum, h0 if final else None, ctab, stab,
                                 output_final_state=final, cluster=cluster, stages=stages)
            n += 1
    for T, HQK, HV in ((1, 1, 2), (65, 2, 4)):  # every diagonal block through the fp32 sub-block path
        q, k, v, g, beta, _ = make_inputs(1, T, HQK, HV, seed=T, decay="extreme")
        launch.forward(q, k, v, g, beta, None, None, None, None, None, scale=0.1, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, gate="precomputed", lower_bound=None, beta_activation="none")
        n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


def run_under_memcheck(**env):
    """This file under `compute-sanitizer --tool memcheck`, with `env` added to the environment; returns the
    CompletedProcess. API errors are not reported: the DSL probes
    device attributes through calls that may fail by design; every access of every kernel launch is checked.
    The caller skips when compute-sanitizer is not on PATH."""
    here = Path(__file__).resolve().parent
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
           "--report-api-errors", "no", sys.executable, str(here / "sm100_memcheck_case.py")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=here, env=dict(os.environ, **env))


if __name__ == "__main__":
    main()
