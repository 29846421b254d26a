"""What the decode kernels serve and how they are tiled: pure Python (no CuTe DSL), so the backend can answer
`unsupported_reason` without importing a compiler."""

from __future__ import annotations

import torch

MODE_FINAL, MODE_STATES, MODE_KVBUFFER = "final", "states", "kvbuffer"
#: speculative decoding over a pool with a slot per token (FLA's ssm_state_indices [N, T_idx] and
#: num_accepted_tokens): the state read from one column of the request's slot row, the state after token t
#: written into column t (recurrent.py)
MODE_SLOTS = "slots"

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


#: tilings of the recurrent kernel that the benchmark compares (the GPU tests check every one against the reference,
#: forcing it through the `tiling` argument of launch.run_recurrent and the decode ops):
#: (BV columns per CTA, lanes along V, warps, warp-local prologue: 1 = each warp prepares the per-token vectors
#: itself, no CTA barrier)
TILINGS = ((32, 4, 4, 0), (64, 4, 4, 0), (16, 4, 4, 0), (32, 4, 2, 0), (16, 4, 2, 0), (32, 2, 4, 0), (64, 2, 4, 0),
           (32, 4, 4, 1), (32, 2, 4, 1), (64, 2, 4, 1), (32, 2, 2, 1))


#: the streamed T = 1 decode's tiling (stream.py) by (bytes of a pool element, V-first pool): (BV columns per item,
#: lanes along V, warps). [K, V] bf16 pools take 128 columns, 8 per lane, so that each lane's row segment is one
#: 16-byte store: against 64 columns (docs/benchmarks/mtp_decode.md, "Streamed decode: 128 value columns") it wins
#: on [K, V] bf16 pools and loses on V-first bf16 pools of few requests, which keep 64. stream_tiling narrows BV to V.
STREAM_TILINGS = {(4, False): (64, 4, 4), (4, True): (64, 4, 4), (2, False): (128, 4, 4), (2, True): (64, 4, 4)}
#: its slice stages per CTA, by (bytes of a pool element, V-first): V-first bf16 pools (64 columns, 17 KiB a
#: stage) take 3 and still fit 4 CTAs per SM, 2-5% faster than 2 on the H200; the others keep 2, where a third
#: stage costs a CTA per SM (docs/benchmarks/mtp_decode.md, "Bulk copies")
STREAM_STAGES = {(4, False): 2, (4, True): 2, (2, False): 2, (2, True): 3}
#: shared memory of a Hopper SM and what the hardware reserves per CTA (bytes); the stream kernel's copy unit
SM_SMEM, CTA_RESERVED_SMEM, CHUNK_BYTES = 228 * 1024, 1024, 16


#: single-token decode streams (stream.py) from this many request-heads N * HV on, by (bytes of a pool element,
#: V-first pool); below, the recurrent kernel (one CTA per head and column block) finishes sooner. bf16 pools from
#: 2048, [K, V] fp32 pools from 8192 (from there the two kernels are on par), [V, K] fp32 pools at any size (the
#: recurrent kernel reads them by columns). Chosen by measurement: docs/benchmarks/mtp_decode.md, "Where the
#: single-token decode streams".
STREAM_MIN_HEADS = {(4, False): 8192, (4, True): 0, (2, False): 2048, (2, True): 2048}


def stream_serves(mode: str, T: int) -> bool:
    """Whether the streamed decode serves a family: single-token decode into the pool (MODE_FINAL, T = 1)."""
    return mode == MODE_FINAL and T == 1


def stream_min_heads(pool_bytes: int, v_first: bool) -> int:
    """Request-heads N * HV from which single-token decode streams, for a pool element size and layout."""
    return STREAM_MIN_HEADS[pool_bytes, bool(v_first)]


def streams(mode: str, T: int, N: int, HV: int, v_first: bool, pool_bytes: int) -> bool:
    """Whether the dispatch runs a batch on the streamed decode (a named tiling runs the recurrent kernel)."""
    return stream_serves(mode, T) and N * HV >= stream_min_heads(pool_bytes, v_first)


def stream_tiling(V: int, pool_bytes: int, v_first: bool) -> tuple[int, int, int]:
    """(BV, lanes along V, warps) of the streamed decode for heads of V columns, a pool element size and layout."""
    bv, vl, nw = STREAM_TILINGS[pool_bytes, bool(v_first)]
    return min(bv, V), vl, nw


def stream_stages(pool_bytes: int, v_first: bool) -> int:
    """Slice stages of a stream CTA (the current item's and stages - 1 ahead) for a pool element size and layout."""
    return STREAM_STAGES[pool_bytes, bool(v_first)]


def stream_smem_bytes(K: int, pool_bytes: int, v_first: bool, stages: int, block_v: int) -> int:
    """Shared memory of one stream CTA: `stages` stages of a K x block_v state slice in the pool's dtype, rows padded
    by one 16-byte chunk ([K][BV] for [K, V] pools, [BV][K] for [V, K]), three fp32 K-vectors and an 8-byte
    mbarrier per stage."""
    rows, cols = (block_v, K) if v_first else (K, block_v)
    return stages * rows * (cols + CHUNK_BYTES // pool_bytes) * pool_bytes + 3 * K * 4 + 8 * stages


def stream_ctas_per_sm(K: int, pool_bytes: int, v_first: bool, stages: int, block_v: int) -> int:
    """Stream CTAs resident on one SM: as many as its shared memory holds (at most 8). The kernel's launch bound
    (min_blocks_per_mp) is the same number, so ptxas keeps the registers within it; the host launches this many
    CTAs per SM (persistent: each walks work items)."""
    return min(8, SM_SMEM // (stream_smem_bytes(K, pool_bytes, v_first, stages, block_v) + CTA_RESERVED_SMEM))


def recurrent_tiling(N: int, T: int, HV: int, mode: str = MODE_FINAL) -> tuple[int, int, int, int]:
    """(BV, lanes along V, warps, warp-local) of the recurrent kernel for a batch, by T, heads = N * HV and the
    mode (the table was chosen by measurement: docs/benchmarks/mtp_decode.md; MODE_SLOTS, which stores a state per
    token into the pool, by the H200 sweep in docs/benchmarks/fused_recurrent.md)."""
    heads = N * HV
    if T == 1:
        return (64, 4, 4, 0)
    if heads <= 64:
        return (32, 4, 4, 0)
    if heads < 1024 or mode == MODE_SLOTS:
        return (64, 4, 4, 0)
    return (32, 2, 2, 1)


#: the recurrent and verify kernels' runtime beta code for the calling convention's beta_activation: the update uses
#: beta_sigmoid * sigmoid(beta), or beta as given for 0 (FLA's use_beta_sigmoid_in_kernel, with allow_neg_eigval)
BETA_SIGMOID = {"none": 0, "sigmoid": 1, "2sigmoid": 2}


#: the ways to run the verify step (kda_decode_mtp_kvbuffer): the recurrent kernel in KVBuffer mode, the
#: chunk form with SIMT products (token-parallel) or with 3xTF32 tensor-core products (kvbuffer_verify.py)
VERIFY_RECURRENT, VERIFY_CHUNK_SIMT, VERIFY_CHUNK_TC = "recurrent", "chunk_simt", "chunk_tc"
VERIFY_VARIANTS = (VERIFY_RECURRENT, VERIFY_CHUNK_SIMT, VERIFY_CHUNK_TC)
#: the chunk form uses SIMT products up to this many tokens (one m-tile of 8 padded rows), tensor cores beyond
CHUNK_SIMT_MAX_T = 8


def verify_variant(N: int, T: int, HV: int) -> str:
    """Which verify kernel serves a batch, by T and heads = N * HV (chosen by measurement:
    docs/benchmarks/mtp_decode.md)."""
    if N * HV <= 32:
        return VERIFY_RECURRENT
    return VERIFY_CHUNK_TC if T > CHUNK_SIMT_MAX_T else VERIFY_CHUNK_SIMT


def recurrent_tilings_for(T: int) -> tuple[tuple[int, int, int, int], ...]:
    """Every tiling recurrent_tiling can return for T, whatever N and HV (launch.py prepares them all on a
    family's first call, so that a later batch size never compiles or loads a kernel, e.g. inside a CUDA-graph
    capture)."""
    return ((64, 4, 4, 0),) if T == 1 else ((32, 4, 4, 0), (64, 4, 4, 0), (32, 2, 2, 1))


def verify_variants_for(T: int) -> tuple[str, ...]:
    """Every variant verify_variant can return for T, whatever N and HV."""
    return (VERIFY_RECURRENT, VERIFY_CHUNK_TC if T > CHUNK_SIMT_MAX_T else VERIFY_CHUNK_SIMT)


def dispatched_tilings() -> tuple[tuple[int, int, int, int], ...]:
    """Every tiling recurrent_tiling can return (tests/sm90/decode_memcheck_case.py runs each under memcheck)."""
    return tuple(dict.fromkeys(t for T in (1, 2) for t in recurrent_tilings_for(T)))


def _head_dim_reason(call) -> str | None:
    if call.K != call.V or call.K not in HEAD_DIMS:
        served = " or ".join(map(str, HEAD_DIMS))
        return f"sm90 decode serves K = V = {served}, got K={call.K}, V={call.V}"
    return None


def _pool_reason(state_dtype: torch.dtype, v_first: bool, null_slot: bool) -> str | None:
    if state_dtype not in POOL_DTYPES:
        return f"sm90 decode serves fp32 and bf16 state pools, got {str(state_dtype).replace('torch.', '')}"
    return None


def unsupported_reason(call) -> str | None:
    """None if the decode kernels serve `call` (a cula_core CallConfig), else a short reason."""
    if call.op == "fused_recurrent_kda":
        return fused_recurrent_reason(call)
    reason = _head_dim_reason(call) or _pool_reason(call.options.get("state_dtype", torch.float32),
                                                    bool(call.options.get("state_v_first")),
                                                    bool(call.options.get("null_slot")))
    if reason:
        return reason
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


# ---------------------------------------------------------------- fused_recurrent_kda (FLA's recurrent entry)
# How its calls map onto the recurrent kernel (N sequences of T tokens each, as N requests of T tokens; ops.py):
#   pool with one slot per sequence (ssm_state_indices [N], or [N, T_idx] at T = 1 without accepted counts: read
#     and written): MODE_FINAL on the pool in place, cache_idx = the slots;
#   pool with a slot per token (ssm_state_indices [N, T_idx] at T > 1, or with num_accepted_tokens at any T):
#     MODE_SLOTS on the pool in place: the state read from column a - 1 (column 0 without accepted counts), the
#     state after token t written to column t;
#   a new final state at T = 1: MODE_STATES reading initial_state (or one zero state) as a pool, never written;
#     its per-token states [N, 1, ...] are the final states (FLA's traffic: read a state, write one);
#   outputs only (output_final_state=False): MODE_KVBUFFER reading initial_state (or one zero state) as a pool:
#     no state is written, only the small KVBuffer the call drops.
# A new final state after T > 1 tokens would need a copy of the initial state that the in-place mode then updates:
# twice FLA's state traffic, so those calls are declined. Every gate (precomputed, softplus, safe) and every beta
# activation is served: the kernels take them as runtime arguments (launch.run_recurrent).


def fused_recurrent_pool_mode(per_token_slots: bool, accepted_counts: bool, T: int) -> str:
    """The recurrent kernel's mode for a pool call of fused_recurrent_kda: MODE_SLOTS when a slot per token is
    written (per_token_slots: ssm_state_indices [N, T_idx], at T > 1 tokens) or the read column comes from
    num_accepted_tokens (accepted_counts), else MODE_FINAL (one slot per sequence, read and written)."""
    return MODE_SLOTS if accepted_counts or (per_token_slots and T > 1) else MODE_FINAL


def fused_recurrent_reason(call) -> str | None:
    """None if the decode kernels serve the fused_recurrent_kda `call`, else why not. Its options: those
    cula_core.ops.fused_recurrent puts in the call (docs/backends.md); a missing `seq_len` or `state_contiguous`
    counts as unknown, so the call is declined."""
    opts = call.options
    activation = opts.get("beta_activation", "none")
    if activation not in BETA_SIGMOID:
        return f"sm90 decode serves beta_activation {' / '.join(BETA_SIGMOID)}, got {activation!r}"
    if opts.get("beta_per_channel"):
        return "sm90 decode takes one beta per token and value head, got beta [B, T, HV, V]"
    T = opts.get("seq_len", None if call.varlen else call.T)
    if T is None:
        return ("sm90 decode serves cu_seqlens only when every sequence has the same length and the host knows it "
                "(pass cu_seqlens_cpu), got unequal or unknown lengths")
    if not 1 <= T <= MAX_T:
        return f"sm90 decode serves 1 <= T <= {MAX_T} tokens per sequence, got T={T}"
    reason = _head_dim_reason(call)
    if reason:
        return reason
    if call.dtype not in INPUT_DTYPES:
        return f"sm90 decode serves bf16/fp16/fp32 q/k/v, got {call.dtype}"
    if opts.get("pool"):
        if opts.get("state_contiguous") is not True:
            return "sm90 decode indexes contiguous state pools (slot stride HV * K * V), got a pool with wider slots"
        state_dtype = opts.get("state_dtype")
    else:
        state_dtype = opts.get("state_dtype") if opts.get("initial_state") else torch.float32
        if opts.get("output_final_state"):
            if T > 1:
                return (f"sm90 decode writes a new final state only for T = 1 token per sequence, got T={T} (it "
                        "would copy the initial state first: twice FLA's state traffic)")
            if state_dtype != torch.float32:
                return ("sm90 decode writes the new final state in the initial state's dtype: it serves an fp32 "
                        f"initial_state, got {str(state_dtype).replace('torch.', '')}")
        elif call.gate == "safe" and (opts.get("lower_bound") or 0.0) > 0.0:
            # outputs only run on the verify kernels, whose chunk form assumes decays <= 1
            return (f"sm90 decode serves outputs-only calls (output_final_state=False) with lower_bound <= 0, got "
                    f"{opts['lower_bound']}")
    return _pool_reason(state_dtype, bool(opts.get("state_v_first")), False)
