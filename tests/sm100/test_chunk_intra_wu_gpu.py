"""GPU: the fused chunk_intra + recompute_w_u kernel (chunk_intra_wu.py, through launch.chunk_intra_wu: the forward's
stage) against its oracle, the two-kernel path (launch.chunk_intra, then launch.recompute_w_u on its Akk) on the
same inputs, against the fp32 reference's intermediates and against FLA 0.6.0; and its memcheck run on odd shapes.

Tolerances against the two-kernel path:
  * Aqk, Akk: bitwise. The fused kernel runs chunk_intra's arithmetic step for step (Aqk is rounded to bf16 from
    the same fp32 value, earlier);
  * w, u, kg: at most 1 bf16 ulp apart element by element (and the count of differing elements is printed).
    kg and the beta-scaled operands use recompute_w_u's expressions, and the w / u GEMMs take the same bf16
    operands through the same MMA instruction over the same k-block order, so bitwise is expected; 1 ulp is what
    a different fp32 contraction by the compiler (an FMA in place of a multiply and an add) could change at a
    rounding boundary, and nothing else could: a wrong row, column, operand or scale is many ulps off.
Against the reference: the relative-error bounds of the existing kernel tests (sm100_cases.TOL); against FLA
0.6.0's chunk_kda_fwd_intra on the same inputs: twice those (each side is within TOL of the reference).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from sm100_cases import TOL, flat, make_inputs, reference, rel_err, require_gpu, seqlens_to_cu

pytestmark = pytest.mark.gpu

# the shapes of test_sm100_forward_gpu.py's kernel tests
FIXED = [(1, 1, 2, 4), (1, 63, 2, 4), (2, 64, 2, 4), (1, 65, 2, 4), (2, 500, 2, 4), (1, 1000, 2, 4)] + [
    (1, 130, hqk, hqk * r) for hqk in (1, 2, 4, 16) for r in (1, 2, 4)]
VARLEN = [[1, 100, 64], [17, 1, 64, 65, 200], [5, 1, 63, 64, 65, 130, 0, 7, 300, 20]]
DECAY_SHAPES = [(1, 1, 1, 1, None), (1, 63, 2, 4, None), (1, 65, 1, 4, None), (2, 130, 2, 2, None),
                (1, 300, 2, 4, None), (1, 0, 2, 8, [1, 64, 65, 7, 130])]


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance of two bf16 tensors in units in the last place (bit patterns mapped to a monotonic
    integer line, so -0 and +0 are 0 apart and adjacent values 1)."""
    def line(x):
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (line(a) - line(b)).abs()


def _run(q, k, v, g, beta, cu, cu_cpu, B, T, beta_activation):
    from cula_sm100.forward import launch

    HV = v.shape[2]
    scale = q.shape[-1] ** -0.5
    beta_ref = torch.sigmoid(beta.float()) if beta_activation == "sigmoid" else beta
    _, _, it = reference(q, k, v, g, beta_ref, scale=scale, cu_seqlens=cu)
    ctab, _ = launch.tables(B, T, cu, cu_cpu, q.device)
    G = flat(it.g_cumsum).contiguous()
    kw = dict(beta_activation=beta_activation)
    Aqk2, Akk2 = launch.chunk_intra(q, k, G, beta, ctab, scale=scale, **kw)
    w2, u2, kg2 = launch.recompute_w_u(k, v, G, beta, Akk2, ctab, **kw)
    fused = launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=scale, **kw)
    torch.cuda.synchronize()
    names = ("Aqk", "Akk", "w", "u", "kg")
    report = []
    for name, ours, two in zip(names, fused, (Aqk2, Akk2, w2, u2, kg2), strict=True):
        assert ours.shape == two.shape and ours.dtype == torch.bfloat16, (name, ours.shape, two.shape)
        assert torch.isfinite(ours).all(), name
        ulps = bf16_ulps(ours, two)
        worst = int(ulps.max()) if ulps.numel() else 0
        report.append(f"{name}: {int((ulps > 0).sum())} of {ulps.numel()} differ, max {worst} ulp")
        if name in ("Aqk", "Akk"):
            assert torch.equal(ours, two), f"{name} is not bitwise the two-kernel path's: " + report[-1]
        else:
            assert worst <= 1, report[-1]
        e = rel_err(ours, flat(getattr(it, name)))
        report[-1] += f", rel err vs reference {e:.2e}"
        assert e < TOL[name], f"{name}: rel err {e:.3e} >= {TOL[name]:.0e} against the reference"
    print(f"\n{B=} {T=} HQK={q.shape[2]} {HV=} varlen={cu is not None} beta={beta_activation}: " + "; ".join(report))


@pytest.mark.parametrize("beta_activation", ["none", "sigmoid"])
@pytest.mark.parametrize("B,T,HQK,HV", FIXED)
def test_fused_fixed_length(B, T, HQK, HV, beta_activation):
    require_gpu()
    q, k, v, g, beta, _ = make_inputs(B, T, HQK, HV, seed=T + HV)
    _run(q, k, v, g, beta, None, None, B, T, beta_activation)


@pytest.mark.parametrize("beta_activation", ["none", "sigmoid"])
@pytest.mark.parametrize("lengths", VARLEN, ids=lambda x: f"{len(x)}seqs")
def test_fused_varlen(lengths, beta_activation):
    require_gpu()
    T = sum(lengths)
    cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 8, seed=len(lengths), N=len(lengths))
    _run(q, k, v, g, beta, cu, cu_cpu, 1, T, beta_activation)


@pytest.mark.parametrize("decay", ["strong", "extreme"])
@pytest.mark.parametrize("B,T,HQK,HV,lengths", DECAY_SHAPES)
def test_fused_strong_decay(B, T, HQK, HV, lengths, decay):
    """Decays down to -5 per token (diagonal blocks by GEMM or by the fp32 sub-block path, block by block) and
    down to -30 (the fp32 path everywhere; e^G underflows to 0 in w's operand, as in recompute_w_u)."""
    require_gpu()
    cu = cu_cpu = None
    if lengths is not None:
        T = sum(lengths)
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, _ = make_inputs(B, T, HQK, HV, seed=7 + T, decay=decay, N=len(lengths) if lengths else None)
    _run(q, k, v, g, beta, cu, cu_cpu, B, T, "none")


@pytest.mark.parametrize("B,T,HQK,HV,lengths", [(2, 500, 2, 4, None), (1, 130, 16, 64, None),
                                                (1, 0, 2, 8, [17, 1, 64, 65, 200])])
def test_fused_vs_fla(B, T, HQK, HV, lengths):
    """The five outputs against FLA 0.6.0's chunk_kda_fwd_intra (its intra kernels and its recompute_w_u) on the
    same inputs (G in FLA's log2 units): each of the two is within TOL of the fp32 reference, so they are within
    2 TOL of each other."""
    require_gpu()
    fla_intra = pytest.importorskip("fla.ops.kda.chunk_intra").chunk_kda_fwd_intra
    from cula_sm100.forward import launch

    cu = cu_cpu = None
    if lengths is not None:
        T = sum(lengths)
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, _ = make_inputs(B, T, HQK, HV, seed=11 + T, N=len(lengths) if lengths else None)
    scale = q.shape[-1] ** -0.5
    ctab, _ = launch.tables(B, T, cu, cu_cpu, q.device)
    G = launch.gate_cumsum(flat(g).contiguous(), None, None, ctab, gate="precomputed", lower_bound=None)
    ours = launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=scale, beta_activation="none")
    w, u, _, kg, Aqk, Akk = fla_intra(q=q, k=k, v=v, gk=G.reshape(B, T, HV, -1) / math.log(2), beta=beta,
                                      scale=scale, cu_seqlens=cu.long() if cu is not None else None, chunk_size=64)
    # FLA allocates Aqk with torch.empty and writes only its causal part (key j <= query i inside the chunk): the
    # rest is whatever the allocator held, so both sides are compared there only (ours writes zeros above it)
    first, length = ctab[:, 0].long(), ctab[:, 1].long()
    local = torch.zeros(ours[0].shape[0], dtype=torch.long, device=q.device)
    for c in range(ctab.shape[0]):  # position of each token inside its chunk
        local[first[c]:first[c] + length[c]] = torch.arange(int(length[c]), device=q.device)
    causal = (torch.arange(64, device=q.device)[None, :] <= local[:, None])[:, None, :]
    Aqk = torch.where(causal, flat(Aqk), 0).reshape(Aqk.shape)
    assert torch.equal(torch.where(causal, ours[0], 0), ours[0]), "ours wrote Aqk above the diagonal"
    errs = {}
    for name, a, b in zip(("Aqk", "Akk", "w", "u", "kg"), ours, (Aqk, Akk, w, u, kg), strict=True):
        errs[name] = rel_err(a, flat(b))
        assert errs[name] < 2 * TOL[name], f"{name}: rel diff {errs[name]:.3e} vs FLA >= {2 * TOL[name]:.0e}"
    print(f"\n{B=} {T=} {HQK=} {HV=} vs FLA: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))


def test_fused_no_chunks():
    """An all-empty varlen batch: no chunk, nothing launched, outputs of 0 rows."""
    require_gpu()
    from cula_sm100.forward import launch

    cu, cu_cpu = seqlens_to_cu([0, 0])
    q, k, v, _, beta, _ = make_inputs(1, 0, 1, 2, N=2)
    ctab, _ = launch.tables(1, 0, cu, cu_cpu, q.device)
    G = torch.zeros(0, 2, 128, device="cuda")
    outs = launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=0.1, beta_activation="none")
    assert [tuple(o.shape) for o in outs] == [(0, 2, 64), (0, 2, 64), (0, 2, 128), (0, 2, 128), (0, 2, 128)]


def test_fused_memcheck_clean_on_odd_shapes():
    """compute-sanitizer memcheck over chunk_intra_wu_memcheck_case.py (T = 1, 65, varlen with empty and length-1
    sequences, GVA, extreme decay): no out-of-bounds or misaligned access."""
    require_gpu()
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    from chunk_intra_wu_memcheck_case import run_under_memcheck

    proc = run_under_memcheck()
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[:6000] + proc.stderr[-3000:]
    assert "cases ok" in proc.stdout
    assert "ERROR SUMMARY: 0 errors" in proc.stdout
