"""Tests of cula_core.reference.decode: state-pool decode steps, MTP per-token states and accepted-token commits."""

import pytest
import torch

import cula_core
from cula_core.reference import (
    commit_accepted_reference,
    decode_mtp_reference,
    decode_step_reference,
    kda_gate,
    l2norm,
    recurrent_kda,
)

DT = torch.float64
TOL = 1e-12




def make_tokens(N, T, HQK, HV, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=gen, dtype=DT)

    g = kda_gate(r(N, T, HV, K), r(HV), r(HV * K))
    return l2norm(r(N, T, HQK, K)), l2norm(r(N, T, HQK, K)), r(N, T, HV, V), g, torch.sigmoid(r(N, T, HV))


# pool of 7 slots; requests 1 and 4 are padded slots (any negative value)
P, HQK, HV, K, V = 7, 1, 2, 6, 4
CACHE_IDX = torch.tensor([5, -1, 0, 3, -7, 6], dtype=torch.int32)
ACTIVE = [i for i, c in enumerate(CACHE_IDX.tolist()) if c >= 0]


def make_pool():
    return torch.randn(P, HV, K, V, dtype=DT)


def test_decode_steps_equal_recurrent():
    N, T = len(CACHE_IDX), 9
    q, k, v, g, beta = make_tokens(N, T, HQK, HV, K, V, seed=1)
    pool = make_pool()
    pool0 = pool.clone()
    outs = [decode_step_reference(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                                  pool, CACHE_IDX) for t in range(T)]
    o = torch.cat(outs, dim=1)
    assert o.shape == (N, T, HV, V)
    h0 = pool0[CACHE_IDX.clamp(min=0).long()]
    o_ref, ht_ref = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for i in range(N):
        if i in ACTIVE:
            torch.testing.assert_close(o[i], o_ref[i], rtol=0, atol=TOL)
            torch.testing.assert_close(pool[CACHE_IDX[i]], ht_ref[i], rtol=0, atol=TOL)
        else:
            assert torch.equal(o[i], torch.zeros_like(o[i]))
    untouched = sorted(set(range(P)) - {int(CACHE_IDX[i]) for i in ACTIVE})
    assert untouched == [1, 2, 4]
    assert torch.equal(pool[untouched], pool0[untouched])


def test_decode_step_rejects_multi_token_input():
    q, k, v, g, beta = make_tokens(2, 2, HQK, HV, K, V)
    with pytest.raises(ValueError, match="q"):
        decode_step_reference(q, k, v, g, beta, make_pool(), torch.tensor([0, 1]))


def test_mtp_per_token_states_equal_recurrent_prefix_states():
    N, T = len(CACHE_IDX), 5
    q, k, v, g, beta = make_tokens(N, T, HQK, HV, K, V, seed=2)
    pool = make_pool()
    pool0 = pool.clone()
    o, states = decode_mtp_reference(q, k, v, g, beta, pool, CACHE_IDX)
    assert torch.equal(pool, pool0)  # MTP only reads the pool
    assert o.shape == (N, T, HV, V) and states.shape == (N, T, HV, K, V) and states.dtype == pool.dtype
    h0 = pool0[CACHE_IDX.clamp(min=0).long()]
    o_ref = recurrent_kda(q, k, v, g, beta, initial_state=h0)[0]
    for i in range(N):
        if i not in ACTIVE:
            assert torch.equal(o[i], torch.zeros_like(o[i])) and torch.equal(states[i], torch.zeros_like(states[i]))
            continue
        torch.testing.assert_close(o[i], o_ref[i], rtol=0, atol=TOL)
        for t in range(T):
            _, s = recurrent_kda(q[i:i + 1, :t + 1], k[i:i + 1, :t + 1], v[i:i + 1, :t + 1], g[i:i + 1, :t + 1],
                                 beta[i:i + 1, :t + 1], initial_state=h0[i:i + 1], output_final_state=True)
            torch.testing.assert_close(states[i, t], s[0], rtol=0, atol=TOL)


def test_mtp_padded_slots_never_read_the_pool():
    q, k, v, g, beta = make_tokens(2, 3, HQK, HV, K, V)
    pool = make_pool()
    pool_nan = pool.clone()
    pool_nan[0] = float("nan")  # a padded slot must not pick this up through a clamped index
    o, states = decode_mtp_reference(q, k, v, g, beta, pool_nan, torch.tensor([-1, 2]))
    assert torch.isfinite(o).all() and torch.isfinite(states).all()
    o2, states2 = decode_mtp_reference(q, k, v, g, beta, pool, torch.tensor([-1, 2]))
    assert torch.equal(o, o2) and torch.equal(states, states2)


def test_commit_accepted_per_request_lengths():
    N, T = len(CACHE_IDX), 4
    q, k, v, g, beta = make_tokens(N, T, HQK, HV, K, V, seed=3)
    pool = make_pool()
    pool0 = pool.clone()
    _, states = decode_mtp_reference(q, k, v, g, beta, pool, CACHE_IDX)
    accept = torch.tensor([2, 3, 0, 4, 1, 1])  # request 2 accepts nothing, 1 and 4 are padded
    out = commit_accepted_reference(pool, CACHE_IDX, states, accept)
    assert out is pool
    h0 = pool0[CACHE_IDX.clamp(min=0).long()]
    for i in ACTIVE:
        slot, m = int(CACHE_IDX[i]), int(accept[i])
        if m == 0:
            assert torch.equal(pool[slot], pool0[slot])
            continue
        _, s = recurrent_kda(q[i:i + 1, :m], k[i:i + 1, :m], v[i:i + 1, :m], g[i:i + 1, :m], beta[i:i + 1, :m],
                             initial_state=h0[i:i + 1], output_final_state=True)
        torch.testing.assert_close(pool[slot], s[0], rtol=0, atol=TOL)
        assert torch.equal(pool[slot], states[i, m - 1])
    for slot in (1, 2, 4):  # slots no active request owns
        assert torch.equal(pool[slot], pool0[slot])


def test_commit_int_accept_len_and_then_continue_decoding():
    N, T = len(CACHE_IDX), 3
    q, k, v, g, beta = make_tokens(N, T + 2, HQK, HV, K, V, seed=4)
    pool = make_pool()
    pool0 = pool.clone()
    _, states = decode_mtp_reference(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], pool, CACHE_IDX)
    commit_accepted_reference(pool, CACHE_IDX, states, T)  # int broadcasts to every request
    o_next, _ = decode_mtp_reference(q[:, T:], k[:, T:], v[:, T:], g[:, T:], beta[:, T:], pool, CACHE_IDX)
    o_ref = recurrent_kda(q, k, v, g, beta, initial_state=pool0[CACHE_IDX.clamp(min=0).long()])[0]
    torch.testing.assert_close(o_next[ACTIVE], o_ref[ACTIVE, T:], rtol=0, atol=TOL)
    # accept_len 0 for everyone: the pool is bitwise untouched
    snapshot = pool.clone()
    commit_accepted_reference(pool, CACHE_IDX, states, 0)
    assert torch.equal(pool, snapshot)


def test_commit_rejects_out_of_range_accept_len():
    pool = make_pool()
    states = torch.randn(2, 3, HV, K, V, dtype=DT)
    snapshot = pool.clone()
    with pytest.raises(ValueError, match="accept_len"):
        commit_accepted_reference(pool, torch.tensor([0, 1]), states, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="accept_len"):
        commit_accepted_reference(pool, torch.tensor([0, 1]), states, -1)
    assert torch.equal(pool, snapshot)


def test_fp32_pool_gives_fp32_states():
    q, k, v, g, beta = (x.float() for x in make_tokens(2, 2, HQK, HV, K, V))
    pool = torch.randn(3, HV, K, V)
    o, states = decode_mtp_reference(q, k, v, g, beta, pool, torch.tensor([2, 0]))
    assert states.dtype == torch.float32 and o.dtype == torch.float32
    _, states64 = decode_mtp_reference(*(x.double() for x in (q, k, v, g, beta)), pool.double(),
                                         torch.tensor([2, 0]))
    torch.testing.assert_close(states.double(), states64, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- serving pools: bf16, V-first, null slot
# Through the public ops on the CPU (the reference serves them): raw gate in kernel, fp32 inputs.


PN, PT, PHQK, PHV, PK, PV, PP = 4, 3, 1, 2, 8, 4, 6
POOL_IDX = (5, -1, 0, 2)


def pool_call_args(T=PT, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=gen)

    return dict(q=r(PN, T, PHQK, PK), k=r(PN, T, PHQK, PK), v=r(PN, T, PHV, PV), g=r(PN, T, PHV, PK),
                beta=torch.rand(PN, T, PHV, generator=gen), cache_idx=torch.tensor(POOL_IDX, dtype=torch.int32),
                A_log=r(PHV) * 0.5, dt_bias=r(PHV * PK), use_qk_l2norm_in_kernel=True)


def make_serving_pool(seed=1):
    return torch.randn(PP, PHV, PK, PV, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("per_token", [False, True])
def test_v_first_pools_hold_the_transposed_states(per_token):
    args = pool_call_args()
    pool = make_serving_pool()
    pool_vf = pool.transpose(-1, -2).contiguous()
    o, st = cula_core.kda_decode_mtp(**args, state_pool=pool, output_per_token_states=per_token)
    o_vf, st_vf = cula_core.kda_decode_mtp(**args, state_pool=pool_vf, output_per_token_states=per_token,
                                           state_v_first=True)
    torch.testing.assert_close(o_vf, o, rtol=0, atol=0)
    torch.testing.assert_close(pool_vf.transpose(-1, -2), pool, rtol=0, atol=0)
    if per_token:
        assert st_vf.shape == (PN, PT, PHV, PV, PK)
        torch.testing.assert_close(st_vf.transpose(-1, -2), st, rtol=0, atol=0)


def test_v_first_verify_and_flush():
    args = pool_call_args()
    accept = torch.tensor([2, 3, 1, 0], dtype=torch.int32)
    pool = make_serving_pool()
    pool_vf = pool.transpose(-1, -2).contiguous()
    o, buf = cula_core.kda_decode_mtp_kvbuffer(**args, state_pool=pool)
    o_vf, buf_vf = cula_core.kda_decode_mtp_kvbuffer(**args, state_pool=pool_vf, state_v_first=True)
    torch.testing.assert_close(o_vf, o, rtol=0, atol=0)
    torch.testing.assert_close(buf_vf, buf, rtol=0, atol=0)  # the KVBuffer does not depend on the layout
    cula_core.kda_flush_kvbuffer(pool, args["cache_idx"], buf, accept)
    cula_core.kda_flush_kvbuffer_all_layers([pool_vf], args["cache_idx"], [buf_vf], accept, state_v_first=True)
    torch.testing.assert_close(pool_vf.transpose(-1, -2), pool, rtol=0, atol=0)


@pytest.mark.parametrize("v_first", [False, True])
def test_bf16_pools_round_the_fp32_state_once_per_step(v_first):
    # A bf16 pool: the state is loaded, advanced through the T tokens in fp32 and rounded to bf16 when stored,
    # exactly what the fp32 computation from the same (bf16-valued) state gives, rounded.
    args = pool_call_args()
    pool32 = make_serving_pool().bfloat16().float()
    if v_first:
        pool32 = pool32.transpose(-1, -2).contiguous()
    pool16 = pool32.bfloat16()
    o32, st32 = cula_core.kda_decode_mtp(**args, state_pool=pool32.clone(), output_per_token_states=True,
                                         state_v_first=v_first)
    o16, st16 = cula_core.kda_decode_mtp(**args, state_pool=pool16.clone(), output_per_token_states=True,
                                         state_v_first=v_first)
    assert st16.dtype == torch.bfloat16
    torch.testing.assert_close(o16, o32, rtol=0, atol=0)
    torch.testing.assert_close(st16, st32.bfloat16(), rtol=0, atol=0)
    cula_core.kda_decode_mtp(**args, state_pool=pool32, state_v_first=v_first)
    cula_core.kda_decode_mtp(**args, state_pool=pool16, state_v_first=v_first)
    torch.testing.assert_close(pool16, pool32.bfloat16(), rtol=0, atol=0)


def test_bf16_pool_decode_chain_stays_within_the_stated_tolerance():
    # Rounding to bf16 once per step: after s steps the state is within s * 2**-8 * max|S| of the fp32 chain
    # (each rounding errs by at most half an ulp, 2**-9 relative; the decays never amplify an error).
    pool32 = make_serving_pool()
    pool16 = pool32.bfloat16()
    steps = 6
    for s in range(steps):
        args = pool_call_args(T=1, seed=10 + s)
        cula_core.kda_decode(**args, state_pool=pool32)
        cula_core.kda_decode(**args, state_pool=pool16)
    bound = steps * 2.0 ** -8 * float(pool32.abs().max())
    err = float((pool16.float() - pool32).abs().max())
    assert 0 < err <= bound


def test_bf16_pool_flush_matches_the_per_token_states():
    args = pool_call_args()
    accept = torch.tensor([3, 2, 1, 2], dtype=torch.int32)
    pool16 = make_serving_pool().bfloat16()
    _, st = cula_core.kda_decode_mtp(**args, state_pool=pool16.clone(), output_per_token_states=True)
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args, state_pool=pool16)
    assert buf.dtype == torch.float32
    before = pool16.clone()
    cula_core.kda_flush_kvbuffer(pool16, args["cache_idx"], buf, accept)
    for i, (slot, m) in enumerate(zip(POOL_IDX, accept.tolist(), strict=True)):
        if slot >= 0:  # the rank-m rebuild and the recurrence round differently: one bf16 ulp apart at most
            torch.testing.assert_close(pool16[slot].float(), st[i, m - 1].float(), rtol=2.0 ** -7, atol=1e-6)
    untouched = [s for s in range(PP) if s not in (5, 0, 2)]
    assert torch.equal(pool16[untouched], before[untouched])


@pytest.mark.parametrize("op", ["kda_decode_mtp", "kda_decode_mtp_kvbuffer"])
def test_null_slot_pads_like_a_negative_index(op):
    args = pool_call_args()
    null = 0
    with_null = dict(args, cache_idx=torch.tensor([5, null, null, 2], dtype=torch.int32))
    with_neg = dict(args, cache_idx=torch.tensor([5, -1, -1, 2], dtype=torch.int32))
    pool_a, pool_b = make_serving_pool(), make_serving_pool()
    out_a = getattr(cula_core, op)(**with_null, state_pool=pool_a, null_slot=null)
    out_b = getattr(cula_core, op)(**with_neg, state_pool=pool_b)
    for a, b in zip(out_a, out_b, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(out_a[0][1:3], torch.zeros_like(out_a[0][1:3]))
    torch.testing.assert_close(pool_a, pool_b, rtol=0, atol=0)  # the null slot itself never written
    if op == "kda_decode_mtp_kvbuffer":
        accept = torch.tensor([1, 2, 3, 2], dtype=torch.int32)
        cula_core.kda_flush_kvbuffer(pool_a, with_null["cache_idx"], out_a[1], accept, null_slot=null)
        cula_core.kda_flush_kvbuffer(pool_b, with_neg["cache_idx"], out_b[1], accept)
        torch.testing.assert_close(pool_a, pool_b, rtol=0, atol=0)
        assert torch.equal(pool_a[null], make_serving_pool()[null])


def test_null_slot_may_repeat_but_live_slots_may_not():
    args = pool_call_args()
    pool = make_serving_pool()
    cula_core.kda_decode_mtp(**dict(args, cache_idx=torch.tensor([0, 0, 3, 0], dtype=torch.int32)),
                             state_pool=pool, null_slot=0)
    with pytest.raises(ValueError, match=r"cache_idx holds slot 3 more than once"):
        cula_core.kda_decode_mtp(**dict(args, cache_idx=torch.tensor([0, 3, 3, 0], dtype=torch.int32)),
                                 state_pool=pool, null_slot=0)
