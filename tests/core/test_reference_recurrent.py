"""Tests of cula_core.reference.gates and .recurrent against hand-written formulas and an explicit loop (CPU, fp64)."""

import math

import pytest
import torch
import torch.nn.functional as F

from cula_core.reference import activate_beta, kda_gate, l2norm, log_decay, recurrent_kda, safe_gate, softplus_gate
from reference_inputs import make_inputs

DT = torch.float64
TOL = 1e-12  # fp64: the vectorised recurrence and the explicit loop differ only by summation order


def loop_kda(q, k, v, g, beta, scale, h0=None, cu_seqlens=None):
    """Independent explicit loop over (sequence, value head, token), one [K, V] state at a time."""
    B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens]
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=DT)
    finals = torch.zeros(len(seqs), HV, K, V, dtype=DT)
    for n, (b, t0, t1) in enumerate(seqs):
        for hv in range(HV):
            h = hv // (HV // HQK)
            S = h0[n, hv].clone() if h0 is not None else torch.zeros(K, V, dtype=DT)
            for t in range(t0, t1):
                S = torch.diag(torch.exp(g[b, t, hv])) @ S
                kt = k[b, t, h]
                S = S + beta[b, t, hv] * torch.outer(kt, v[b, t, hv] - S.T @ kt)
                o[b, t, hv] = S.T @ (scale * q[b, t, h])
            finals[n, hv] = S
    return o, finals


# ------------------------------------------------------------------------------------------------ gates


def test_l2norm_formula():
    x = torch.randn(3, 5, 7, dtype=DT)
    x[0, 0] = 0.0  # eps keeps the zero row finite (0 / sqrt(1e-6) = 0)
    want = x / torch.sqrt((x**2).sum(-1, keepdim=True) + 1e-6)
    got = l2norm(x)
    assert torch.allclose(got, want, rtol=1e-14, atol=0)
    assert torch.all(got[0, 0] == 0)


def test_softplus_gate_matches_hand_formula():
    HV, K = 3, 4
    g = torch.randn(2, 5, HV, K, dtype=DT) * 10  # exercises softplus' linear region (x > 20)
    A_log, dt_bias = torch.randn(HV, dtype=DT), torch.randn(HV * K, dtype=DT)
    got = softplus_gate(g, A_log, dt_bias)
    want = torch.empty_like(g)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in g.shape)).tolist():
        b, t, hv, d = idx
        x = g[b, t, hv, d].item() + dt_bias[hv * K + d].item()
        sp = x if x > 20 else math.log1p(math.exp(x))
        want[b, t, hv, d] = -math.exp(A_log[hv].item()) * sp
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-13)
    assert torch.all(got <= 0)
    # no dt_bias
    assert torch.allclose(softplus_gate(g, A_log), -A_log.exp()[:, None] * F.softplus(g), rtol=1e-14, atol=0)


@pytest.mark.parametrize("with_A", [True, False])
def test_safe_gate_matches_hand_formula(with_A):
    HV, K, lb = 2, 3, -5.0
    g = torch.randn(4, HV, K, dtype=DT) * 3
    A_log = torch.randn(HV, dtype=DT) if with_A else None
    dt_bias = torch.randn(HV * K, dtype=DT)
    got = safe_gate(g, A_log, dt_bias, lb)
    want = torch.empty_like(g)
    for t in range(4):
        for hv in range(HV):
            for d in range(K):
                x = g[t, hv, d].item() + dt_bias[hv * K + d].item()
                if with_A:
                    x *= math.exp(A_log[hv].item())
                want[t, hv, d] = lb / (1 + math.exp(-x))
    assert torch.allclose(got, want, rtol=1e-14, atol=1e-15)
    assert torch.all((got >= lb) & (got <= 0))  # open interval up to sigmoid saturation


def test_kda_gate_dispatch_follows_fla():
    HV, K = 2, 4
    g = torch.randn(3, HV, K, dtype=DT)
    A_log, dt_bias = torch.randn(HV, dtype=DT), torch.randn(HV * K, dtype=DT)
    sp = softplus_gate(g, A_log, dt_bias)
    lb = safe_gate(g, A_log, dt_bias, -3.0)
    assert torch.equal(kda_gate(g, A_log, dt_bias), sp)
    # FLA picks the sigmoid gate whenever lower_bound is set, safe_gate or not
    assert torch.equal(kda_gate(g, A_log, dt_bias, safe_gate=False, lower_bound=-3.0), lb)
    assert torch.equal(kda_gate(g, A_log, dt_bias, safe_gate=True, lower_bound=-3.0), lb)
    # A_log=None is only allowed with lower_bound: lower_bound * sigmoid(g + dt_bias)
    want = -3.0 * torch.sigmoid(g + dt_bias.view(HV, K))
    assert torch.allclose(kda_gate(g, None, dt_bias, lower_bound=-3.0), want, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g, None, dt_bias)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(g, A_log, dt_bias, safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(g, A_log, dt_bias, safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(g, A_log, dt_bias[:-1])


def test_calling_convention_gate_modes_and_beta_activations():
    """log_decay / activate_beta: what a kernel receiving (gate, beta_activation) must compute."""
    HV, K = 2, 4
    g = torch.randn(3, HV, K, dtype=DT)
    A_log, dt_bias = torch.randn(HV, dtype=DT), torch.randn(HV * K, dtype=DT)
    assert log_decay(g, A_log, dt_bias, "precomputed", None) is g
    assert torch.equal(log_decay(g, A_log, dt_bias, "softplus", None), softplus_gate(g, A_log, dt_bias))
    assert torch.equal(log_decay(g, A_log, dt_bias, "safe", -2.0), safe_gate(g, A_log, dt_bias, -2.0))
    with pytest.raises(ValueError, match="gate: expected one of"):
        log_decay(g, A_log, dt_bias, "sigmoid", None)
    beta = torch.randn(3, HV, dtype=DT)
    assert activate_beta(beta, "none") is beta
    assert torch.allclose(activate_beta(beta, "sigmoid"), 1 / (1 + torch.exp(-beta)), rtol=1e-15, atol=0)
    assert torch.allclose(activate_beta(beta, "2sigmoid"), 2 / (1 + torch.exp(-beta)), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="beta_activation: expected one of"):
        activate_beta(beta, "relu")


def test_gate_fp32_params_with_fp64_input_compute_in_fp64():
    g = torch.randn(2, 3, 4, dtype=DT)
    out = kda_gate(g, torch.randn(3), torch.randn(12))
    assert out.dtype == torch.float64


# ------------------------------------------------------------------------------------------------ recurrence


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_recurrent_matches_explicit_loop(ratio, gate):
    B, T, HQK, K, V = 2, 11, 2, 5, 3
    HV = HQK * ratio
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, V, gate=gate, seed=ratio)
    h0 = torch.randn(B, HV, K, V, dtype=DT)
    o, ht = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = loop_kda(q, k, v, g, beta, K**-0.5, h0)
    assert o.shape == (B, T, HV, V) and ht.shape == (B, HV, K, V)
    assert o.dtype == DT and ht.dtype == DT
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=TOL)


def test_recurrent_no_initial_state_no_final_and_custom_scale():
    q, k, v, g, beta = make_inputs(1, 9, 1, 2, 4, 4)
    o, ht = recurrent_kda(q, k, v, g, beta, scale=0.3)
    assert ht is None
    torch.testing.assert_close(o, loop_kda(q, k, v, g, beta, 0.3)[0], rtol=0, atol=TOL)
    # default scale is K ** -0.5
    torch.testing.assert_close(recurrent_kda(q, k, v, g, beta)[0], recurrent_kda(q, k, v, g, beta, scale=0.5)[0],
                               rtol=0, atol=0)


def test_recurrent_varlen_with_zero_length_sequences():
    cu = torch.tensor([0, 0, 7, 7, 20, 23, 23], dtype=torch.int32)
    T, HQK, HV, K, V = 23, 1, 2, 4, 3
    q, k, v, g, beta = make_inputs(1, T, HQK, HV, K, V, gate="safe", seed=3)
    N = len(cu) - 1
    h0 = torch.randn(N, HV, K, V, dtype=DT)
    o, ht = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = loop_kda(q, k, v, g, beta, K**-0.5, h0, cu)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=TOL)
    for n in (0, 2, 5):  # zero-length: final state is the initial state, bitwise
        assert torch.equal(ht[n], h0[n])
    # varlen == running each sequence alone
    for n in range(N):
        t0, t1 = int(cu[n]), int(cu[n + 1])
        o_n, ht_n = recurrent_kda(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1],
                                  initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, t0:t1], o_n, rtol=0, atol=TOL)
        torch.testing.assert_close(ht[n:n + 1], ht_n, rtol=0, atol=TOL)


def test_recurrent_fp32_inputs_compute_in_fp32():
    q, k, v, g, beta = (x.float() for x in make_inputs(1, 6, 1, 1, 4, 4))
    o, ht = recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    o64 = recurrent_kda(*(x.double() for x in (q, k, v, g, beta)))[0]
    torch.testing.assert_close(o.double(), o64, rtol=0, atol=1e-5)


def test_recurrent_gradcheck_through_gates_and_l2norm():
    B, T, HQK, HV, K, V = 1, 4, 1, 2, 3, 2
    gen = torch.Generator().manual_seed(7)
    def leaf(*s):
        return torch.randn(*s, generator=gen, dtype=DT).requires_grad_()

    q, k, v, g_raw = leaf(B, T, HQK, K), leaf(B, T, HQK, K), leaf(B, T, HV, V), leaf(B, T, HV, K)
    A_log, dt_bias, beta_raw, h0 = leaf(HV), leaf(HV * K), leaf(B, T, HV), leaf(B, HV, K, V)

    def f(q, k, v, g_raw, A_log, dt_bias, beta_raw, h0):
        g = kda_gate(g_raw, A_log, dt_bias)
        o, ht = recurrent_kda(l2norm(q), l2norm(k), v, g, torch.sigmoid(beta_raw), initial_state=h0,
                              output_final_state=True)
        return o, ht

    def f_safe(q, k, v, g_raw, A_log, dt_bias, beta_raw, h0):
        g = kda_gate(g_raw, A_log, dt_bias, safe_gate=True, lower_bound=-5.0)
        return recurrent_kda(l2norm(q), l2norm(k), v, g, torch.sigmoid(beta_raw), initial_state=h0,
                             output_final_state=True)

    args = (q, k, v, g_raw, A_log, dt_bias, beta_raw, h0)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradcheck(f_safe, args, eps=1e-6, atol=1e-7, rtol=1e-5)
