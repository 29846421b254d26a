"""cula_sm100.forward: the chunk_kda training forward (bf16, K = V = 128, native GVA) in CuTe DSL.

Kernels, one per file, launched in this order by `launch.forward` (`launch.py`: tables, buffers, registration):
  l2norm.py              q/k L2 normalisation (use_qk_l2norm_in_kernel)
  chunk_intra_wu_gate.py the gate (precomputed / softplus / safe) and its chunk-local cumsum G, then Aqk,
                         Akk = (I + L)^-1, w, u and kg per chunk of 64; through chunk_kda's call (the qg path) also
                         qg = bf16(q e^G), with G written only at each chunk's last row
  chunk_delta_h.py       the inter-chunk state recurrence: per-chunk h, v_new, final state
  fwd_o.py               o from qg (formed from q and G, or read as chunk_intra_wu_gate wrote it), h, Aqk, v_new
and for the backward's recompute (and the forward kernels' GPU tests, as oracles):
  gate_cumsum.py         gate and G alone
  chunk_intra_wu.py      chunk_intra_wu_gate's work from G (the two below in one kernel, bitwise)
  recompute_w_u.py       w, u and kg alone (the backward's, when the forward handed it Akk)
  chunk_intra.py         Aqk and Akk alone (launched by no production path: the GPU tests' oracle of chunk_intra_wu)
All multiply with warp-level mma.sync (bf16 -> fp32, `cula_core.cute_kernels.warp_mma`), so they run on sm_90 and
sm_100.

When gradients are wanted the forward hands Aqk and Akk to the backward as core's
residuals in FLA 0.6.0's chunk-64 format (docs/backends.md, "Residuals"); cula_sm100.backward reads that format
from any forward (on Hopper, cula-sm90's) and recomputes the rest with `launch`'s stage functions.
This module imports no CuTe DSL: a kernel is loaded (shipped, cached, or compiled then) on its first launch.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

OPS: tuple[str, ...] = ("chunk_kda",)
HEAD_DIM = 128
BETA_ACTIVATIONS = ("none", "sigmoid", "2sigmoid")
GATES = ("precomputed", "softplus", "safe")


@functools.lru_cache(maxsize=1)
def dsl_missing() -> str | None:
    """Why the CuTe DSL cannot be used here, or None."""
    if importlib.util.find_spec("cutlass") is None:
        return "sm100 needs nvidia-cutlass-dsl (CuTe DSL), which is not installed"
    return None


def unsupported_reason(call) -> str | None:
    if call.op not in OPS:
        return f"sm100 does not implement {call.op}"
    if call.device.type != "cuda":
        return f"sm100 runs on CUDA devices, got {call.device.type}"
    if call.dtype != torch.bfloat16:
        return f"sm100 serves bf16 q/k/v only, got {str(call.dtype).replace('torch.', '')}"
    if call.K != HEAD_DIM or call.V != HEAD_DIM:
        return f"sm100 serves K=V=128 only, got K={call.K}, V={call.V}"
    if call.gate not in GATES:
        return f"sm100 does not serve gate {call.gate!r}"
    act = call.options.get("beta_activation", "none")
    if act not in BETA_ACTIVATIONS:
        return f"sm100 does not serve beta_activation {act!r}"
    return dsl_missing()


def residual_format(call) -> str:
    """Aqk and Akk in FLA 0.6.0's chunk-64 format (cula_core.backend.FLA_CHUNK64_RESIDUALS), whenever gradients
    are wanted: core keeps them if the backward's backend reads that format (cula_sm100.backward does)."""
    from cula_core.backend import FLA_CHUNK64_RESIDUALS

    return FLA_CHUNK64_RESIDUALS if call.op in OPS and call.requires_grad else ""


def kernel(op: str):
    if op not in OPS:
        raise NotImplementedError(f"sm100 has no kernel for {op}")
    from cula_sm100.forward import launch

    return launch.chunk_kda
