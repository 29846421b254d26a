"""GPU test of the tensor-core stage 1 (chunk_intra_tc.py) against the SIMT stage 1 (chunk_intra.py, validated
against the reference through the whole prefill): the same inputs, every intermediate compared (w, u, qg, kg,
Aqk bf16; gl fp32), on varlen batches with empty, 1-token and partial chunks, GVA, and the safe gate from mild to
saturated at lower_bound = -5 (TC_LOWER_BOUND_MIN: the largest factor the TC kernel's scores meet, e^80).

Bounds: ||tc - simt|| / ||simt|| <= STAGE1_TOL for each bf16 intermediate (both round to bf16; the TC kernel's
scores have bf16 operands and its Akk is bf16 as FLA's, the SIMT one's fp32: a few 1e-3 is expected);
gl <= 1e-5 (the same fp32 cumulative sum). Both kernels also give the same intermediates bit for bit, run after run
(no shared-memory race)."""

from __future__ import annotations

import pytest
import torch

from prefill_cases import rel_err, require_gpu

pytestmark = pytest.mark.gpu
STAGE1_TOL = 1.5e-2
K = 128


def stage1(kind, q, k, v, g, beta, A_log, dt_bias, lens, lower_bound, beta_act="sigmoid", store_akk=False):
    from cula_sm90.prefill import forward as F

    TT, HQK = q.shape[1], q.shape[2]
    HV = v.shape[2]
    cu_l, co_l, _ = F.host_tables(tuple(lens), HV, 132, "off")
    cu = torch.tensor(cu_l, dtype=torch.int32, device="cuda")
    co = torch.tensor(co_l, dtype=torch.int32, device="cuda")
    NC = max(co_l[-1], 1)
    mid = torch.bfloat16
    out = {n: torch.zeros(TT, HV, K, dtype=mid, device="cuda") for n in ("w", "u", "qg", "kg")}
    out["aqk"] = torch.zeros(TT, HV, 64, dtype=mid, device="cuda")
    if store_akk:
        out["akk"] = torch.zeros(TT, HV, 64, dtype=mid, device="cuda")
    out["gl"] = torch.zeros(NC, HV, K, dtype=torch.float32, device="cuda")
    fn = F.compile_intra("safe", beta_act, True, True, True, q.dtype, g.dtype, beta.dtype, kind, store_akk)
    N = len(lens)
    # Akk's address: its own tensor with store_akk, else Aqk's (never written then)
    mids = (out[n].data_ptr() for n in ("w", "u", "qg", "kg", "aqk", "akk" if store_akk else "aqk"))
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(),
       cu.data_ptr(), co.data_ptr(), *mids, out["gl"].data_ptr(), TT, N, NC, F.search_steps(N), HQK,
       HV // HQK, K ** -0.5, float(lower_bound), F.launch_stream())
    torch.cuda.synchronize()
    return out


CASES = {  # lengths, HQK, HV, lower_bound, scale of raw g, g's dtype
    "fixed-1x128-G1": ([128], 1, 1, -5.0, 1.0, torch.bfloat16),
    "varlen-odd-G2": ([0, 1, 63, 0, 65, 130, 7], 2, 4, -5.0, 1.0, torch.bfloat16),
    "varlen-odd-G2-g-fp32": ([0, 1, 63, 0, 65, 130, 7], 2, 4, -5.0, 1.0, torch.float32),
    "varlen-G4-lb5-saturated": ([200, 64, 33], 1, 4, -5.0, 8.0, torch.bfloat16),
    "mild-lb1": ([300], 2, 2, -1.0, 0.1, torch.bfloat16),
}


def _case_inputs(case):
    lens, HQK, HV, lb, gscale, g_dtype = CASES[case]
    TT = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(TT + HV)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    bf = torch.bfloat16
    q, k = r(1, TT, HQK, K).to(bf), r(1, TT, HQK, K).to(bf)
    v = r(1, TT, HV, K).to(bf)
    g = (gscale * r(1, TT, HV, K) + (2.0 if gscale > 1 else 0.0)).to(g_dtype)
    beta = r(1, TT, HV).to(bf)
    A_log = torch.log(torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * r(HV * K)
    return lens, lb, (q, k, v, g, beta, A_log, dt_bias)


@pytest.mark.parametrize("case", list(CASES))
def test_tc_stage1_equals_simt(case):
    require_gpu()
    lens, lb, (q, k, v, g, beta, A_log, dt_bias) = _case_inputs(case)
    a = stage1("tc", q, k, v, g, beta, A_log, dt_bias, lens, lb)
    b = stage1("simt", q, k, v, g, beta, A_log, dt_bias, lens, lb)
    errs = {n: rel_err(a[n], b[n]) for n in a}
    print(f"STAGE1_ERR {case} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    assert errs["gl"] <= 1e-5, errs
    assert all(errs[n] <= STAGE1_TOL for n in ("w", "u", "qg", "kg", "aqk")), errs


@pytest.mark.parametrize("kind", ["tc", "simt"])
def test_stage1_is_deterministic(kind):
    """The same inputs give the same intermediates bit for bit, run after run: a shared-memory race (a warp
    overwriting what another still reads) shows as differences in the last bits of w / u between runs."""
    require_gpu()
    lens = [3000, 1, 0, 700]
    TT = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(5)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    bf = torch.bfloat16
    q, k, v, g = r(1, TT, 2, K).to(bf), r(1, TT, 2, K).to(bf), r(1, TT, 4, K).to(bf), r(1, TT, 4, K).to(bf)
    beta = r(1, TT, 4).to(bf)
    A_log = torch.log(torch.empty(4, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * r(4 * K)
    first = stage1(kind, q, k, v, g, beta, A_log, dt_bias, lens, -5.0)
    for _ in range(4):
        again = stage1(kind, q, k, v, g, beta, A_log, dt_bias, lens, -5.0)
        assert all(torch.equal(first[n], again[n]) for n in first), [n for n in first
                                                                     if not torch.equal(first[n], again[n])]


# Akk (store_akk, chunk_kda's training residual) against the fp64 reference's (I + L)^-1: bf16 of an inverse from
# bf16 factorised scores and split-bf16 products; cula-sm100's forward (TF32-free mma.sync, bf16 operands) is held
# to the same bound against it
AKK_TOL = 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_tc_stage1_akk_is_the_reference_inverse(case):
    """store_akk writes Akk = (I + L)^-1 (FLA 0.6.0's solve_tril output: unit diagonal, zeros above, no beta) for
    every row of every chunk (partial ones included), and changes none of the other outputs bit for bit."""
    require_gpu()
    from cula_core import reference_backend as R
    from cula_core.reference import chunk_kda_reference

    lens, lb, (q, k, v, g, beta, A_log, dt_bias) = _case_inputs(case)
    plain = stage1("tc", q, k, v, g, beta, A_log, dt_bias, lens, lb)
    out = stage1("tc", q, k, v, g, beta, A_log, dt_bias, lens, lb, store_akk=True)
    assert all(torch.equal(out[n], plain[n]) for n in plain), [n for n in plain if not torch.equal(out[n], plain[n])]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    qp, kp, gp, bp = R.prepare_inputs(q, k, g, beta, A_log, dt_bias, dtype=torch.float64,
                                      use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=lb,
                                      beta_activation="sigmoid")
    _, _, x = chunk_kda_reference(qp, kp, v.double(), gp, bp, scale=K ** -0.5, cu_seqlens=cu,
                                  return_intermediates=True)
    akk, ref = out["akk"], x.Akk[0]
    err = rel_err(akk, ref)
    print(f"STAGE1_AKK_ERR {case} {err:.2e}")
    assert err <= AKK_TOL, err
    # exact structure: unit diagonal and zeros above it, per chunk position
    pos = torch.cat([torch.arange(n, device="cuda") % 64 for n in lens])
    cols = torch.arange(64, device="cuda")
    diag = akk[torch.arange(akk.shape[0], device="cuda"), :, pos]
    assert diag.eq(1).all()
    above = cols[None, :] > pos[:, None]  # [TT, 64]
    assert akk.permute(0, 2, 1)[above].eq(0).all()


def test_tc_stage1_akk_matches_sm100_forward():
    """The sm90 Akk against cula-sm100's forward Akk (the residual its backward was built on) on the same inputs:
    both within AKK_TOL of each other (varlen with empty and 1-token sequences, GVA 2)."""
    require_gpu()
    pytest.importorskip("cula_sm100")
    from cula_sm100.forward import launch as sm100

    lens, lb, (q, k, v, g, beta, A_log, dt_bias) = _case_inputs("varlen-odd-G2")
    out = stage1("tc", q, k, v, g, beta, A_log, dt_bias, lens, lb, store_akk=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _o, _ht, (_aqk, akk) = sm100.chunk_kda(
        q, k, v, g, beta, A_log, dt_bias, None, cu, cu.cpu(), scale=K ** -0.5, output_final_state=False,
        use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=lb, beta_activation="sigmoid", save_residuals=True)
    err = rel_err(out["akk"], akk[0])
    print(f"STAGE1_AKK_VS_SM100 {err:.2e}")
    assert err <= AKK_TOL, err
