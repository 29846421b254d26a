"""Tests of cula_core.reference.decode: state-pool decode steps, MTP per-token states and accepted-token commits."""

import pytest
import torch

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
