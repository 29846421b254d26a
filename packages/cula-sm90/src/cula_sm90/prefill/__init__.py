"""cula_sm90.prefill: Hopper KDA prefill (`kda_prefill`, and `chunk_kda`), with intra-card context
parallel. `chunk_kda` with gradients (training) is served for the safe gate that the tensor-core stage 1 takes:
the forward hands Aqk / Akk in FLA 0.6.0's chunk-64 format to the backward (cula-sm100's on Hopper:
residual_format); the other gates train on cula-sm100's forward.

Kernels: chunk_intra_tc.py (stage 1, chunk-parallel, tensor cores: the safe gate with lower_bound >= -5; with
store_akk it also writes Akk for training) and chunk_intra.py (stage 1 for every other gate), chunk_state_wg.py
(stage 2, the serial recurrence on tensor cores; also the CP affine-map pass), with common.py
(chunk search, beta activation) and cula_core.cute_kernels (mma.sync, row copies); host side: forward.py. See
docs/sm90_prefill.md.

Nothing here imports CuTe DSL: the kernels compile on first use (forward.py caches them per configuration).
"""

from __future__ import annotations

import torch

OPS: tuple[str, ...] = ("kda_prefill", "chunk_kda")
INT32_INDEXING = True  # element offsets are int32: core rejects tensors of 2**31 elements or more

_DTYPES = (torch.bfloat16,)  # fp16 would compile, but no GPU test has run it


def unsupported_reason(call) -> str | None:
    if call.op not in OPS:
        return f"sm90 does not implement {call.op}"
    if call.dtype not in _DTYPES:
        return f"sm90 prefill serves bf16 q/k/v, got {str(call.dtype).replace('torch.', '')}"
    if call.K != 128 or call.V != 128:
        return f"sm90 prefill serves K=V=128 only, got K={call.K}, V={call.V}"
    if call.HQK <= 0 or call.HV % call.HQK:
        return f"sm90 prefill needs HV a multiple of HQK, got HQK={call.HQK}, HV={call.HV}"
    if call.T * call.HV * call.K >= 2**31:  # per batch row; the whole tensor is core's int32_indexing check
        return f"sm90 prefill indexes tokens in int32: T * HV * K must stay under 2^31, got T={call.T}, HV={call.HV}"
    if call.op == "chunk_kda" and call.requires_grad:
        return _training_reason(call)
    return None


def _training_reason(call) -> str | None:
    """Why the training forward (residuals for the backward: stage 1 must write Akk) is not served, or None."""
    from cula_sm90.prefill import forward

    lower_bound = call.options.get("lower_bound")
    if forward.intra_kind(call.gate, lower_bound) != "tc":
        got = f"gate={call.gate}" + (f", lower_bound={lower_bound}" if call.gate == "safe" else "")
        return (f"sm90 trains the safe gate with lower_bound in [{forward.TC_LOWER_BOUND_MIN}, 0] only (cula-sm100 "
                f"trains the others), got {got}")
    tokens = call.options.get("tokens")
    if tokens is not None and tokens * call.HV * call.K >= 2**31:
        return (f"sm90 prefill indexes in int32: tokens * HV * K must stay under 2^31 for training (cula-sm100 "
                f"indexes in 64 bits), got {tokens} tokens, HV={call.HV}")
    return None


def residual_format(call) -> str:
    """The training forward's residuals: Aqk and Akk in FLA 0.6.0's chunk-64 format (forward.prefill with
    save_residuals), for every chunk_kda call with gradients it serves."""
    from cula_core.backend import FLA_CHUNK64_RESIDUALS

    return FLA_CHUNK64_RESIDUALS if call.op == "chunk_kda" and call.requires_grad else ""


def serves_state_v_first(call) -> bool:
    # stage 2 indexes [N, HV, V, K] initial and final states itself (a compile-time layout; K = V): no copies
    return call.op in OPS


def kernel(op: str):
    if op not in OPS:
        raise NotImplementedError(f"sm90 has no kernel for {op}")
    from cula_sm90.prefill import forward

    if op == "kda_prefill":
        return forward.prefill

    def chunk_kda(*args, **kwargs):
        return forward.prefill(*args, **kwargs, intracard_cp="off")

    return chunk_kda


def planned_kernel(op: str, args: tuple, **flags):
    # no cu_seqlens and no CP split: the launch is resolved once for the plan (forward.planned); chunk_kda has
    # no intra-card CP
    if op not in OPS:
        raise NotImplementedError(f"sm90 has no kernel for {op}")
    from cula_sm90.prefill import forward

    return forward.planned(args, **flags) if op == "kda_prefill" else forward.planned(args, **flags,
                                                                                      intracard_cp="off")
