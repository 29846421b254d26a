"""Tests of cula_core.reference.chunk: equality with the recurrence, intermediates, long sequences, gradients."""

import itertools

import pytest
import torch

from cula_core.reference import ChunkIntermediates, chunk_kda_reference, kda_gate, l2norm, recurrent_kda
from reference_inputs import make_inputs

DT = torch.float64
TOL = 1e-10  # chunked vs token-by-token in fp64: only rounding differs


@pytest.mark.parametrize("T", [1, 17, 64, 100, 130])
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_chunk_equals_recurrent(T, gate):
    B, HQK, HV, K, V = 2, 1, 2, 8, 6
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, V, gate=gate, seed=T)
    h0 = torch.randn(B, HV, K, V, dtype=DT)
    o_r, ht_r = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, ht_c = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o_c.shape == (B, T, HV, V) and ht_c.shape == (B, HV, K, V)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=TOL)
    torch.testing.assert_close(ht_c, ht_r, rtol=0, atol=TOL)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_varlen_equals_recurrent(chunk_size):
    cu = torch.tensor([0, 0, 33, 33, 97, 98, 150, 150], dtype=torch.int32)
    T, HQK, HV, K, V = 150, 2, 4, 8, 4
    q, k, v, g, beta = make_inputs(1, T, HQK, HV, K, V, gate="safe", seed=1)
    h0 = torch.randn(len(cu) - 1, HV, K, V, dtype=DT)
    o_r, ht_r = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_c, ht_c = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    chunk_size=chunk_size)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=TOL)
    torch.testing.assert_close(ht_c, ht_r, rtol=0, atol=TOL)
    assert torch.equal(ht_c[0], h0[0]) and torch.equal(ht_c[2], h0[2]) and torch.equal(ht_c[6], h0[6])


def test_empty_inputs():
    HV, K, V = 2, 4, 3
    q, k, v, g, beta = make_inputs(1, 0, 1, HV, K, V)
    h0 = torch.randn(3, HV, K, V, dtype=DT)
    cu = torch.tensor([0, 0, 0, 0])
    for fn in (chunk_kda_reference, recurrent_kda):
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        assert o.shape == (1, 0, HV, V) and torch.equal(ht, h0)
        o, ht = fn(q, k, v, g, beta, initial_state=h0[:1], output_final_state=True)
        assert o.shape == (1, 0, HV, V) and torch.equal(ht, h0[:1])
    _, _, it = chunk_kda_reference(q, k, v, g, beta, cu_seqlens=cu, return_intermediates=True)
    assert it.h.shape == (1, 0, HV, K, V) and it.chunk_indices.shape == (0, 2)
    assert it.chunk_offsets.tolist() == [0, 0, 0, 0]


def _chunk_rows(x, t0, t1):
    """Rows t0:t1 of an FLA-layout [1 or B, T, HV, ...] tensor, as [HV, t1 - t0, ...] for one batch row 0."""
    return x[0, t0:t1].transpose(0, 1)


@pytest.mark.parametrize("varlen", [False, True])
def test_intermediates_self_consistent(varlen):
    BT, HQK, HV, K, V = 16, 1, 2, 6, 5
    if varlen:
        cu = [0, 20, 20, 52, 59]
        T = cu[-1]
    else:
        cu, T = [0, 45], 45
    q, k, v, g, beta = make_inputs(1, T, HQK, HV, K, V, seed=5)
    N = len(cu) - 1
    h0 = torch.randn(N, HV, K, V, dtype=DT)
    scale = 0.37
    o, ht, it = chunk_kda_reference(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                    cu_seqlens=torch.tensor(cu) if varlen else None, chunk_size=BT,
                                    return_intermediates=True)
    assert isinstance(it, ChunkIntermediates) and it.chunk_size == BT
    counts = [-(-(b - a) // BT) for a, b in itertools.pairwise(cu)]
    NT = sum(counts)
    assert it.h.shape == (1, NT, HV, K, V)
    assert it.Aqk.shape == it.Akk.shape == (1, T, HV, BT)
    assert it.w.shape == it.g_cumsum.shape == it.qg.shape == it.kg.shape == (1, T, HV, K)
    assert it.u.shape == it.v_new.shape == (1, T, HV, V)
    want_idx = [[n, i] for n, c in enumerate(counts) for i in range(c)]
    assert it.chunk_indices.tolist() == want_idx
    assert it.chunk_offsets.tolist() == [sum(counts[:n]) for n in range(N + 1)]
    assert it.chunk_token_start.tolist() == [cu[n] + i * BT for n, i in want_idx]

    qe, ke = q.repeat_interleave(HV // HQK, 2), k.repeat_interleave(HV // HQK, 2)
    eye = torch.eye(BT, dtype=DT)
    for c, (n, i) in enumerate(want_idx):
        t0 = cu[n] + i * BT
        t1 = min(t0 + BT, cu[n + 1])
        L = t1 - t0
        # h[c] == the recurrent state at the chunk start
        _, s_ref = recurrent_kda(q[:, cu[n]:t0], k[:, cu[n]:t0], v[:, cu[n]:t0], g[:, cu[n]:t0],
                                 beta[:, cu[n]:t0], initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(it.h[0, c], s_ref[0], rtol=0, atol=TOL)
        # G is the chunk-local cumsum
        G = _chunk_rows(it.g_cumsum, t0, t1)                                  # [HV, L, K]
        torch.testing.assert_close(G, _chunk_rows(g, t0, t1).cumsum(1), rtol=0, atol=1e-13)
        qc, kc, vc = _chunk_rows(qe, t0, t1), _chunk_rows(ke, t0, t1), _chunk_rows(v, t0, t1)
        bc = beta[0, t0:t1].T                                                  # [HV, L]
        # independent L: beta_i sum_d k_i k_j exp(G_i - G_j), strictly lower
        Lm = torch.zeros(HV, BT, BT, dtype=DT)
        Aqk = torch.zeros(HV, BT, BT, dtype=DT)
        for a in range(L):
            for b in range(a + 1):
                dec = torch.exp(G[:, a] - G[:, b])
                Aqk[:, a, b] = scale * (qc[:, a] * kc[:, b] * dec).sum(-1)
                if b < a:
                    Lm[:, a, b] = bc[:, a] * (kc[:, a] * kc[:, b] * dec).sum(-1)
        Akk = torch.zeros(HV, BT, BT, dtype=DT)
        Akk[:, :L] = _chunk_rows(it.Akk, t0, t1)
        Akk[:, L:, L:] = eye[L:, L:]  # rows past a partial chunk's end are not stored
        torch.testing.assert_close(Akk @ (eye + Lm), eye.expand(HV, BT, BT), rtol=0, atol=TOL)
        torch.testing.assert_close(_chunk_rows(it.Aqk, t0, t1), Aqk[:, :L], rtol=0, atol=TOL)
        # w, u, v_new, o from their definitions
        A = Akk[:, :L, :L]
        w = A @ (bc[..., None] * kc * torch.exp(G))
        u = A @ (bc[..., None] * vc)
        torch.testing.assert_close(_chunk_rows(it.w, t0, t1), w, rtol=0, atol=TOL)
        torch.testing.assert_close(_chunk_rows(it.u, t0, t1), u, rtol=0, atol=TOL)
        v_new = u - w @ it.h[0, c]
        torch.testing.assert_close(_chunk_rows(it.v_new, t0, t1), v_new, rtol=0, atol=TOL)
        o_c = (scale * qc * torch.exp(G)) @ it.h[0, c] + Aqk[:, :L, :L] @ v_new
        torch.testing.assert_close(_chunk_rows(o, t0, t1), o_c, rtol=0, atol=TOL)
        torch.testing.assert_close(_chunk_rows(it.kg, t0, t1), kc * torch.exp(G[:, -1:] - G), rtol=0, atol=TOL)
    # the state after each sequence's last chunk is its final state
    for n in range(N):
        if counts[n] == 0:
            assert torch.equal(ht[n], h0[n])


def test_intermediates_fixed_length_batch_layout():
    B, T, BT = 2, 40, 16
    q, k, v, g, beta = make_inputs(B, T, 1, 1, 4, 3, seed=9)
    _, _, it = chunk_kda_reference(q, k, v, g, beta, chunk_size=BT, return_intermediates=True)
    assert it.h.shape == (B, 3, 1, 4, 3)
    assert torch.equal(it.h[:, 0], torch.zeros(B, 1, 4, 3, dtype=DT))
    assert it.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert it.chunk_token_start.tolist() == [0, 16, 32, 0, 16, 32]
    for b in range(B):
        _, s = recurrent_kda(q[b:b + 1, :32], k[b:b + 1, :32], v[b:b + 1, :32], g[b:b + 1, :32],
                             beta[b:b + 1, :32], output_final_state=True)
        torch.testing.assert_close(it.h[b, 2], s[0], rtol=0, atol=TOL)


def test_long_sequence_strong_decay_stays_finite_fp32():
    # Strongest safe-gate decay (-5 per step): a cumulative product over a chunk would underflow/overflow;
    # exp of differences of cumulative log gates must not.
    T, K, V = 32768, 16, 16
    q, k, v, g, beta = make_inputs(1, T, 1, 1, K, V, gate="safe", seed=11, dtype=torch.float32, lower_bound=-5.0)
    g = torch.minimum(g, torch.full_like(g, -4.0))  # push most channels to the strong end
    h0 = torch.randn(1, 1, K, V)
    o, ht = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    # and it is still the right answer (fp32 vs the fp32 recurrence over the last 2048 tokens, which only
    # depend on the state entering them: the decay wipes everything older)
    t0 = T - 2048
    _, s_mid = chunk_kda_reference(q[:, :t0], k[:, :t0], v[:, :t0], g[:, :t0], beta[:, :t0], initial_state=h0,
                                   output_final_state=True)
    o_r, ht_r = recurrent_kda(q[:, t0:], k[:, t0:], v[:, t0:], g[:, t0:], beta[:, t0:], initial_state=s_mid,
                              output_final_state=True)
    torch.testing.assert_close(o[:, t0:], o_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ht, ht_r, rtol=1e-4, atol=1e-5)


def test_chunk_fp32_matches_fp64():
    q, k, v, g, beta = make_inputs(1, 200, 1, 2, 16, 16, seed=4)
    o64 = chunk_kda_reference(q, k, v, g, beta)[0]
    o32 = chunk_kda_reference(*(x.float() for x in (q, k, v, g, beta)))[0]
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, rtol=0, atol=1e-5)


def _leaves(B, T, HQK, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    def leaf(*s):
        return torch.randn(*s, generator=gen, dtype=DT).requires_grad_()

    return (leaf(B, T, HQK, K), leaf(B, T, HQK, K), leaf(B, T, HV, V), leaf(B, T, HV, K), leaf(HV), leaf(HV * K),
            leaf(B, T, HV))


@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_chunk_gradcheck_through_gates_and_l2norm(gate):
    B, T, HQK, HV, K, V, BT = 1, 7, 1, 2, 3, 2, 4  # two chunks, the last partial
    q, k, v, g_raw, A_log, dt_bias, beta_raw = _leaves(B, T, HQK, HV, K, V, seed=2)
    h0 = torch.randn(B, HV, K, V, dtype=DT, requires_grad=True)
    lb = -5.0 if gate == "safe" else None

    def f(q, k, v, g_raw, A_log, dt_bias, beta_raw, h0):
        g = kda_gate(g_raw, A_log, dt_bias, safe_gate=lb is not None, lower_bound=lb)
        return chunk_kda_reference(l2norm(q), l2norm(k), v, g, torch.sigmoid(beta_raw), initial_state=h0,
                                   output_final_state=True, chunk_size=BT)

    assert torch.autograd.gradcheck(f, (q, k, v, g_raw, A_log, dt_bias, beta_raw, h0), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)


def test_chunk_gradcheck_varlen():
    cu = torch.tensor([0, 3, 3, 9])
    q, k, v, g_raw, A_log, dt_bias, beta_raw = _leaves(1, 9, 1, 1, 3, 2, seed=3)

    def f(q, k, v, g_raw, beta_raw):
        g = kda_gate(g_raw, A_log.detach(), dt_bias.detach())
        return chunk_kda_reference(l2norm(q), l2norm(k), v, g, torch.sigmoid(beta_raw), output_final_state=True,
                                   cu_seqlens=cu, chunk_size=4)

    assert torch.autograd.gradcheck(f, (q, k, v, g_raw, beta_raw), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_chunk_gradients_equal_recurrent_gradients():
    B, T, HQK, HV, K, V = 2, 37, 1, 2, 8, 4
    raw = _leaves(B, T, HQK, HV, K, V, seed=4)
    h0 = torch.randn(B, HV, K, V, dtype=DT, requires_grad=True)
    do, dht = torch.randn(B, T, HV, V, dtype=DT), torch.randn(B, HV, K, V, dtype=DT)

    def grads(fn, **kw):
        q, k, v, g_raw, A_log, dt_bias, beta_raw = raw
        g = kda_gate(g_raw, A_log, dt_bias, lower_bound=-5.0)
        o, ht = fn(l2norm(q), l2norm(k), v, g, torch.sigmoid(beta_raw), initial_state=h0, output_final_state=True,
                   **kw)
        return torch.autograd.grad((o * do).sum() + (ht * dht).sum(), (*raw, h0))

    for gc, gr in zip(grads(chunk_kda_reference, chunk_size=16), grads(recurrent_kda), strict=True):
        torch.testing.assert_close(gc, gr, rtol=0, atol=1e-9)
