"""GPU: the qg path of the sm100 forward (forward(intermediates=False), chunk_kda's call):
chunk_intra_wu_gate with qg_out writes qg = bf16(q e^G) and G only at each chunk's last row; chunk_delta_h reads those
rows; fwd_o with qg_in reads qg instead of q and G.

  * o and the final state of forward(intermediates=False) BITWISE those of forward(intermediates=True) (the kernels
    form qg with one expression, cute_utils.scale_by_exp, from the same bits), and Aqk, Akk, w, u, kg, h, v_new
    bitwise too: softplus / safe / precomputed gates, T = 1, 63, 64, 65, 500, GVA 1 / 2 / 4, a varlen batch with
    empty and length-1 sequences, with and without an initial state (final state always asked);
  * qg against bf16(q torch.exp(G)) formed in torch from the plain path's q and G: within 1 bf16 ulp, not bitwise,
    because the kernels' exp is the fastmath one (ex2.approx.ftz of G log2(e)), not torch.exp; below 2^-126 (where
    ex2.approx.ftz flushes what torch.exp keeps as a subnormal) any two values count as equal;
  * G at each chunk's last row: bitwise the plain kernel's, and chunk_delta_h reads nothing else (every other row
    of the buffer set to NaN: o and the final state unchanged, bitwise);
  * compute-sanitizer memcheck on odd shapes (this file run as a script).

    pytest -m gpu tests/sm100/test_fused_qg_gpu.py
    python tests/sm100/test_fused_qg_gpu.py        # the memcheck cases alone (prints "cases ok")
"""

from __future__ import annotations

import pytest
import torch

from sm100_cases import make_inputs, require_gpu, seqlens_to_cu
from test_chunk_intra_wu_gate_gpu import gate_inputs

pytestmark = pytest.mark.gpu

# (gate, has A_log, has dt_bias, lower_bound)
GATES = [("softplus", True, True, None), ("safe", False, True, -5.0), ("precomputed", False, False, None)]
# (B, T, HQK, HV, varlen lengths or None)
SHAPES = [(1, 1, 2, 4, None), (1, 63, 2, 4, None), (2, 64, 2, 4, None), (1, 65, 2, 4, None), (2, 500, 2, 4, None),
          (1, 130, 4, 4, None), (1, 130, 1, 4, None), (1, 0, 2, 8, [5, 1, 0, 64, 65, 130, 0, 7, 63])]
INTERMEDIATES = ("Aqk", "Akk", "w", "u", "kg", "h", "v_new")


def problem(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, *, h0=True, seed=0):
    """(forward's positional inputs, its keyword arguments, chunk table)."""
    from cula_sm100.forward import launch

    cu = cu_cpu = None
    if lengths is not None:
        T = sum(lengths)
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, _, beta, state = make_inputs(B, T, HQK, HV, seed=seed + T, h0=h0, N=len(lengths) if lengths else None)
    g, A_log, dt_bias = gate_inputs(B, T, HV, gate, has_A, has_b, torch.float32, seed + T + 1)
    args = (q, k, v, g, beta, A_log, dt_bias, state, cu, cu_cpu)
    kw = dict(scale=128 ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, gate=gate, lower_bound=lb,
              beta_activation="sigmoid")
    return args, kw, launch.tables(B, T, cu, cu_cpu, q.device)[0]


def assert_equal(a, b, label):
    assert a.shape == b.shape and a.dtype == b.dtype, (label, a.shape, b.shape, a.dtype, b.dtype)
    if not torch.equal(a, b):
        diff = (a.float() - b.float()).abs()
        raise AssertionError(f"{label}: not bitwise equal: {int((diff > 0).sum())} of {a.numel()} differ, max |diff| "
                             f"{float(diff.max()):.3e}")


def ordered(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as integers in value order (one step = one ulp; +0 and -0 both 0)."""
    i = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def assert_within_one_ulp(ours, ref, label):
    """|ours - ref| <= 1 bf16 ulp elementwise; pairs both below 2^-126 in magnitude pass (ftz, see the docstring)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == torch.bfloat16, label
    tiny = (ours.float().abs() < 2.0 ** -126) & (ref.float().abs() < 2.0 ** -126)
    bad = ((ordered(ours) - ordered(ref)).abs() > 1) & ~tiny
    assert torch.isfinite(ours).all(), label
    assert not bad.any(), (f"{label}: {int(bad.sum())} of {ours.numel()} beyond 1 ulp, e.g. ours "
                           f"{ours[bad][:4].tolist()} torch {ref[bad][:4].tolist()}")


def torch_qg(q, G):
    """bf16(q e^G) with torch.exp, q [TT, HQK, K] at value head hv // (HV / HQK), G [TT, HV, K] fp32."""
    HQK, HV = q.shape[1], G.shape[1]
    return (q.float().repeat_interleave(HV // HQK, dim=1) * torch.exp(G)).to(torch.bfloat16)


def last_rows(ctab):
    """The token index of every chunk's last row (what ChunkDeltaH.last_g reads: t0 + min(eos - t0, 64) - 1)."""
    c = ctab.long()
    return c[:, 0] + c[:, 1] - 1


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("gate,has_A,has_b,lb", GATES, ids=lambda x: str(x))
@pytest.mark.parametrize("B,T,HQK,HV,lengths", SHAPES, ids=lambda x: str(x))
def test_forward_qg_path_bitwise(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, with_h0):
    require_gpu()
    from cula_sm100.forward import launch

    args, kw, _ = problem(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, h0=with_h0)
    o1, ht1, it1 = launch.forward(*args, **kw, intermediates=True)
    o2, ht2, it2 = launch.forward(*args, **kw, intermediates=False)
    torch.cuda.synchronize()
    label = f"{B=} {T=} {HQK=} {HV=} {lengths=} {gate} h0={with_h0}"
    assert it1.qg is None and it2.g_cumsum is None and it2.qg is not None, label
    assert_equal(o2, o1, f"{label}: o")
    assert_equal(ht2, ht1, f"{label}: final state")
    for name in INTERMEDIATES:
        assert_equal(getattr(it2, name), getattr(it1, name), f"{label}: {name}")
    assert torch.isfinite(o2).all(), label
    assert_within_one_ulp(it2.qg, torch_qg(it1.q, it1.g_cumsum), f"{label}: qg")


@pytest.mark.parametrize("gate,has_A,has_b,lb", GATES, ids=lambda x: str(x))
@pytest.mark.parametrize("B,T,HQK,HV,lengths", [SHAPES[3], SHAPES[4], SHAPES[6], SHAPES[7]], ids=lambda x: str(x))
def test_stage_last_rows_of_G(B, T, HQK, HV, lengths, gate, has_A, has_b, lb):
    """launch.chunk_intra_wu_gate with qg_out against without, on the same inputs: G bitwise at every chunk's last
    row, Aqk / Akk / w / u / kg bitwise; then with every other row of its G set to NaN, chunk_delta_h and fwd_o_qg
    give bitwise the plain stages' h, v_new, final state and o (chunk_delta_h reads the last rows alone)."""
    require_gpu()
    from cula_sm100.forward import launch

    args, kw, ctab = problem(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, seed=7)
    q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu = args
    stab = launch.tables(q.shape[0], q.shape[1], cu, cu_cpu, q.device)[1]
    q, k = launch.l2norm(q), launch.l2norm(k)
    g = g.reshape(-1, HV, 128)
    st = dict(gate=gate, lower_bound=lb, scale=kw["scale"], beta_activation=kw["beta_activation"])
    G, *five = launch.chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, **st)
    Gl, qg, *five_qg = launch.chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, qg_out=True, **st)
    rows = last_rows(ctab)
    torch.cuda.synchronize()
    assert_equal(Gl[rows], G[rows], "G at the chunks' last rows")
    for name, a, b in zip(("Aqk", "Akk", "w", "u", "kg"), five_qg, five, strict=True):
        assert_equal(a, b, name)
    keep = torch.zeros(Gl.shape[0], dtype=torch.bool, device=Gl.device)
    keep[rows] = True
    Gl[~keep] = float("nan")
    Aqk, _, w, u, kg = five
    h1, vn1, ht1 = launch.chunk_delta_h(w, u, kg, G, h0, ctab, stab, output_final_state=True)
    h2, vn2, ht2 = launch.chunk_delta_h(w, u, kg, Gl, h0, ctab, stab, output_final_state=True)
    o1 = launch.fwd_o(q.reshape(-1, HQK, 128), G, h1, Aqk, vn1, ctab, scale=kw["scale"])
    o2 = launch.fwd_o_qg(qg, h2, Aqk, vn2, ctab, scale=kw["scale"])
    torch.cuda.synchronize()
    for name, a, b in (("h", h2, h1), ("v_new", vn2, vn1), ("final state", ht2, ht1), ("o", o2, o1)):
        assert_equal(a, b, name)


def test_chunk_kda_takes_the_qg_path():
    """chunk_kda (intermediates=False inside) gives bitwise forward(intermediates=True)'s o and final state, and its
    residuals are that forward's Aqk / Akk."""
    require_gpu()
    from cula_sm100.forward import launch

    args, kw, _ = problem(2, 300, 2, 4, None, "softplus", True, True, None, seed=11)
    o1, ht1, it1 = launch.forward(*args, **kw)
    o2, ht2, (r_qk, r_kk) = launch.chunk_kda(*args, **kw, save_residuals=True)
    torch.cuda.synchronize()
    assert_equal(o2, o1, "o")
    assert_equal(ht2, ht1, "final state")
    assert_equal(r_qk.reshape(it1.Aqk.shape), it1.Aqk, "Aqk")
    assert_equal(r_kk.reshape(it1.Akk.shape), it1.Akk, "Akk")


def test_fused_qg_memcheck_clean_on_odd_shapes():
    """compute-sanitizer memcheck over memcheck_cases() (this file run as a script): the qg path's kernels on T = 1,
    63, 65, GVA 1 / 2 / 4, every gate mode, varlen with empty and length-1 sequences: no out-of-bounds or misaligned
    access (rows past a chunk's end neither read nor written)."""
    require_gpu()
    from chunk_intra_wu_memcheck_case import assert_memcheck_clean

    assert_memcheck_clean(__file__)


def memcheck_cases():
    """The odd shapes of the memcheck run: forward(intermediates=False) (nothing compared here)."""
    from cula_sm100.forward import launch

    n = 0
    shapes = [(1, 1, 1, 1, None), (1, 63, 2, 4, None), (1, 65, 1, 4, None), (2, 65, 2, 2, None),
              (1, 0, 2, 8, [0, 1, 63, 0, 65, 1])]
    for i, shape in enumerate(shapes):
        for j, gate_case in enumerate(GATES):
            args, kw, _ = problem(*shape, *gate_case, h0=(i + j) % 2 == 0, seed=i)
            launch.forward(*args, **kw, intermediates=False)
            n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    memcheck_cases()
