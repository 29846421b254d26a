"""cula-sm100's opt-in one-pass preprocessing (chunk_intra_prep.py: gate + chunk cumsum + q/k L2 norm folded into
chunk_intra; `launch.forward(..., fused_prep=True)` or CULA_SM100_FUSED_PREP=1) against today's staged forward
(l2norm, gate_cumsum, chunk_intra in turn) and against the fp32 reference, on GVA 1 / 2 / 4, varlen with empty
and length-1 sequences, every gate mode. Written in session 3 of issue 7 with no GPU: compiled only until these
run."""

from __future__ import annotations

import pytest
import torch

from sm100_cases import TOL, flat, rel_err, require_gpu, seqlens_to_cu

pytestmark = pytest.mark.gpu

# (B, T, HQK, HV, sequence lengths or None): GVA 1 / 2 / 4, T = 1 and odd T, varlen with empty and length-1
SHAPES = [(2, 130, 2, 2, None), (1, 200, 2, 4, None), (1, 65, 1, 4, None), (1, 1, 1, 2, None),
          (1, 329, 2, 8, [5, 1, 63, 0, 64, 65, 130, 1])]
GATES = [("softplus", None), ("safe", -5.0), ("precomputed", None)]
# G of a raw gate: the kernel's exp / log1p against torch's in fp32 (precomputed g: TOL["g_cumsum"])
G_RAW_TOL = 1e-4


def _inputs(B, T, HQK, HV, lengths, gate, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q, k = r(B, T, HQK, 128).bfloat16(), r(B, T, HQK, 128).bfloat16()  # raw: the kernel normalises them
    v = r(B, T, HV, 128).bfloat16()
    g = r(B, T, HV, 128) if gate != "precomputed" else torch.nn.functional.logsigmoid(r(B, T, HV, 128)) / 8
    beta = r(B, T, HV).bfloat16()  # raw: beta_activation="sigmoid"
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1) if gate != "precomputed" else None
    dt_bias = 0.1 * r(HV * 128) if gate != "precomputed" else None
    N = len(lengths) if lengths else B
    h0 = 0.1 * r(N, HV, 128, 128)
    cu, cu_cpu = seqlens_to_cu(lengths) if lengths else (None, None)
    return q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu


def _close(name, ours, other, tol, errs):
    e = rel_err(ours, other)
    errs[name] = e
    assert e < tol, f"{name}: rel err {e:.3e} >= {tol:.0e}"


@pytest.mark.parametrize("gate,lower_bound", GATES, ids=[g for g, _ in GATES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}H{s[2]}x{s[3] // s[2]}"
                         + ("varlen" if s[4] else ""))
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_fused_prep_vs_staged_and_reference(shape, gate, lower_bound, l2norm):
    require_gpu()
    from cula_core.reference import l2norm as ref_l2norm
    from cula_core.reference.gates import activate_beta, log_decay
    from sm100_cases import reference

    from cula_sm100.forward import launch

    B, T, HQK, HV, lengths = shape
    q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu = _inputs(B, T, HQK, HV, lengths, gate, seed=T + HV)
    if not l2norm:
        q, k = (ref_l2norm(x.float()).bfloat16() for x in (q, k))
    scale = 128 ** -0.5
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, gate=gate,
              lower_bound=lower_bound, beta_activation="sigmoid")
    o_s, ht_s, it_s = launch.forward(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, fused_prep=False, **kw)
    o_f, ht_f, it_f = launch.forward(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, fused_prep=True, **kw)

    # the fp32 reference on the same inputs (q / k normalised in fp32, the gate and beta activation in torch)
    qr, kr = (ref_l2norm(x.float()) for x in (q, k)) if l2norm else (q, k)
    graw = log_decay(g.float(), A_log, dt_bias, gate, lower_bound)
    o_ref, ht_ref, it = reference(qr, kr, v, graw, activate_beta(beta.float(), "sigmoid"), scale=scale,
                                  initial_state=h0, cu_seqlens=cu)

    errs = {}
    # the pieces the fused kernel computes: against the staged kernels (same arithmetic) and the reference
    _close("G vs staged", it_f.g_cumsum, it_s.g_cumsum, 1e-6, errs)
    _close("G", it_f.g_cumsum, flat(it.g_cumsum), TOL["g_cumsum"] if gate == "precomputed" else G_RAW_TOL, errs)
    for name in ("q", "k"):
        # the staged l2norm's arithmetic: equal up to a rare bf16 rounding flip; not normalising returns the input
        _close(f"{name} vs staged", getattr(it_f, name), getattr(it_s, name), 2e-3, errs)
    _close("q", it_f.q, flat(qr), 1e-2, errs)
    for name in ("Aqk", "Akk"):
        _close(f"{name} vs staged", getattr(it_f, name), getattr(it_s, name), TOL[name] / 4, errs)
        _close(name, getattr(it_f, name), flat(getattr(it, name)), TOL[name], errs)
    _close("o vs staged", o_f, o_s, TOL["o"] / 4, errs)
    _close("o", o_f, o_ref, TOL["o"], errs)
    _close("ht vs staged", ht_f, ht_s, TOL["ht"] / 4, errs)
    _close("ht", ht_f, ht_ref, TOL["ht"], errs)
    bitwise = {n: torch.equal(getattr(it_f, n), getattr(it_s, n)) for n in ("g_cumsum", "q", "k", "Aqk", "Akk")}
    print(f"\n{shape} {gate} l2norm={l2norm}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
          + f" | bitwise equal to staged: {bitwise}")


def test_env_var_selects_fused_prep_in_public_op(monkeypatch):
    """CULA_SM100_FUSED_PREP=1 through cula.chunk_kda (CULA_BACKEND=sm100), raw softplus gate, q/k L2 norm, varlen:
    within the reference backend's tolerance, and the same as with the variable unset to the staged tolerance."""
    require_gpu()
    import cula_core

    q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu = _inputs(1, 329, 2, 8, [5, 1, 63, 0, 64, 65, 130, 1],
                                                                "softplus", seed=7)
    beta = torch.sigmoid(beta.float()).bfloat16()
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    monkeypatch.setenv("CULA_BACKEND", "sm100")
    monkeypatch.delenv("CULA_SM100_FUSED_PREP", raising=False)
    o_s, ht_s = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    monkeypatch.setenv("CULA_SM100_FUSED_PREP", "1")
    o_f, ht_f = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_r, ht_r = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    assert rel_err(o_f, o_r) < TOL["o"] and rel_err(ht_f, ht_r) < TOL["ht"]
    assert rel_err(o_f, o_s) < TOL["o"] / 4 and rel_err(ht_f, ht_s) < TOL["ht"] / 4
