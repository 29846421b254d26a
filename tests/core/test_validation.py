"""Every bad input named by the core issue raises the promised error, naming the argument, what was
expected and what came, before any backend runs; state pools stay bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

import cula_core

B, T, HQK, HV, K, V = 1, 16, 2, 4, 8, 8


def good():
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, HQK, K, generator=gen), k=torch.randn(B, T, HQK, K, generator=gen),
        v=torch.randn(B, T, HV, V, generator=gen), g=-torch.rand(B, T, HV, K, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
    )


def call(**changes):
    args = good()
    args.update(changes)
    return cula_core.chunk_kda(**args)


CHUNK_CASES = [
    (dict(k=torch.randn(B, T, HQK, 4)), ValueError, r"k must have shape \[B, T, HQK, K\] \(the shape of q\) = \[1, 16, 2, 8\], got \[1, 16, 2, 4\]"),
    (dict(q=torch.randn(T, HQK, K)), ValueError, r"q must be 4-D, got 3-D"),
    (dict(v=torch.randn(B, T + 1, HV, V)), ValueError, r"v must have shape \[B, T, HV, V\] with B = 1, T = 16"),
    (dict(v=torch.randn(B, T, 3, V), g=-torch.rand(B, T, 3, K), beta=torch.rand(B, T, 3)), ValueError,
     r"HV % HQK must be 0 .* got HV = 3, HQK = 2"),
    (dict(q=torch.randn(B, T, HQK, 0), k=torch.randn(B, T, HQK, 0), g=torch.randn(B, T, HV, 0)), ValueError,
     r"head dims must be positive, got K = 0"),
    (dict(g=-torch.rand(B, T, HV, K - 1)), ValueError, r"g must have shape \[B, T, HV, K\] = \[1, 16, 4, 8\], got \[1, 16, 4, 7\]"),
    (dict(beta=torch.rand(B, T, HV, 1)), ValueError, r"beta must be 3-D, got 4-D"),
    (dict(q=torch.randint(0, 3, (B, T, HQK, K))), TypeError, r"q must have dtype in \(float16, bfloat16, float32, float64\), got int64"),
    (dict(v=torch.randn(B, T, HV, V, dtype=torch.float64)), TypeError, r"q, k and v must share one dtype"),
    (dict(g=-torch.rand(B, T, HV, K, device="meta")), ValueError, r"all tensors must be on one device: q is on cpu, g is on meta"),
    (dict(initial_state=torch.zeros(2, HV, K, V)), ValueError, r"initial_state must have shape \[N, HV, K, V\] = \[1, 4, 8, 8\], got \[2, 4, 8, 8\]"),
    (dict(initial_state=torch.zeros(1, HV, K, V, dtype=torch.bfloat16)), TypeError, r"initial_state must have dtype in \(float32, float64\), got bfloat16"),
    (dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(HV)), ValueError, r"safe_gate=True with use_gate_in_kernel=True requires lower_bound"),
    (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0), ValueError, r"lower_bound must be in the safe range \[-5, 0\) with safe_gate=True, got -6.0"),
    (dict(use_gate_in_kernel=True), ValueError, r"use_gate_in_kernel=True requires A_log of shape \[HV\] = \[4\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV + 1)), ValueError, r"A_log must have shape \[HV\] = \[4\], got \[5\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV)), ValueError, r"dt_bias must have shape \[HV\*K\] = \[32\], got \[4\]"),
    (dict(cu_seqlens=torch.tensor([0, 8, 16.0])), TypeError, r"cu_seqlens must have dtype in \(int32, int64\), got float32"),
    (dict(cu_seqlens=torch.tensor([[0, 16]], dtype=torch.int32)), ValueError, r"cu_seqlens must be 1-D, got 2-D"),
    (dict(cu_seqlens=torch.tensor([1, 16], dtype=torch.int32)), ValueError, r"cu_seqlens must start at 0, got 1"),
    (dict(cu_seqlens=torch.tensor([0, 9, 8, 16], dtype=torch.int32)), ValueError, r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 9 > cu_seqlens\[2\] = 8"),
    (dict(cu_seqlens=torch.tensor([0, 8, 15], dtype=torch.int32)), ValueError, r"cu_seqlens must end at T = 16 .*, got 15"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 16], dtype=torch.int32)), ValueError, r"cu_seqlens_cpu was given without cu_seqlens"),
    (dict(scale="0.1"), TypeError, r"scale must be a float or None, got str"),
    (dict(head_first=True), TypeError, r"chunk_kda\(\) got an unexpected keyword argument 'head_first'"),
    (dict(allow_neg_eigval=True), ValueError, r"allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"),
]


@pytest.mark.parametrize("changes,exc,message", CHUNK_CASES, ids=[m[:40] for _, _, m in CHUNK_CASES])
def test_chunk_kda_rejects(changes, exc, message):
    with pytest.raises(exc, match=message):
        call(**changes)


def test_cu_seqlens_requires_batch_one():
    args = good()
    args = {n: torch.cat([t, t]) for n, t in args.items()}
    with pytest.raises(ValueError, match=r"cu_seqlens requires batch size B == 1 .*got B = 2"):
        cula_core.kda_prefill(**args, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32))


def test_device_cu_seqlens_values_are_checked_through_cu_seqlens_cpu():
    # The host copy is what validation reads when given (no device read): its values are checked.
    with pytest.raises(ValueError, match=r"cu_seqlens must end at T = 16"):
        call(cu_seqlens=torch.tensor([0, 12], dtype=torch.int32),
             cu_seqlens_cpu=torch.tensor([0, 12], dtype=torch.int32))


# ------------------------------------------------------------------------------------------------- decode

N, P, TD = 3, 5, 2


def decode_args():
    gen = torch.Generator().manual_seed(1)
    return dict(
        q=torch.randn(N, TD, HQK, K, generator=gen), k=torch.randn(N, TD, HQK, K, generator=gen),
        v=torch.randn(N, TD, HV, V, generator=gen), g=torch.randn(N, TD, HV, K, generator=gen),
        beta=torch.rand(N, TD, HV, generator=gen), state_pool=torch.randn(P, HV, K, V, generator=gen),
        cache_idx=torch.tensor([0, -1, 3], dtype=torch.int32), A_log=torch.zeros(HV),
    )


DECODE_CASES = [
    (dict(cache_idx=torch.tensor([0, -1, 5], dtype=torch.int32)), ValueError, r"cache_idx\[2\] = 5 is out of range for a state pool of P = 5 slots"),
    (dict(cache_idx=torch.tensor([0, 3, 3], dtype=torch.int32)), ValueError, r"cache_idx holds slot 3 more than once"),
    (dict(cache_idx=torch.tensor([0, -1, 3])), TypeError, r"cache_idx must have dtype in \(int32\), got int64"),
    (dict(cache_idx=torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"cache_idx must have shape \[N\] = \[3\], got \[2\]"),
    (dict(state_pool=torch.randn(P, HV, K, V + 1)), ValueError, r"state_pool must have shape \[P, HV, K, V\] = \[P, 4, 8, 8\], got \[5, 4, 8, 9\]"),
    (dict(state_pool=torch.randn(P, HV, V, K).transpose(-1, -2)), ValueError, r"state_pool must be contiguous"),
    (dict(state_pool=torch.randn(P, HV, K, V).half()), TypeError, r"state_pool must have dtype in \(float32, bfloat16, float64\), got float16"),
    (dict(state_pool=torch.randn(P, HV, V, K + 1), state_v_first=True), ValueError, r"state_pool must have shape \[P, HV, V, K\] \(state_v_first=True\) = \[P, 4, 8, 8\], got \[5, 4, 8, 9\]"),
    (dict(null_slot=P), ValueError, r"null_slot must be a slot of the state pool, 0 <= null_slot < P = 5, got 5"),
    (dict(null_slot=True), TypeError, r"null_slot must be an int or None, got bool"),
    (dict(A_log=None), ValueError, r"^the decode ops' in-kernel gate requires A_log of shape \[HV\] = \[4\] \(or lower_bound for the safe gate\), got None$"),
    (dict(beta=torch.rand(N, TD, HV + 1)), ValueError, r"beta must have shape \[N, T, HV\] = \[3, 2, 4\]"),
    (dict(lower_bound=float("nan")), ValueError, r"^lower_bound must be a finite float or None, got nan$"),
    (dict(lower_bound="-5"), TypeError, r"^lower_bound must be a float or None, got str$"),
]


@pytest.mark.parametrize("changes,exc,message", DECODE_CASES, ids=[m[:40] for _, _, m in DECODE_CASES])
def test_decode_rejects_and_leaves_the_pool_untouched(changes, exc, message):
    args = decode_args()
    args.update(changes)
    pool = args["state_pool"]
    before = pool.clone()
    with pytest.raises(exc, match=message):
        cula_core.kda_decode_mtp(**args)
    assert torch.equal(pool, before)


def test_decode_takes_one_token():
    args = decode_args()
    with pytest.raises(ValueError, match=r"kda_decode takes one token per request: q must have shape \[N, 1, HQK, K\]"):
        cula_core.kda_decode(**args)


@pytest.mark.parametrize("accept_len,exc,message", [
    (3, ValueError, r"accept_len must be in \[0, T\] = \[0, 2\], got 3"),
    (-1, ValueError, r"accept_len must be in \[0, T\] = \[0, 2\], got -1"),
    (torch.tensor([0, 1, 3], dtype=torch.int32), ValueError, r"accept_len\[2\] = 3 is outside \[0, T\] = \[0, 2\]"),
    (torch.tensor([0, 1, 1]), TypeError, r"accept_len must be an int or an \[N\] int32 tensor, got a tensor of dtype int64"),
    (1.0, TypeError, r"accept_len must be an int or an \[N\] int32 tensor, got float"),
    (True, TypeError, r"accept_len must be an int or an \[N\] int32 tensor, got bool"),
])
def test_flush_rejects_bad_accept_lengths_and_leaves_the_pool_untouched(accept_len, exc, message):
    args = decode_args()
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    pool = args["state_pool"]
    before = pool.clone()
    with pytest.raises(exc, match=message):
        cula_core.kda_flush_kvbuffer(pool, args["cache_idx"], buf, accept_len)
    with pytest.raises(exc, match=message):
        cula_core.kda_flush_kvbuffer_all_layers([pool], args["cache_idx"], [buf], accept_len)
    assert torch.equal(pool, before)


def test_flush_rejects_a_buffer_of_another_shape():
    args = decode_args()
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    pool = args["state_pool"]
    before = pool.clone()
    with pytest.raises(ValueError, match=r"kvbuffer must have shape \[N, T, HV, 2K\+V\] \(N = len\(cache_idx\)\) = \[3, 2, 4, 24\], got \[3, 2, 4, 23\]"):
        cula_core.kda_flush_kvbuffer(pool, args["cache_idx"], buf[..., :-1].contiguous(), 1)
    with pytest.raises(ValueError, match=r"state_pools and kvbuffers must hold one tensor per layer"):
        cula_core.kda_flush_kvbuffer_all_layers([pool, pool], args["cache_idx"], [buf], 1)
    assert torch.equal(pool, before)
