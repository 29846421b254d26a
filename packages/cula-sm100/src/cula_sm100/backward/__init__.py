"""cula_sm100.backward: the chunk_kda backward (bf16, K = V = 128, native GVA).

  chunk_wy_dqkg.py  CuTe DSL kernel: the fused WY / state backward (dq, dk summed over each GVA group, dv,
                    dbeta, dG, dL), one (chunk, q/k head) per CTA of 8 warps, dq / dk summed in registers
  chunk_bwd_dav.py  CuTe DSL kernel: dAqk = do v_new^T, dv = Aqk^T do, one (chunk, value head) per CTA
  chunk_bwd_dhu.py  CuTe DSL kernel: the reverse state recurrence (dh per chunk, dv += kg dh, dh0), one
                    (sequence, value head, 32 or 64 columns of V) per CTA
  chunk_bwd_intra_tc.py CuTe DSL kernel: the intra-chunk backward of the decayed scores on tensor cores and the
                    reverse cumsum of dG, one (chunk, q/k head) per CTA (GVA summed inside)
  chunk_bwd_intra.py the same stage on CUDA cores in fp32: the oracle of chunk_bwd_intra_tc's tests
  gate_bwd.py       CuTe DSL kernel: the gate / beta backward (dg of raw g, dA_log, ddt_bias, dbeta)
  l2norm_bwd.py     CuTe DSL kernel: the q/k L2-norm backward
  launch.py         kernel registration (cula_core.cute_runtime), one function per stage; chunk_kda_backward
                    recomputes the forward with cula_sm100.forward's kernels, then runs the stages in order
                    (docs/sm100_backward.md)
The PyTorch forms of the stages (the kernels' oracles) live with the tests (tests/sm100/torch_stages.py).
This module imports no CuTe DSL: a kernel is loaded (shipped, cached, or compiled then) on its first launch.
"""

from __future__ import annotations

import dataclasses

OPS: tuple[str, ...] = ("chunk_kda_backward",)


def unsupported_reason(call) -> str | None:
    """The backward recomputes the forward with cula_sm100.forward's kernels: it serves what they serve."""
    if call.op not in OPS:
        return f"sm100 does not implement {call.op}"
    from cula_sm100 import forward

    return forward.unsupported_reason(dataclasses.replace(call, op="chunk_kda"))


def accepts_residuals(call, fmt: str) -> bool:
    """Aqk and Akk in FLA 0.6.0's chunk-64 format, from whichever forward made them (this package's, or
    cula-sm90's on Hopper): launch.recompute then skips their recomputation (recompute_w_u reads Akk)."""
    from cula_core.backend import FLA_CHUNK64_RESIDUALS

    return call.op in OPS and fmt == FLA_CHUNK64_RESIDUALS


def kernel(op: str):
    if op not in OPS:
        raise NotImplementedError(f"sm100 has no kernel for {op}")
    from cula_sm100.backward import launch

    return launch.chunk_kda_backward
