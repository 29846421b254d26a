"""GPU: chunk_intra_wu_gate (the raw gate's gate, chunk-local cumsum and chunk_intra_wu in one kernel, through
launch.chunk_intra_wu_gate: the forward's gate stage) against its oracle, launch.gate_cumsum then
launch.chunk_intra_wu on the same inputs: G, Aqk, Akk, w, u and kg BITWISE equal (the kernel runs gate_cumsum's gate
code in gate_cumsum's summation order, then chunk_intra_wu's code on the same G), in every gate mode, fp32 and bf16 g,
with and without A_log / dt_bias, T = 1, 63, 64, 65, 500 (GVA 2), GVA 1 / 2 / 4 and varlen batches with empty and
length-1 sequences; the whole forward against the same forward composed with the two kernels (every intermediate, o
and the final state bitwise);
and a compute-sanitizer memcheck run on odd shapes.

    pytest -m gpu tests/sm100/test_chunk_intra_wu_gate_gpu.py
    python tests/sm100/test_chunk_intra_wu_gate_gpu.py        # the memcheck cases alone (prints "cases ok")
"""

from __future__ import annotations

import pytest
import torch

from sm100_cases import flat, make_inputs, require_gpu, seqlens_to_cu

pytestmark = pytest.mark.gpu

HV_GVA2 = 4
# (gate, has A_log, has dt_bias, lower_bound)
GATES = [("softplus", True, True, None), ("softplus", False, False, None), ("softplus", True, False, None),
         ("safe", True, True, -5.0), ("safe", False, True, -3.0), ("precomputed", False, False, None)]
G_DTYPES = [torch.float32, torch.bfloat16]
# (B, T, HQK, HV, varlen lengths or None)
SHAPES = [(1, 1, 2, 4, None), (1, 63, 2, 4, None), (2, 64, 2, 4, None), (1, 65, 2, 4, None), (2, 500, 2, 4, None),
          (1, 130, 4, 4, None), (1, 130, 1, 4, None), (1, 0, 2, 8, [5, 1, 0, 64, 65, 130, 0, 7, 63])]


def gate_inputs(B, T, HV, gate, has_A, has_b, g_dtype, seed):
    """Raw g [B, T, HV, 128] in g_dtype (a log decay <= 0 for the precomputed gate; N(-2, 3) for the others, so
    e^z < 2^-6 and z > 20 both occur), A_log [HV] and dt_bias [HV 128] fp32 or None."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if gate == "precomputed":
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, 128, generator=gen, device="cuda")) / 8
    else:
        g = 3 * torch.randn(B, T, HV, 128, generator=gen, device="cuda") - 2
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1) if has_A else None
    dt_bias = 0.1 * torch.randn(HV * 128, generator=gen, device="cuda") if has_b else None
    return g.to(g_dtype), A_log, dt_bias


def both_paths(q, k, v, g, A_log, dt_bias, beta, ctab, *, gate, lower_bound, beta_activation="none"):
    """(fused outputs, oracle outputs), each (G, Aqk, Akk, w, u, kg)."""
    from cula_sm100.forward import launch

    HV = v.shape[-2]
    g = g.reshape(-1, HV, 128)
    scale = 128 ** -0.5
    kw = dict(scale=scale, beta_activation=beta_activation)
    fused = launch.chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, gate=gate, lower_bound=lower_bound,
                                       **kw)
    G = launch.gate_cumsum(g, A_log, dt_bias, ctab, gate=gate, lower_bound=lower_bound)
    oracle = (G, *launch.chunk_intra_wu(q, k, v, G, beta, ctab, **kw))
    return fused, oracle


def assert_bitwise(fused, oracle, label):
    for name, a, b in zip(("G", "Aqk", "Akk", "w", "u", "kg"), fused, oracle, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (label, name, a.shape, b.shape)
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs()
            raise AssertionError(f"{label}: {name} not bitwise the two-kernel path's: {int((diff > 0).sum())} of "
                                 f"{a.numel()} differ, max |diff| {float(diff.max()):.3e}")
    assert torch.isfinite(fused[0]).all(), label


def _case(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, g_dtype, beta_activation="none", seed=0):
    from cula_sm100.forward import launch

    cu = cu_cpu = None
    if lengths is not None:
        T = sum(lengths)
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, _, beta, _ = make_inputs(B, T, HQK, HV, seed=seed + T, N=len(lengths) if lengths else None)
    g, A_log, dt_bias = gate_inputs(B, T, HV, gate, has_A, has_b, g_dtype, seed + T + 1)
    ctab, _ = launch.tables(B, T, cu, cu_cpu, q.device)
    fused, oracle = both_paths(q, k, v, g, A_log, dt_bias, beta, ctab, gate=gate, lower_bound=lb,
                               beta_activation=beta_activation)
    return fused, oracle


@pytest.mark.parametrize("g_dtype", G_DTYPES, ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("gate,has_A,has_b,lb", GATES, ids=lambda x: str(x))
@pytest.mark.parametrize("B,T,HQK,HV,lengths", SHAPES, ids=lambda x: str(x))
def test_gate_fused_bitwise(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, g_dtype):
    require_gpu()
    fused, oracle = _case(B, T, HQK, HV, lengths, gate, has_A, has_b, lb, g_dtype)
    torch.cuda.synchronize()
    assert_bitwise(fused, oracle, f"{B=} {T=} {HQK=} {HV=} {lengths=} {gate} A={has_A} b={has_b} {g_dtype}")


@pytest.mark.parametrize("beta_activation", ["sigmoid", "2sigmoid"])
def test_gate_fused_beta_activation(beta_activation):
    """beta activations (a compile key of the kernel): fp32 beta values through the activation, varlen."""
    require_gpu()
    fused, oracle = _case(1, 0, 2, 8, [1, 64, 65, 0, 200], "softplus", True, True, None, torch.float32,
                          beta_activation=beta_activation, seed=3)
    torch.cuda.synchronize()
    assert_bitwise(fused, oracle, beta_activation)


@pytest.mark.parametrize("gate,lengths", [("softplus", None), ("safe", [17, 1, 0, 64, 65, 200])])
def test_forward_equals_the_two_kernel_gate_path_bitwise(gate, lengths):
    """launch.forward (its gate stage chunk_intra_wu_gate) against the same forward composed by hand with
    gate_cumsum then chunk_intra_wu (the backward's recompute path): o, the final state and every intermediate
    bitwise equal (q/k L2 norm in kernel, initial and final state, raw gate with A_log and dt_bias)."""
    require_gpu()
    from cula_sm100.forward import launch

    B, T, HQK, HV = (2, 300, 2, 4) if lengths is None else (1, sum(lengths), 2, 8)
    cu = cu_cpu = None
    if lengths is not None:
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, _, beta, h0 = make_inputs(B, T, HQK, HV, seed=5, h0=True, N=len(lengths) if lengths else None)
    g, A_log, dt_bias = gate_inputs(B, T, HV, gate, True, True, torch.float32, 6)
    scale, lb = 128 ** -0.5, (-5.0 if gate == "safe" else None)
    o1, ht1, it1 = launch.forward(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale=scale,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True, gate=gate, lower_bound=lb,
                                  beta_activation="sigmoid")
    ctab, stab = launch.tables(B, T, cu, cu_cpu, q.device)
    qn, kn = launch.l2norm(q), launch.l2norm(k)
    G = launch.gate_cumsum(g.reshape(B * T, HV, 128), A_log, dt_bias, ctab, gate=gate, lower_bound=lb)
    Aqk, Akk, w, u, kg = launch.chunk_intra_wu(qn, kn, v, G, beta, ctab, scale=scale, beta_activation="sigmoid")
    h, v_new, ht2 = launch.chunk_delta_h(w, u, kg, G, h0, ctab, stab, output_final_state=True)
    o2 = launch.fwd_o(qn, G, h, Aqk, v_new, ctab, scale=scale).reshape(o1.shape)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    it2 = dict(g_cumsum=G, Aqk=Aqk, Akk=Akk, w=w, u=u, kg=kg, h=h, v_new=v_new)
    for name, want in it2.items():
        assert torch.equal(getattr(it1, name), want), name


def test_gate_fused_no_chunks():
    """An all-empty varlen batch: no chunk, nothing launched, outputs of 0 rows."""
    require_gpu()
    from cula_sm100.forward import launch

    cu, cu_cpu = seqlens_to_cu([0, 0])
    q, k, v, g, beta, _ = make_inputs(1, 0, 1, 2, N=2)
    ctab, _ = launch.tables(1, 0, cu, cu_cpu, q.device)
    outs = launch.chunk_intra_wu_gate(q, k, v, flat(g), None, None, beta, ctab, gate="precomputed", lower_bound=None,
                                      scale=0.1, beta_activation="none")
    assert [tuple(o.shape) for o in outs] == [(0, 2, 128), (0, 2, 64), (0, 2, 64)] + [(0, 2, 128)] * 3


def test_gate_fused_memcheck_clean_on_odd_shapes():
    """compute-sanitizer memcheck over memcheck_cases() (this file run as a script): T = 1, 63, 65, GVA 1 / 2 / 4,
    every gate mode, fp32 and bf16 g, varlen with empty and length-1 sequences: no out-of-bounds or misaligned
    access (rows past a chunk's end neither read nor written)."""
    require_gpu()
    from chunk_intra_wu_memcheck_case import assert_memcheck_clean

    assert_memcheck_clean(__file__)


def memcheck_cases():
    """The odd shapes of the memcheck run (the fused kernel and its oracle both run; nothing compared here)."""
    n = 0
    shapes = [(1, 1, 1, 1, None), (1, 63, 2, 4, None), (1, 65, 1, 4, None), (2, 65, 2, 2, None),
              (1, 0, 2, 8, [0, 1, 63, 0, 65, 1])]
    for i, shape in enumerate(shapes):
        for j, gate_case in enumerate(GATES):
            _case(*shape, *gate_case, G_DTYPES[(i + j) % 2], seed=i)
            n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    memcheck_cases()
