"""Tests of cula_core.reference.context_parallel: piece maps, split points, and split == unsplit (CPU, fp64)."""

import itertools

import pytest
import torch

from cula_core.reference import (
    chunk_kda_reference,
    context_parallel_reference,
    kda_gate,
    l2norm,
    piece_affine_map,
    recurrent_kda,
    split_at_chunks,
)

DT = torch.float64
TOL = 1e-10




def make_inputs(B, T, HQK, HV, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=gen, dtype=DT)

    g = kda_gate(r(B, T, HV, K), r(HV), r(HV * K), safe_gate=True, lower_bound=-2.0)
    return l2norm(r(B, T, HQK, K)), l2norm(r(B, T, HQK, K)), r(B, T, HV, V), g, torch.sigmoid(r(B, T, HV))


def test_split_at_chunks():
    assert split_at_chunks(200, 1) == [0, 200]
    assert split_at_chunks(200, 2) == [0, 128, 200]
    assert split_at_chunks(200, 3) == [0, 128, 192, 200]   # last piece: one partial chunk of 8 tokens
    assert split_at_chunks(256, 4) == [0, 64, 128, 192, 256]
    assert split_at_chunks(100, 2, chunk_size=16) == [0, 64, 100]
    assert split_at_chunks(0, 1) == [0, 0]
    for T, P in [(1000, 5), (65, 2), (129, 3)]:
        b = split_at_chunks(T, P)
        assert b[0] == 0 and b[-1] == T and len(b) == P + 1
        assert all(x % 64 == 0 for x in b[1:-1]) and all(x < y for x, y in itertools.pairwise(b))
    with pytest.raises(ValueError, match="num_pieces"):
        split_at_chunks(100, 3)  # only 2 chunks


def test_piece_affine_map_equals_product_of_token_transitions():
    B, T, HQK, HV, K, V = 2, 10, 1, 2, 4, 3
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, V, seed=1)
    t0, t1 = 3, 9
    M, c = piece_affine_map(k, v, g, beta, t0, t1, chunk_size=4)
    assert M.shape == (B, HV, K, K) and c.shape == (B, HV, K, V)
    for b in range(B):
        for hv in range(HV):
            Mw, cw = torch.eye(K, dtype=DT), torch.zeros(K, V, dtype=DT)
            for t in range(t0, t1):
                kt, bt = k[b, t, hv // (HV // HQK)], beta[b, t, hv]
                A = (torch.eye(K, dtype=DT) - bt * torch.outer(kt, kt)) @ torch.diag(torch.exp(g[b, t, hv]))
                Mw, cw = A @ Mw, A @ cw + bt * torch.outer(kt, v[b, t, hv])
            torch.testing.assert_close(M[b, hv], Mw, rtol=0, atol=1e-13)
            torch.testing.assert_close(c[b, hv], cw, rtol=0, atol=1e-13)
    # the map moves any state the way the recurrence does
    S = torch.randn(B, HV, K, V, dtype=DT)
    _, S_ref = recurrent_kda(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], initial_state=S,
                             output_final_state=True)
    torch.testing.assert_close(M @ S + c, S_ref, rtol=0, atol=1e-13)
    # an empty piece is the identity
    M0, c0 = piece_affine_map(k, v, g, beta, 5, 5)
    assert torch.equal(M0, torch.eye(K, dtype=DT).expand(B, HV, K, K)) and torch.equal(c0, torch.zeros_like(c0))


@pytest.mark.parametrize("num_pieces", [1, 2, 3])
@pytest.mark.parametrize("ratio", [1, 2])
def test_cp_equals_unsplit(num_pieces, ratio):
    B, T, HQK, K, V = 2, 200, 1, 8, 6   # 3 pieces: [0, 128, 192, 200], a short last piece
    HV = HQK * ratio
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, V, seed=num_pieces)
    h0 = torch.randn(B, HV, K, V, dtype=DT)
    bounds = split_at_chunks(T, num_pieces)
    o, ht = context_parallel_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       boundaries=bounds)
    o_ref, ht_ref = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=TOL)
    # chaining the piece maps alone reproduces the final state
    S = h0
    for t0, t1 in itertools.pairwise(bounds):
        M, c = piece_affine_map(k, v, g, beta, t0, t1)
        S = M @ S + c
    torch.testing.assert_close(S, ht_ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("bounds", [[0, 1, 90], [0, 89, 90], [0, 30, 30, 61, 90], [0, 16, 32, 48, 64, 80, 90]])
def test_cp_arbitrary_cut_points(bounds):
    B, T, HQK, HV, K, V = 1, 90, 2, 4, 4, 4
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, V, seed=7)
    o, ht = context_parallel_reference(q, k, v, g, beta, scale=0.3, output_final_state=True, boundaries=bounds,
                                       chunk_size=16)
    o_ref, ht_ref = recurrent_kda(q, k, v, g, beta, scale=0.3, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=TOL)


def test_cp_single_sequence_varlen():
    T, HQK, HV, K, V = 150, 1, 2, 8, 8
    q, k, v, g, beta = make_inputs(1, T, HQK, HV, K, V, seed=9)
    h0 = torch.randn(1, HV, K, V, dtype=DT)
    cu = torch.tensor([0, T], dtype=torch.int32)
    o, ht = context_parallel_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       boundaries=split_at_chunks(T, 3), cu_seqlens=cu)
    o_ref, ht_ref = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=TOL)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        context_parallel_reference(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 50, T]))
    with pytest.raises(ValueError, match="boundaries"):
        context_parallel_reference(q, k, v, g, beta, boundaries=[0, 100, 90, T])
