"""CPU: the qg path of the sm100 forward (forward(intermediates=False)): chunk_intra_wu_gate with
qg_out writes qg = bf16(q e^G) and G only at each chunk's last row, fwd_o with qg_in reads qg. Here, with kernels and
launches stubbed (nothing runs): the wrappers' buffers, arguments and compile keys, the forward's choice of stages
(qg path exactly with intermediates=False; Intermediates.g_cumsum None and .qg set there),
and chunk_kda asking for no intermediates. Both kernels compile for sm_90a / sm_100a in test_sm100_compile.py
(sm100_compile_check.py's "chunk_intra_wu_gate[softplus, qg_out]" and "fwd_o[qg_in]"), two more gate keys with
qg_out in test_chunk_intra_wu_cpu.py, their launches' binding in test_runtime_cpu.py. On the GPU:
test_fused_qg_gpu.py."""

from __future__ import annotations

import pytest
import torch

from test_chunk_intra_wu_cpu import _stage_inputs, _stub_launches

bf, f32 = torch.bfloat16, torch.float32


def test_gate_wrapper_qg_out(monkeypatch):
    """chunk_intra_wu_gate(qg_out=True): (G fp32, qg bf16 [TT, HV, 128], Aqk, Akk, w, u, kg); qg is the kernel's
    last pointer (after the chunk table), the compile key ends in qg_out = True, the dtypes are the plain ones."""
    from cula_sm100.forward import launch

    calls = _stub_launches(monkeypatch, launch, "intra_wu_gate_kernel")
    TT, HQK, HV, q, k, v, ctab = _stage_inputs()
    g = torch.zeros(TT, HV, 128)
    beta = torch.zeros(TT, HV, dtype=bf)
    outs = launch.chunk_intra_wu_gate(q, k, v, g, None, None, beta, ctab, gate="precomputed", lower_bound=None,
                                      scale=0.5, beta_activation="none", qg_out=True)
    assert [tuple(o.shape) for o in outs] == [(TT, HV, 128)] * 2 + [(TT, HV, 64)] * 2 + [(TT, HV, 128)] * 3
    assert [o.dtype for o in outs] == [f32] + [bf] * 6
    (kern, dtypes, tensors, scalars), = calls
    assert kern == ("kernel", "precomputed", f32, f32, f32, False, False, None, bf, "none", True)
    assert dtypes == launch.intra_wu_gate_dtypes(f32, f32, f32, bf) and len(dtypes) == len(tensors) == 15
    assert tensors[6] is outs[0] and tensors[14] is outs[1] and tensors[13] is ctab
    assert all(a is b for a, b in zip(tensors[8:13], outs[2:], strict=True))
    assert [None if t is None else t.dtype for t in tensors] == [None if t is None else d
                                                                 for t, d in zip(tensors, dtypes, strict=True)]
    assert scalars == (TT, 2, HQK, HV, 0.5)
    launch.chunk_intra_wu_gate(q, k, v, g, None, None, beta, ctab[:0], gate="precomputed", lower_bound=None,
                               scale=0.5, beta_activation="none", qg_out=True)
    assert len(calls) == 1


def test_fwd_o_wrappers(monkeypatch):
    """fwd_o: (q, G, h, Aqk, v_new, o, table), kernel fwd_o_kernel(False), scalars (TT, NC, HQK, HV, scale);
    fwd_o_qg: (qg, absent G, ...), fwd_o_kernel(True), HQK passed as HV (qg is in value-head space); o [TT, HV, V]
    bf16 on the device of G / qg; no launch without chunks."""
    from cula_sm100.forward import launch

    calls = _stub_launches(monkeypatch, launch, "fwd_o_kernel")
    TT, HQK, HV, q, _, v_new, ctab = _stage_inputs()
    G = torch.zeros(TT, HV, 128)
    qg = torch.zeros(TT, HV, 128, dtype=bf)
    h = torch.zeros(2, HV, 128, 128, dtype=bf)
    Aqk = torch.zeros(TT, HV, 64, dtype=bf)
    o1 = launch.fwd_o(q, G, h, Aqk, v_new, ctab, scale=0.25)
    o2 = launch.fwd_o_qg(qg, h, Aqk, v_new, ctab, scale=0.25)
    assert tuple(o1.shape) == tuple(o2.shape) == (TT, HV, 128) and o1.dtype == o2.dtype == bf
    (k1, d1, t1, s1), (k2, d2, t2, s2) = calls
    assert k1 == ("kernel", False) and k2 == ("kernel", True) and d1 == d2 == launch.FWD_O_DTYPES
    assert t1[:5] == (q, G, h, Aqk, v_new) and t1[5] is o1 and t1[6] is ctab
    assert t2[0] is qg and t2[1] is None and t2[2:5] == (h, Aqk, v_new) and t2[5] is o2 and t2[6] is ctab
    assert s1 == (TT, 2, HQK, HV, 0.25) and s2 == (TT, 2, HV, HV, 0.25)
    launch.fwd_o_qg(qg, h, Aqk, v_new, ctab[:0], scale=0.25)
    assert len(calls) == 2


def _stub_stages(monkeypatch, launch, B, T, HV):
    """The forward's stages stubbed: returns the list of stages called (with what decides the path) and the stub
    outputs (G, qg, the five of chunk_intra_wu)."""
    stages = []
    G = torch.full((B * T, HV, 128), 3.0)
    qg = torch.full((B * T, HV, 128), 2.0, dtype=bf)
    five = tuple(torch.zeros(1) for _ in range(5))

    def gate_stage(*a, qg_out=False, **kw):
        stages.append(("chunk_intra_wu_gate", qg_out))
        return (G, qg, *five) if qg_out else (G, *five)

    monkeypatch.setattr(launch, "chunk_intra_wu_gate", gate_stage)
    monkeypatch.setattr(launch, "gate_cumsum", lambda *a, **kw: stages.append("gate_cumsum") or G)
    monkeypatch.setattr(launch, "chunk_intra_wu", lambda *a, **kw: stages.append("chunk_intra_wu") or five)
    monkeypatch.setattr(launch, "chunk_delta_h", lambda w, u, kg, G_, *a, **kw: stages.append(
        ("chunk_delta_h", G_ is G)) or (torch.zeros(1), torch.zeros(B * T, HV, 128), None))
    monkeypatch.setattr(launch, "fwd_o", lambda q, G_, *a, **kw: stages.append(
        ("fwd_o", G_ is G)) or torch.zeros(B * T, HV, 128))
    monkeypatch.setattr(launch, "fwd_o_qg", lambda qg_, *a, **kw: stages.append(
        ("fwd_o_qg", qg_ is qg)) or torch.zeros(B * T, HV, 128))
    return stages, G, qg, five


def _run_forward(launch, B, T, HQK, HV, **kw):
    q = k = torch.zeros(B, T, HQK, 128, dtype=bf)
    v = torch.zeros(B, T, HV, 128, dtype=bf)
    g = torch.zeros(B, T, HV, 128)
    beta = torch.zeros(B, T, HV, dtype=bf)
    return launch.forward(q, k, v, g, beta, None, None, None, None, None, scale=0.1, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, gate="precomputed", lower_bound=None, beta_activation="none",
                          **kw)


@pytest.mark.parametrize("intermediates", [None, True, False])
def test_forward_takes_the_qg_path_without_intermediates(monkeypatch, intermediates):
    """The qg path (chunk_intra_wu_gate with qg_out, chunk_delta_h on its G, fwd_o_qg on its qg; Intermediates with
    g_cumsum None and qg set) exactly when intermediates=False; otherwise chunk_intra_wu_gate without qg_out, then
    fwd_o from q and G (g_cumsum G, qg None). intermediates=None: the argument left out (True)."""
    from cula_sm100.forward import launch

    B, T, HQK, HV = 1, 70, 2, 4
    stages, G, qg, five = _stub_stages(monkeypatch, launch, B, T, HV)
    kw = {} if intermediates is None else dict(intermediates=intermediates)
    o, _, it = _run_forward(launch, B, T, HQK, HV, **kw)
    assert tuple(o.shape) == (B, T, HV, 128)
    if intermediates is False:
        assert stages == [("chunk_intra_wu_gate", True), ("chunk_delta_h", True), ("fwd_o_qg", True)]
        assert it.g_cumsum is None and it.qg is qg
    else:
        assert stages == [("chunk_intra_wu_gate", False), ("chunk_delta_h", True), ("fwd_o", True)]
        assert it.g_cumsum is G and it.qg is None
    assert it.Aqk is five[0] and it.Akk is five[1] and it.kg is five[4]


@pytest.mark.parametrize("save_residuals", [False, True])
def test_chunk_kda_runs_without_intermediates(monkeypatch, save_residuals):
    """chunk_kda (the backend's entry) calls forward with intermediates=False (the backward recomputes G; the
    residuals are Aqk / Akk only), so it takes the qg path; the residuals are Aqk / Akk as
    [B, T, HV, 64] views."""
    from cula_sm100.forward import launch

    B, T, HQK, HV = 2, 40, 1, 2
    seen = []
    Aqk, Akk = torch.zeros(B * T, HV, 64, dtype=bf), torch.ones(B * T, HV, 64, dtype=bf)

    def fake_forward(*a, intermediates=True, **kw):
        seen.append(intermediates)
        it = launch.Intermediates(q=None, k=None, g_cumsum=None, Aqk=Aqk, Akk=Akk, w=None, u=None, kg=None, h=None,
                                  v_new=None, qg=None)
        return torch.zeros(B, T, HV, 128, dtype=bf), None, it

    monkeypatch.setattr(launch, "forward", fake_forward)
    q = torch.zeros(B, T, HQK, 128, dtype=bf)
    out = launch.chunk_kda(q, q, None, None, None, None, None, None, None, None, scale=0.1,
                           output_final_state=False, use_qk_l2norm_in_kernel=True, gate="softplus",
                           lower_bound=None, beta_activation="none", save_residuals=save_residuals)
    assert seen == [False]
    if save_residuals:
        _, _, (r_qk, r_kk) = out
        assert tuple(r_qk.shape) == (B, T, HV, 64) and r_qk.data_ptr() == Aqk.data_ptr()
        assert r_kk.data_ptr() == Akk.data_ptr()
    else:
        assert len(out) == 2


def test_intermediates_qg_defaults_to_none():
    """The Intermediates' qg field defaults to None (the backward's recompute leaves it out)."""
    from cula_sm100.forward import launch

    it = launch.Intermediates(q=None, k=None, g_cumsum=None, Aqk=None, Akk=None, w=None, u=None, kg=None, h=None,
                              v_new=None)
    assert it.qg is None
