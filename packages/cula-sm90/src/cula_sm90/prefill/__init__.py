"""cula_sm90.prefill: Hopper KDA prefill (`kda_prefill`, and `chunk_kda` when no gradient is needed), with
intra-card context parallel. Kernels: chunk_intra_tc.py (stage 1, chunk-parallel, tensor cores: the safe gate with
lower_bound >= -5) and chunk_intra.py (stage 1 for every other gate), chunk_state_wg.py (stage 2, the serial
recurrence on tensor cores; also the CP affine-map pass), with common.py
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
    if call.op == "chunk_kda" and call.requires_grad:
        return "sm90 serves chunk_kda without autograd only (an input requires grad; cula-sm100 trains)"
    if call.dtype not in _DTYPES:
        return f"sm90 prefill serves bf16 q/k/v, got {str(call.dtype).replace('torch.', '')}"
    if call.K != 128 or call.V != 128:
        return f"sm90 prefill serves K=V=128 only, got K={call.K}, V={call.V}"
    if call.HQK <= 0 or call.HV % call.HQK:
        return f"sm90 prefill needs HV a multiple of HQK, got HQK={call.HQK}, HV={call.HV}"
    if call.T * call.HV * call.K >= 2**31:  # per batch row; the whole tensor is core's int32_indexing check
        return f"sm90 prefill indexes tokens in int32: T * HV * K must stay under 2^31, got T={call.T}, HV={call.HV}"
    return None


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
