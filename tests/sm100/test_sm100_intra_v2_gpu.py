"""GPU: the opt-in chunk_intra v2 (forward/chunk_intra_v2.py, CULA_SM100_CHUNK_INTRA=v2) against the live kernel
(v1) and the fp32 reference's intermediates, on the shapes of test_sm100_forward_gpu.py's kernel tests, strong and
extreme decay, the public op with the switch on, and compute-sanitizer with the switch on.

What v2 must show before it replaces v1: Aqk and Akk within the reference tolerance (TOL, as v1), no less accurate
than v1 (to a margin), and within fp32 rounding of v1 (it reorders only the fp32 sums of the strong-decay diagonal
sub-blocks; with mild decay every product is the live one, so the outputs should be bitwise v1's: printed)."""

from __future__ import annotations

import pytest
import torch

from sm100_cases import TOL, flat, make_inputs, reference, rel_err, require_gpu, seqlens_to_cu
from test_sm100_forward_gpu import FIXED, VARLEN

pytestmark = pytest.mark.gpu

# v2 against v1: both round the same fp32 values to bf16 except where the fp32 sums of the diagonal sub-blocks
# differ in their last bits, which flips the bf16 rounding of a few elements (2^-8 relative each)
V1_TOL = 1e-3
# v2 no less accurate than v1: its error against the reference at most this factor (plus an absolute floor)
# above v1's
WORSE = 1.25


def _intra_both(q, k, v, g, beta, cu, cu_cpu, B, T):
    """Per output: (v1's and v2's rel. error vs the reference, v2 vs v1, bitwise equal), each fed the reference's G."""
    from cula_sm100.forward import launch

    scale = q.shape[-1] ** -0.5
    _, _, it = reference(q, k, v, g, beta, scale=scale, cu_seqlens=cu)
    ctab, _ = launch.tables(B, T, cu, cu_cpu, q.device)
    Gr = flat(it.g_cumsum).contiguous()
    out = {v: launch.chunk_intra(q, k, Gr, beta, ctab, scale=scale, beta_activation="none", variant=v)
           for v in ("v1", "v2")}
    errs = {}
    for i, name in enumerate(("Aqk", "Akk")):
        ref = flat(getattr(it, name))
        e1, e2 = rel_err(out["v1"][i], ref), rel_err(out["v2"][i], ref)
        d = rel_err(out["v2"][i], out["v1"][i])
        errs[name] = (e1, e2, d, torch.equal(out["v1"][i], out["v2"][i]))
    return errs


def _check(errs, label):
    print(f"\n{label}: " + " ".join(f"{n} v1={e1:.2e} v2={e2:.2e} v2-v1={d:.2e}{' (bitwise)' if eq else ''}"
                                    for n, (e1, e2, d, eq) in errs.items()))
    for name, (e1, e2, d, _) in errs.items():
        assert e2 < TOL[name], f"{name}: v2 rel err {e2:.3e} >= {TOL[name]:.0e}"
        assert e2 <= WORSE * e1 + 1e-4, f"{name}: v2 rel err {e2:.3e} vs v1 {e1:.3e}"
        assert d < V1_TOL, f"{name}: v2 vs v1 {d:.3e} >= {V1_TOL:.0e}"


@pytest.mark.parametrize("B,T,HQK,HV", FIXED)
def test_v2_fixed_length(B, T, HQK, HV):
    require_gpu()
    q, k, v, g, beta, _ = make_inputs(B, T, HQK, HV, seed=T + HV)
    _check(_intra_both(q, k, v, g, beta, None, None, B, T), f"{B=} {T=} {HQK=} {HV=}")


@pytest.mark.parametrize("lengths", VARLEN, ids=lambda x: f"{len(x)}seqs")
def test_v2_varlen(lengths):
    require_gpu()
    T = sum(lengths)
    cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 8, seed=len(lengths), N=len(lengths))
    _check(_intra_both(q, k, v, g, beta, cu, cu_cpu, 1, T), f"varlen {lengths}")


# odd T (1, 63, 65: rows past the chunk end), GVA 1 / 2 / 4, a varlen batch with a length-1 sequence, under decays
# that send every diagonal block (extreme) or most of them (strong) down v2's own fp32 sub-block path
DECAY_SHAPES = [(1, 1, 1, 1, None), (1, 63, 2, 4, None), (1, 65, 1, 4, None), (2, 130, 2, 2, None),
                (1, 300, 2, 4, None), (1, 0, 2, 8, [1, 64, 65, 7, 130])]


@pytest.mark.parametrize("decay", ["strong", "extreme"])
@pytest.mark.parametrize("B,T,HQK,HV,lengths", DECAY_SHAPES)
def test_v2_strong_decay(B, T, HQK, HV, lengths, decay):
    require_gpu()
    cu = cu_cpu = None
    if lengths is not None:
        T = sum(lengths)
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, _ = make_inputs(B, T, HQK, HV, seed=7 + T, decay=decay, N=len(lengths) if lengths else None)
    _check(_intra_both(q, k, v, g, beta, cu, cu_cpu, B, T), f"{decay} {B=} {T=} {HQK=} {HV=} {lengths=}")


def test_v2_gva_equals_expanded_qk_bitwise():
    """v2's native GVA (q/k at hv // group) gives bitwise what q/k expanded to HV heads give."""
    require_gpu()
    from cula_sm100.forward import launch

    cu, cu_cpu = seqlens_to_cu([1, 70, 200, 64])
    q, k, _, g, beta, _ = make_inputs(1, 335, 2, 8, seed=3, decay="strong", N=4)
    ctab, _ = launch.tables(1, 335, cu, cu_cpu, q.device)
    G = launch.gate_cumsum(g.reshape(-1, 8, 128), None, None, ctab, gate="precomputed", lower_bound=None)
    a = launch.chunk_intra(q, k, G, beta, ctab, scale=0.1, beta_activation="none", variant="v2")
    qe, ke = (x.repeat_interleave(4, dim=2).contiguous() for x in (q, k))
    b = launch.chunk_intra(qe, ke, G, beta, ctab, scale=0.1, beta_activation="none", variant="v2")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_public_op_with_v2(varlen, monkeypatch):
    """cula.chunk_kda on sm100 with CULA_SM100_CHUNK_INTRA=v2 (softplus gate strong enough for the fp32 sub-block
    path, q/k L2 norm, beta sigmoid, h0 and ht) against the reference backend, against the same call with v1,
    and against FLA 0.6.0 when installed."""
    require_gpu()
    import cula_core

    B, T, HQK, HV = (1, 333, 2, 4) if varlen else (2, 200, 2, 4)
    gen = torch.Generator(device="cuda").manual_seed(11)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q, k, v = (r(B, T, h, 128).bfloat16() for h in (HQK, HQK, HV))
    g = r(B, T, HV, 128)
    beta = torch.sigmoid(r(B, T, HV)).bfloat16()
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1)
    dt_bias = 0.1 * r(HV * 128)
    N = 4 if varlen else B
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, initial_state=0.1 * r(N, HV, 128, 128),
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    if varlen:
        kw["cu_seqlens"], kw["cu_seqlens_cpu"] = seqlens_to_cu([1, 64, 100, 168])

    def run(backend, variant):
        monkeypatch.setenv("CULA_BACKEND", backend)
        monkeypatch.setenv("CULA_SM100_CHUNK_INTRA", variant)
        return cula_core.chunk_kda(q, k, v, g, beta, **kw)

    o2, ht2 = run("sm100", "v2")
    o1, ht1 = run("sm100", "v1")
    o_ref, ht_ref = run("reference", "v1")
    e_o, e_ht = rel_err(o2, o_ref), rel_err(ht2, ht_ref)
    d_o, d_ht = rel_err(o2, o1), rel_err(ht2, ht1)
    line = f"\nvarlen={varlen}: v2 o={e_o:.2e} ht={e_ht:.2e} | v1 o={rel_err(o1, o_ref):.2e} | v2-v1 o={d_o:.2e}"
    assert e_o < TOL["o"] and e_ht < TOL["ht"], line
    assert d_o < 2 * V1_TOL and d_ht < 2 * V1_TOL, line
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        print(line + " (FLA not installed)")
        return
    fkw = dict(kw)
    if varlen:
        fkw["cu_seqlens"] = fkw["cu_seqlens"].long()
        fkw.pop("cu_seqlens_cpu")
    with torch.no_grad():
        o_f, _ = fla_chunk_kda(q, k, v, g, beta, **fkw)
    print(line + f" | FLA o={rel_err(o_f, o_ref):.2e} | v2 vs FLA o={rel_err(o2, o_f):.2e}")
    assert rel_err(o2, o_f) < TOL["o"]


def test_memcheck_v2_on_odd_shapes():
    """sm100_memcheck_case.py (the whole forward on odd shapes) under compute-sanitizer with the switch on."""
    import shutil

    from sm100_memcheck_case import run_under_memcheck

    require_gpu()
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    proc = run_under_memcheck(CULA_SM100_CHUNK_INTRA="v2")
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[:6000] + proc.stderr[-3000:]
    assert "chunk_intra v2" in proc.stdout, proc.stdout[:2000]
    assert "cases ok" in proc.stdout
    assert "ERROR SUMMARY: 0 errors" in proc.stdout
