"""What the decode kernels serve and how they are tiled: pure Python (no CuTe DSL), so the backend can answer
`unsupported_reason` without importing a compiler."""

from __future__ import annotations

import torch

MODE_FINAL, MODE_STATES, MODE_KVBUFFER = "final", "states", "kvbuffer"

#: head dims served, K == V: those the GPU tests check against the reference (K = V = 64:
#: test_kernels_at_head_dim_64, every mode and the flush). The tiling needs K % 32 == 0 and V % BV == 0.
HEAD_DIMS = (64, 128)
#: tokens per request: the T per-token vectors of a head live in shared memory (4 T K floats) and the
#: token loop is unrolled
MAX_T = 16
#: layers of one all-layers flush: two 8-byte offsets per layer travel as kernel parameters (4 KiB in all)
MAX_LAYERS = 128
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: state pool dtypes: the kernels hold the state in fp32 registers and load / store the pool's dtype
POOL_DTYPES = (torch.float32, torch.bfloat16)
#: (pool dtype, V-first, null slot) of the pools the dispatch sends to the kernels. The kernels also index bf16
#: pools, V-first pools [P, HV, V, K] and a null slot (every such configuration compiles for sm_90a:
#: tests/sm90/test_decode_compile.py), but their GPU checks against the reference (test_decode_gpu.py::
#: test_serving_pools and the memcheck case's "pools" part, which widen this set for their own calls) have not run
#: yet; until they pass, those calls are declined and the reference serves them (correct, slower).
GPU_CHECKED_POOLS = frozenset({(torch.float32, False, False)})
#: every pool variant the kernels index
ALL_POOLS = frozenset((d, v_first, null) for d in POOL_DTYPES for v_first in (False, True) for null in (False, True))


#: tilings of the recurrent kernel that the benchmark compares (the GPU tests check every one against the reference):
#: (BV columns per CTA, lanes along V, warps, warp-local prologue: 1 = each warp prepares the per-token vectors
#: itself, no CTA barrier)
TILINGS = ((32, 4, 4, 0), (64, 4, 4, 0), (16, 4, 4, 0), (32, 4, 2, 0), (16, 4, 2, 0), (32, 2, 4, 0), (64, 2, 4, 0),
           (32, 4, 4, 1), (32, 2, 4, 1), (64, 2, 4, 1), (32, 2, 2, 1))
#: a benchmarking hook (tools/bench/mtp_decode.py): when set, every recurrent launch uses this tiling
TILING_OVERRIDE: tuple[int, int, int, int] | None = None


def recurrent_tiling(N: int, T: int, HV: int) -> tuple[int, int, int, int]:
    """(BV, lanes along V, warps, warp-local) of the recurrent kernel for a batch, by T and heads = N * HV (the
    table was chosen by measurement: docs/benchmarks/mtp_decode.md)."""
    if TILING_OVERRIDE is not None:
        return TILING_OVERRIDE
    heads = N * HV
    if T == 1:
        return (64, 4, 4, 0)
    if heads <= 64:
        return (32, 4, 4, 0)
    if heads < 1024:
        return (64, 4, 4, 0)
    return (32, 2, 2, 1)


#: the ways to run the verify step (kda_decode_mtp_kvbuffer): the recurrent kernel in KVBuffer mode, the
#: chunk form with SIMT products (token-parallel) or with 3xTF32 tensor-core products (kvbuffer_verify.py)
VERIFY_RECURRENT, VERIFY_CHUNK_SIMT, VERIFY_CHUNK_TC = "recurrent", "chunk_simt", "chunk_tc"
VERIFY_VARIANTS = (VERIFY_RECURRENT, VERIFY_CHUNK_SIMT, VERIFY_CHUNK_TC)
#: the chunk form uses SIMT products up to this many tokens (one m-tile of 8 padded rows), tensor cores beyond
CHUNK_SIMT_MAX_T = 8
#: a benchmarking / testing hook: when set, every verify call uses this variant
VERIFY_OVERRIDE: str | None = None


def verify_variant(N: int, T: int, HV: int) -> str:
    """Which verify kernel serves a batch, by T and heads = N * HV (chosen by measurement:
    docs/benchmarks/mtp_decode.md)."""
    if VERIFY_OVERRIDE is not None:
        return VERIFY_OVERRIDE
    if N * HV <= 32:
        return VERIFY_RECURRENT
    return VERIFY_CHUNK_TC if T > CHUNK_SIMT_MAX_T else VERIFY_CHUNK_SIMT


def recurrent_tilings_for(T: int) -> tuple[tuple[int, int, int, int], ...]:
    """Every tiling recurrent_tiling can return for T, whatever N and HV (launch.py prepares them all on a
    family's first call, so that a later batch size never compiles or loads a kernel, e.g. inside a CUDA-graph
    capture)."""
    if TILING_OVERRIDE is not None:
        return (TILING_OVERRIDE,)
    return ((64, 4, 4, 0),) if T == 1 else ((32, 4, 4, 0), (64, 4, 4, 0), (32, 2, 2, 1))


def verify_variants_for(T: int) -> tuple[str, ...]:
    """Every variant verify_variant can return for T, whatever N and HV."""
    if VERIFY_OVERRIDE is not None:
        return (VERIFY_OVERRIDE,)
    return (VERIFY_RECURRENT, VERIFY_CHUNK_TC if T > CHUNK_SIMT_MAX_T else VERIFY_CHUNK_SIMT)


def dispatched_tilings() -> tuple[tuple[int, int, int, int], ...]:
    """Every tiling recurrent_tiling can return (tests/sm90/decode_memcheck_case.py runs each under memcheck)."""
    return tuple(dict.fromkeys(t for T in (1, 2) for t in recurrent_tilings_for(T)))


def unsupported_reason(call) -> str | None:
    """None if the decode kernels serve `call` (a cula_core CallConfig), else a short reason."""
    if call.K != call.V or call.K not in HEAD_DIMS:
        served = " or ".join(map(str, HEAD_DIMS))
        return f"sm90 decode serves K = V = {served}, got K={call.K}, V={call.V}"
    state_dtype = call.options.get("state_dtype", torch.float32)
    if state_dtype not in POOL_DTYPES:
        return f"sm90 decode serves fp32 and bf16 state pools, got {str(state_dtype).replace('torch.', '')}"
    variant = (state_dtype, bool(call.options.get("state_v_first")), bool(call.options.get("null_slot")))
    if variant not in GPU_CHECKED_POOLS:
        return ("sm90 decode kernels for bf16, V-first and null-slot pools are not yet checked on a GPU "
                "(tests/sm90/test_decode_gpu.py::test_serving_pools)")
    if call.op in ("kda_flush_kvbuffer", "kda_flush_kvbuffer_all_layers"):
        if call.dtype != torch.float32:
            return f"sm90 flush serves fp32 KVBuffers, got {call.dtype}"
        layers = call.options.get("layers", 1) or 1
        if layers > MAX_LAYERS:
            return f"sm90 all-layers flush serves up to {MAX_LAYERS} layers in one launch, got {layers}"
    elif call.dtype not in INPUT_DTYPES:
        return f"sm90 decode serves bf16/fp16/fp32 q/k/v, got {call.dtype}"
    elif (call.options.get("lower_bound") or 0.0) > 0.0:
        # a positive bound makes the safe gate a growth: the chunk-form verify's exp(G_t) factors assume decays <= 1
        return f"sm90 decode serves the safe gate with lower_bound <= 0, got {call.options['lower_bound']}"
    if call.T > MAX_T:
        return f"sm90 decode serves T <= {MAX_T} tokens per request, got T={call.T}"
    return None
