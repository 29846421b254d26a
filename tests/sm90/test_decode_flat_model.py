"""CPU check of the algorithm of the opt-in flat chunk verify (cula_sm90/decode/kvbuffer_verify_flat.py) before any
GPU time: a step-by-step fp64 model of what the kernel computes (tokens padded to MP rows, the cumulative gate as a
masked sum, the pair sums, U = Kt S_0 and W = Qt S_0, L^{-1} by the right-looking substitution one column per
lane, Dm = L^{-1} diag(beta), C = B Dm, delta = Dm r and o = W + C r with r = v - U, over all MP padded tokens)
against cula_core's reference KVBuffer verify. It checks the regrouped math and the padding argument (padded rows
never reach a live token, even with garbage in them), not the kernel: the kernel's own test is
tests/sm90/test_decode_verify_gpu.py (variant chunk_flat)."""

from __future__ import annotations

import pytest
import torch

from cula_core.ops import reference_impls
from decode_cases import make_case, reference_args, reference_kvbuffer, rel_err


def flat_model(kw, *, garbage: float = 0.0):
    """o [N, T, HV, V] and the KVBuffer [N, T, HV, 2K + V], computed as FlatChunkVerify does (fp64). `garbage`
    is put in the padded token rows' v and beta (the kernel reloads token T - 1 there; any finite value must do)."""
    (q, k, v, g, beta, pool, idx, A_log, dt_bias), flags = reference_args(kw)
    qp, kp, gp, bp = reference_impls._prepare_decode(q, k, g, beta, A_log, dt_bias, pool,
                                                      lower_bound=flags["lower_bound"],
                                                      use_qk_l2norm_in_kernel=flags["use_qk_l2norm_in_kernel"])
    N, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    MP = 8 if T <= 8 else 16
    o = torch.zeros(N, T, HV, V, dtype=torch.float64)
    buf = torch.zeros(N, T, HV, 2 * K + V, dtype=torch.float64)
    tri = torch.tril(torch.ones(MP, MP, dtype=torch.bool))
    for n in range(N):
        if idx[n] < 0:
            continue
        for hv in range(HV):
            h = hv // (HV // HQK) if qp.shape[2] == HQK else hv
            S0 = pool[idx[n], hv]
            qq = torch.zeros(MP, K, dtype=torch.float64)
            kk = torch.zeros(MP, K, dtype=torch.float64)
            lg = torch.full((MP, K), float("nan"), dtype=torch.float64)   # rows >= T are never read
            qq[:T] = qp[n, :, h] * flags["scale"]
            kk[:T] = kp[n, :, h]
            lg[:T] = gp[n, :, hv]
            G = torch.zeros(MP, K, dtype=torch.float64)
            for t in range(T):   # masked sum of the first t + 1 rows (select, so NaN rows never enter)
                G[t] = torch.where(torch.arange(MP)[:, None] <= t, lg, torch.zeros_like(lg)).sum(0)
            Kt, Qt = kk * G.exp(), qq * G.exp()          # zero rows >= T
            A = torch.zeros(MP, MP, dtype=torch.float64)
            B = torch.zeros(MP, MP, dtype=torch.float64)
            for t in range(T):
                for s in range(t + 1):
                    d = (G[t] - G[s]).exp() * kk[s]
                    B[t, s] = (d * qq[t]).sum()
                    if s < t:
                        A[t, s] = (d * kk[t]).sum()
            U, W = Kt @ S0, Qt @ S0
            vv = torch.full((MP, V), garbage, dtype=torch.float64)
            bb = torch.full((MP,), garbage, dtype=torch.float64)
            vv[:T] = v[n, :, hv]
            bb[:T] = bp[n, :, hv]
            X = torch.zeros(MP, MP, dtype=torch.float64)
            for j in range(MP):   # one lane: column j of L^{-1}, right-looking
                acc = torch.zeros(MP, dtype=torch.float64)
                for s in range(MP):
                    X[s, j] = float(s == j) - bb[s] * acc[s]
                    acc[s + 1:] += A[s + 1:, s] * X[s, j]
            Dm = X * bb[None, :]
            C = torch.where(tri, B, torch.zeros_like(B)) @ Dm
            r = vv - U
            delta = Dm @ r
            oo = W + C @ r
            o[n, :, hv] = oo[:T]
            buf[n, :, hv, :K] = kk[:T]
            buf[n, :, hv, K:2 * K] = G[:T]
            buf[n, :, hv, 2 * K:] = delta[:T]
    return o, buf


@pytest.mark.parametrize(("T", "K", "safe", "G"), [(1, 64, False, 1), (2, 128, True, 2), (5, 64, False, 4),
                                                   (8, 64, True, 1), (9, 64, False, 2), (16, 64, True, 1)])
def test_flat_algorithm_matches_reference(T, K, safe, G):
    kw = make_case(4, T, 2, 2 * G, K=K, V=K, safe=safe, seed=70 + T, device="cpu")
    o_ref, buf_ref = reference_kvbuffer(kw)
    for garbage in (0.0, 1e3):
        o, buf = flat_model(kw, garbage=garbage)
        assert rel_err(o, o_ref) < 1e-12, (garbage, rel_err(o, o_ref))
        assert rel_err(buf, buf_ref) < 1e-12, (garbage, rel_err(buf, buf_ref))
