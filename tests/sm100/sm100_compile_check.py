"""Compile every cula-sm100 forward kernel with fake pointers through cula_core.cute_runtime, for the arch
given (no GPU needed).

    python tests/sm100/sm100_compile_check.py sm_100a      # prints one line per kernel
"""

from __future__ import annotations

import time

import torch

from cula_sm100.forward import launch

bf, f32 = torch.bfloat16, torch.float32
KERNELS = {
    "l2norm": lambda: launch.l2norm_kernel(bf),
    "gate_cumsum[precomputed]": lambda: launch.gate_kernel("precomputed", f32, f32, f32, False, False, None),
    "gate_cumsum[softplus]": lambda: launch.gate_kernel("softplus", bf, f32, f32, True, True, None),
    "gate_cumsum[safe]": lambda: launch.gate_kernel("safe", f32, f32, f32, False, True, -5.0),
    "chunk_intra": lambda: launch.intra_kernel(bf, "sigmoid"),
    "recompute_w_u": lambda: launch.wu_kernel(f32, "none"),
    "chunk_intra_wu": lambda: launch.intra_wu_kernel(bf, "none"),
    # the forward's main configuration (FLA's softplus gate, fp32 g, A_log and dt_bias); every other compile key of
    # this kernel is compiled by test_chunk_intra_wu_cpu.py
    "chunk_intra_wu_gate[softplus]": lambda: launch.intra_wu_gate_kernel("softplus", f32, f32, f32, True, True, None,
                                                                        bf, "none"),
    # its qg_out variant (qg = bf16(q e^G) and G's last rows out: forward(intermediates=False)'s stage)
    "chunk_intra_wu_gate[softplus, qg_out]": lambda: launch.intra_wu_gate_kernel("softplus", f32, f32, f32, True, True,
                                                                                None, bf, "none", True),
    "chunk_delta_h": lambda: launch.delta_h_kernel(True, True),
    "chunk_delta_h[no states]": lambda: launch.delta_h_kernel(False, False),
    "chunk_delta_h[no cluster]": lambda: launch.delta_h_kernel(False, False, False),
    "chunk_delta_h[2 stages]": lambda: launch.delta_h_kernel(True, True, False, 2),
    "fwd_o": lambda: launch.fwd_o_kernel(),
    "fwd_o[qg_in]": lambda: launch.fwd_o_kernel(True),
}

if __name__ == "__main__":
    import sys

    from cula_sm100 import runtime

    for name, kernel in KERNELS.items():
        t = time.perf_counter()
        runtime.compile_kernel(kernel(), sys.argv[1])
        print(f"compiled {name} in {time.perf_counter() - t:.1f} s", flush=True)
