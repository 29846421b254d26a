"""cula_sm90.decode: multi-token-prediction decode for speculative decoding (CuTe DSL kernels).

Ops: kda_decode, kda_decode_mtp (recurrent kernel: final state into the pool, or T per-token states),
kda_decode_mtp_kvbuffer (the verify: the chunk-form kernel of kvbuffer_verify.py, SIMT or 3xTF32 tensor-core
products, or the recurrent kernel in KVBuffer mode for the smallest batches; outputs and the KVBuffer),
kda_flush_kvbuffer and kda_flush_kvbuffer_all_layers (rank-m rebuild in place), and FLA's fused_recurrent_kda
where it maps onto the recurrent kernel (configs.fused_recurrent_reason). Design: docs/sm90_decode.md.

Nothing here imports CuTe DSL: `kernel(op)` returns functions that compile their kernels on first use.
"""

from __future__ import annotations

from cula_sm90.decode import configs

OPS: tuple[str, ...] = ("kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer", "kda_flush_kvbuffer",
                        "kda_flush_kvbuffer_all_layers", "fused_recurrent_kda")
INT32_INDEXING = False  # 64-bit offsets: state pools may hold 2**31 elements or more


def unsupported_reason(call) -> str | None:
    if call.op not in OPS:
        return f"sm90 does not implement {call.op}"
    return configs.unsupported_reason(call)


def serves_state_v_first(call) -> bool:
    # fused_recurrent_kda's V-first states and pools reach the kernel as they are (its layout is compile-time);
    # the decode ops take the layout as their own keyword
    return call.op == "fused_recurrent_kda"


def kernel(op: str):
    if op not in OPS:
        raise NotImplementedError(f"sm90 has no kernel for {op}")
    from cula_sm90.decode.ops import KERNELS

    return KERNELS[op]


def planned_kernel(op: str, args: tuple, **flags):
    # the recurrent kernel's launch resolved once per plan (ops.planned); the other ops bind their flags
    if op not in OPS:
        raise NotImplementedError(f"sm90 has no kernel for {op}")
    from cula_sm90.decode.ops import planned

    return planned(op, args, **flags)
