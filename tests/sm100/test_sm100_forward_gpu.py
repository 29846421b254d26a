"""cula-sm100 chunk_kda forward on the GPU: every kernel against the fp32 reference's intermediates (each fed
the reference's inputs to it, so a kernel's error is its own), the composed forward, native GVA against
expanded q/k (bitwise), and the public op against the reference and FLA 0.6.0 on the same inputs."""

from __future__ import annotations

import pytest
import torch

from sm100_cases import TOL, flat, make_inputs, reference, rel_err, require_gpu, seqlens_to_cu

pytestmark = pytest.mark.gpu

# (B, T, HQK, HV): every T of the issue at GVA 2, then GVA ratio 1, 2, 4 for HQK in {1, 2, 4, 16}
FIXED = [(1, 1, 2, 4), (1, 63, 2, 4), (2, 64, 2, 4), (1, 65, 2, 4), (2, 500, 2, 4), (1, 1000, 2, 4),
         (1, 4096, 2, 4)] + [(1, 130, hqk, hqk * r) for hqk in (1, 2, 4, 16) for r in (1, 2, 4)]
# varlen: 3, 5 and 10 sequences, each set with a length-1 sequence (and the last with an empty one)
VARLEN = [[1, 100, 64], [17, 1, 64, 65, 200], [5, 1, 63, 64, 65, 130, 0, 7, 300, 20]]


def _check(name, ours, ref, errs):
    e = rel_err(ours, ref)
    errs[name] = e
    assert e < TOL[name], f"{name}: rel err {e:.3e} >= {TOL[name]:.0e}"


def _run_kernels(q, k, v, g, beta, h0, cu, cu_cpu, B, T):
    from cula_sm100.forward import launch

    HV = v.shape[2]
    scale = q.shape[-1] ** -0.5
    o_ref, ht_ref, it = reference(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu)
    ctab, stab = launch.tables(B, T, cu, cu_cpu, q.device)
    errs = {}
    bf = torch.bfloat16
    G = launch.gate_cumsum(g.reshape(-1, HV, 128), None, None, ctab, gate="precomputed", lower_bound=None)
    _check("g_cumsum", G, flat(it.g_cumsum), errs)
    Gr = flat(it.g_cumsum).contiguous()
    Aqk, Akk = launch.chunk_intra(q, k, Gr, beta, ctab, scale=scale, beta_activation="none")
    _check("Aqk", Aqk, flat(it.Aqk), errs)
    _check("Akk", Akk, flat(it.Akk), errs)
    w, u, kg = launch.recompute_w_u(k, v, Gr, beta, flat(it.Akk).to(bf).contiguous(), ctab, beta_activation="none")
    _check("w", w, flat(it.w), errs)
    _check("u", u, flat(it.u), errs)
    _check("kg", kg, flat(it.kg), errs)
    wukg = [flat(x).to(bf).contiguous() for x in (it.w, it.u, it.kg)]
    h, v_new, ht = launch.chunk_delta_h(*wukg, Gr, h0, ctab, stab, output_final_state=True)
    # plain CTAs with one and two w / kg stages: the same arithmetic, so bitwise the same results
    plain = [launch.chunk_delta_h(*wukg, Gr, h0, ctab, stab, output_final_state=True, cluster=False, stages=st)
             for st in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*plain, strict=True))
    _check("h", h, flat(it.h), errs)
    _check("v_new", v_new, flat(it.v_new), errs)
    _check("ht", ht, ht_ref, errs)
    o = launch.fwd_o(q, Gr, flat(it.h).to(bf).contiguous(), flat(it.Aqk).to(bf).contiguous(),
                     flat(it.v_new).to(bf).contiguous(), ctab, scale=scale)
    _check("o", o, flat(o_ref), errs)
    # the composed forward, every stage on its own outputs
    o2, ht2, _ = launch.forward(q, k, v, g, beta, None, None, h0, cu, cu_cpu, scale=scale, output_final_state=True,
                                use_qk_l2norm_in_kernel=False, gate="precomputed", lower_bound=None,
                                beta_activation="none")
    e_o, e_ht = rel_err(o2, o_ref), rel_err(ht2, ht_ref)
    print(f"\n{B=} {T=} HQK={q.shape[2]} {HV=} varlen={cu is not None}: "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()) + f" | forward o={e_o:.2e} ht={e_ht:.2e}")
    assert e_o < TOL["o"] and e_ht < TOL["ht"], (e_o, e_ht)


@pytest.mark.parametrize("B,T,HQK,HV", FIXED)
def test_kernels_fixed_length(B, T, HQK, HV):
    require_gpu()
    q, k, v, g, beta, h0 = make_inputs(B, T, HQK, HV, seed=T + HV, h0=True)
    _run_kernels(q, k, v, g, beta, h0, None, None, B, T)


@pytest.mark.parametrize("lengths", VARLEN, ids=lambda x: f"{len(x)}seqs")
def test_kernels_varlen(lengths):
    require_gpu()
    T = sum(lengths)
    cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 8, seed=len(lengths), h0=True, N=len(lengths))
    _run_kernels(q, k, v, g, beta, h0, cu, cu_cpu, 1, T)


# odd T (1, 63, 65: rows past the chunk end), GVA 1 / 2 / 4, and a varlen batch with a length-1 sequence
DECAY_SHAPES = [(1, 1, 1, 1, None), (1, 63, 2, 4, None), (1, 65, 1, 4, None), (2, 130, 2, 2, None),
                (1, 300, 2, 4, None), (1, 0, 2, 8, [1, 64, 65, 7, 130])]


@pytest.mark.parametrize("decay", ["strong", "extreme"])
@pytest.mark.parametrize("B,T,HQK,HV,lengths", DECAY_SHAPES)
def test_strong_decay(B, T, HQK, HV, lengths, decay):
    """Decays down to -5 per token (FLA's safe-gate range: chunk_intra's diagonal blocks by GEMM or by its fp32
    path, by block) and down to -30 (the fp32 path everywhere)."""
    require_gpu()
    cu = cu_cpu = None
    if lengths is not None:
        T = sum(lengths)
        cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, h0 = make_inputs(B, T, HQK, HV, seed=7 + T, decay=decay, h0=True,
                                       N=len(lengths) if lengths else None)
    _run_kernels(q, k, v, g, beta, h0, cu, cu_cpu, B, T)


# gate_cumsum alone in every gate mode and g dtype: G within TOL of the fp64 reference
GATE_KERNEL_CASES = [("softplus", torch.float32, True, True, None), ("softplus", torch.bfloat16, True, False, None),
                     ("safe", torch.float32, True, True, -5.0), ("safe", torch.bfloat16, False, True, -3.0),
                     ("precomputed", torch.bfloat16, False, False, None)]


@pytest.mark.parametrize("gate,g_dtype,has_A,has_b,lb", GATE_KERNEL_CASES)
@pytest.mark.parametrize("lengths", [[1, 63, 0, 64, 65, 200], [130]], ids=["varlen", "one"])
def test_gate_cumsum_modes(gate, g_dtype, has_A, has_b, lb, lengths):
    """gate_cumsum in every gate mode, fp32 and bf16 g, A_log / dt_bias present or not, HV % 4 != 0 (idle warps in
    the last CTA column), chunks of 1..64 tokens: G against the fp64 reference's chunk-local cumsum; gate_cumsum_qg
    on the same inputs (GVA 2): the same G, and qg."""
    require_gpu()
    from cula_core.reference.gates import log_decay
    from cula_sm100.forward import launch

    HV, T = 6, sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(T + HV)
    g = (3 * torch.randn(1, T, HV, 128, generator=gen, device="cuda") - 2).to(g_dtype)  # e^z < 2^-6 too
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1) if has_A else None
    dt_bias = 0.1 * torch.randn(HV * 128, generator=gen, device="cuda") if has_b else None
    cu, cu_cpu = seqlens_to_cu(lengths)
    ctab, _ = launch.tables(1, T, cu, cu_cpu, g.device)
    G = launch.gate_cumsum(g.reshape(T, HV, 128), A_log, dt_bias, ctab, gate=gate, lower_bound=lb)
    x = log_decay(g.double(), A_log.double() if has_A else None, dt_bias.double() if has_b else None, gate,
                  lb).reshape(T, HV, 128)
    ref = torch.zeros_like(x)
    for t0, n in ctab.tolist():
        ref[t0:t0 + n] = x[t0:t0 + n].cumsum(0)
    assert rel_err(G, ref) < TOL["g_cumsum"]
    # with qg_out (the backward's recompute): the same G bitwise, and qg = bf16(q e^G scale) of q at hv // 2
    q = torch.randn(T, HV // 2, 128, generator=gen, device="cuda").bfloat16()
    G2, qg = launch.gate_cumsum_qg(g.reshape(T, HV, 128), A_log, dt_bias, q, ctab, gate=gate, lower_bound=lb,
                                   scale=0.1)
    assert torch.equal(G2, G)
    expect = q.float().repeat_interleave(2, dim=1) * torch.exp(G) * 0.1
    assert qg.dtype == torch.bfloat16
    assert rel_err(qg, expect) < 4e-3  # bf16 rounding (2^-9 relative) plus the approximate exp


def test_gva_equals_expanded_qk_bitwise():
    """Native GVA (q/k read at hv // group) gives bitwise what expanding q/k to HV heads gives (group 1)."""
    require_gpu()
    from cula_sm100.forward import launch

    cu, cu_cpu = seqlens_to_cu([1, 70, 200, 64])
    q, k, v, g, beta, h0 = make_inputs(1, 335, 2, 8, seed=3, h0=True, N=4)
    kw = dict(scale=0.1, output_final_state=True, use_qk_l2norm_in_kernel=True, gate="precomputed",
              lower_bound=None, beta_activation="none")
    o1, ht1, i1 = launch.forward(q, k, v, g, beta, None, None, h0, cu, cu_cpu, **kw)
    qe, ke = (x.repeat_interleave(4, dim=2).contiguous() for x in (q, k))
    o2, ht2, i2 = launch.forward(qe, ke, v, g, beta, None, None, h0, cu, cu_cpu, **kw)
    assert torch.equal(o1, o2)
    assert torch.equal(ht1, ht2)
    for name in ("g_cumsum", "Aqk", "Akk", "w", "u", "kg", "h", "v_new"):
        assert torch.equal(getattr(i1, name), getattr(i2, name)), name


def _public(backend, monkeypatch, *args, **kw):
    import cula_core

    monkeypatch.setenv("CULA_BACKEND", backend)
    return cula_core.chunk_kda(*args, **kw)


GATES = [
    dict(gate="softplus", use_gate_in_kernel=True, lower_bound=None),
    dict(gate="safe", use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),
    dict(gate="precomputed"),
]


@pytest.mark.parametrize("cfg", GATES, ids=lambda c: c["gate"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_public_op_vs_reference_and_fla(cfg, varlen, monkeypatch):
    """cula.chunk_kda on sm100 (raw gate, q/k L2 norm in kernel, beta sigmoid given, initial and final state)
    against the reference backend and against FLA 0.6.0 with the same flags on the same inputs."""
    require_gpu()
    cfg = dict(cfg)
    gate = cfg.pop("gate")
    B, T, HQK, HV = (1, 333, 2, 4) if varlen else (2, 200, 2, 4)
    lengths = [1, 64, 100, 168] if varlen else None
    gen = torch.Generator(device="cuda").manual_seed(11)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q, k, v = (r(B, T, h, 128).bfloat16() for h in (HQK, HQK, HV))
    g = r(B, T, HV, 128) if gate != "precomputed" else torch.nn.functional.logsigmoid(r(B, T, HV, 128)) / 8
    beta = torch.sigmoid(r(B, T, HV)).bfloat16()
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1)
    dt_bias = 0.1 * r(HV * 128)
    N = len(lengths) if varlen else B
    h0 = 0.1 * r(N, HV, 128, 128)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, **cfg)
    if gate != "precomputed":
        kw.update(A_log=A_log, dt_bias=dt_bias)
    if varlen:
        kw["cu_seqlens"], kw["cu_seqlens_cpu"] = seqlens_to_cu(lengths)
    o, ht = _public("sm100", monkeypatch, q, k, v, g, beta, **kw)
    o_ref, ht_ref = _public("reference", monkeypatch, q, k, v, g, beta, **kw)
    e_o, e_ht = rel_err(o, o_ref), rel_err(ht, ht_ref)
    line = f"\n{gate} varlen={varlen}: cula o={e_o:.2e} ht={e_ht:.2e}"
    assert e_o < TOL["o"] and e_ht < TOL["ht"], line
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
        o_f, ht_f = fla_chunk_kda(q, k, v, g, beta, **fkw)
    f_o, f_ht = rel_err(o_f, o_ref), rel_err(ht_f, ht_ref)
    d_o = rel_err(o, o_f)
    print(line + f" | FLA o={f_o:.2e} ht={f_ht:.2e} | cula vs FLA o={d_o:.2e}")
    # as accurate as FLA (to a margin) and close to it
    assert e_o <= max(2 * f_o, 5e-3) and e_ht <= max(2 * f_ht, 5e-3)
    assert d_o < TOL["o"]


def test_requires_grad_forward_then_backward(monkeypatch):
    """With requires_grad the forward runs on sm100 (forced), then backward runs wherever dispatch sends
    `chunk_kda_backward` (cula_sm100.backward, or the reference where it declines)."""
    require_gpu()
    q, k, v, g, beta, _ = make_inputs(1, 130, 2, 4, seed=5)
    q = q.clone().requires_grad_(True)
    o, _ = _public("sm100", monkeypatch, q, k, v, g, beta)
    o_ref, _ = _public("reference", monkeypatch, q.detach(), k, v, g, beta)
    assert rel_err(o, o_ref) < TOL["o"]
    monkeypatch.delenv("CULA_BACKEND")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o.float().square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_misaligned_views_are_copied(monkeypatch):
    """Inputs that are contiguous views at an offset that is not a multiple of 16 bytes (the kernels load 16-byte
    vectors from pointers declared 16-byte aligned): the forward and the backward give bitwise what the same
    values in tensors of their own give."""
    require_gpu()
    q, k, v, g, beta, _ = make_inputs(1, 130, 2, 4, seed=9)

    def shifted(x):  # the same values, 8 bytes (bf16) / 4 bytes (fp32) past a 16-byte boundary
        buf = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
        y = buf[2 if x.element_size() == 4 else 4:][:x.numel()].view(x.shape)
        y.copy_(x)
        assert y.is_contiguous() and y.data_ptr() % 16 != 0
        return y

    def run(q, k, v, g, beta):  # q, k, v, g are leaves (views of an unshared buffer when shifted)
        for x in (q, k, v, g):
            x.requires_grad_(True)
        o, _ = _public("sm100", monkeypatch, q, k, v, g, beta)
        o.float().square().sum().backward()
        return o, [x.grad for x in (q, k, v, g)]

    o1, g1 = run(*(x.clone() for x in (q, k, v, g)), beta)
    o2, g2 = run(*(shifted(x) for x in (q, k, v, g, beta)))
    assert torch.equal(o1, o2)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_memcheck_clean_on_odd_shapes():
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    require_gpu()
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    here = Path(__file__).resolve().parent
    # API errors are not reported: the DSL probes device attributes through calls that may fail by design;
    # every access of every kernel launch is still checked.
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
           "--report-api-errors", "no", sys.executable, str(here / "sm100_memcheck_case.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=here)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[:6000] + proc.stderr[-3000:]
    assert "cases ok" in proc.stdout
    assert "ERROR SUMMARY: 0 errors" in proc.stdout
