"""GPU tests of the cula-sm90 prefill (kda_prefill and no-grad chunk_kda, forced onto the sm90 backend) against
cula_core.reference in fp64 and FLA 0.6.0 on the same bf16 inputs: B in {1, 2}, T in {1, 63, 64, 65, 1000, 4096},
varlen with 1, 3, 20, 70 and 300 sequences (lengths 0 and 1 included, with and without cu_seqlens_cpu), GVA 1/2/4,
the three gate modes, with and without initial state; CP on == off; compute-sanitizer memcheck on odd shapes.

Bounds (prefill_cases): REL_TOL = 1e-2 on ||ours - ref|| / ||ref|| for o and the final state; FLA_TOL = 2e-2
against FLA; CP on vs off: CP_TOL_STATE = 5e-4 (final state), CP_TOL_O = 2e-3 (o, bf16)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prefill_cases import (CP_TOL_O, CP_TOL_STATE, FLA_TOL, REL_TOL, fla_chunk_kda, gate_kwargs, make_raw,
                           reference, rel_err, require_gpu, run_memcheck)

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _gpu(monkeypatch):
    require_gpu()
    monkeypatch.setenv("CULA_BACKEND", "sm90")


def run_ours(q, k, v, g, beta, gate_kw, *, op="kda_prefill", **kw):
    import cula

    fn = getattr(cula, op)
    return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              output_final_state=True, **gate_kw, **kw)


def check(o, ht, o_r, ht_r, what):
    errs = {"o": rel_err(o, o_r), "ht": rel_err(ht, ht_r)}
    print(f"REL_ERR {what} o={errs['o']:.3e} ht={errs['ht']:.3e}")  # the log's largest: the bound actually seen
    assert all(e <= REL_TOL for e in errs.values()), (what, errs)
    return errs


# T -> (B, HQK, HV)
SHAPES = [(1, 1, 4, 4), (2, 1, 2, 4), (1, 63, 2, 8), (2, 64, 4, 4), (2, 65, 1, 4), (1, 1000, 2, 4),
          (2, 1000, 4, 8), (1, 4096, 2, 2), (2, 4096, 1, 2)]


@pytest.mark.parametrize("gate", ["safe", "softplus", "precomputed"])
@pytest.mark.parametrize(("B", "T", "HQK", "HV"), SHAPES, ids=[f"B{b}-T{t}-H{h}x{v // h}" for b, t, h, v in SHAPES])
def test_fixed_length_vs_reference(B, T, HQK, HV, gate):
    q, k, v, g, beta, A_log, dt_bias = make_raw(B, T, HQK, HV, gate=gate, seed=T + 7 * B + HV)
    gkw = gate_kwargs(gate, A_log, dt_bias)
    with_h0 = (T + B) % 2 == 1 or T == 4096
    h0 = torch.randn(B, HV, 128, 128, device="cuda") if with_h0 else None
    o, ht = run_ours(q, k, v, g, beta, gkw, initial_state=h0)
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw, initial_state=h0)
    check(o, ht, o_r, ht_r, "reference")


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize(("B", "T", "HQK", "HV"), [(2, 65, 64, 64), (1, 1000, 64, 64), (1, 4096, 64, 64)])
def test_vs_fla(B, T, HQK, HV, gate):
    """FLA 0.6.0's chunk_kda has no GVA: HQK == HV here (H = 64, the benchmark's head count, whose Triton
    autotuning the benchmark caches)."""
    fla = fla_chunk_kda()
    if fla is None:
        pytest.skip("FLA 0.6.0 not installed")
    q, k, v, g, beta, A_log, dt_bias = make_raw(B, T, HQK, HV, gate=gate, seed=T + 3)
    gkw = gate_kwargs(gate, A_log, dt_bias)
    h0 = torch.randn(B, HV, 128, 128, device="cuda")
    o, ht = run_ours(q, k, v, g, beta, gkw, initial_state=h0)
    o_f, ht_f = fla(q, k, v, g, beta.sigmoid(), initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, **gkw)
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw, initial_state=h0)
    errs = {"o": rel_err(o, o_f), "ht": rel_err(ht, ht_f)}
    fla_errs = {"o": rel_err(o_f, o_r), "ht": rel_err(ht_f, ht_r)}
    print(f"FLA_ERR o={errs['o']:.3e} ht={errs['ht']:.3e} (FLA vs ref: o={fla_errs['o']:.3e} ht={fla_errs['ht']:.3e})")
    assert all(e <= FLA_TOL for e in errs.values()), (errs, fla_errs)
    check(o, ht, o_r, ht_r, "reference")


VARLEN = {
    "1seq": [777],
    "3seq": [1, 130, 64],
    "20seq": [0, 1, 64, 65, 200, 0, 3, 128, 1000, 17, 63, 2, 0, 300, 129, 1, 90, 500, 33, 64],
    # more than 32 sequences (stage 1's 32-ary chunk search takes two steps), with pairs of empty sequences
    "70seq": [(37 * n) % 150 if n % 9 > 1 else 0 for n in range(70)],
    # 1200 stage-2 items at HV = 4: every persistent CTA walks several, empty ones and one-chunk ones among them,
    # each loading the next one's first chunk ahead
    "300seq": [(29 * n) % 140 if n % 7 else 0 for n in range(300)],
}


@pytest.mark.parametrize("host_lengths", [True, False], ids=["cu_cpu", "device_only"])
@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen_vs_reference(case, host_lengths):
    lens = VARLEN[case]
    T = sum(lens)
    HQK, HV = 2, 4
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, T, HQK, HV, gate="safe", seed=len(lens))
    gkw = gate_kwargs("safe", A_log, dt_bias)
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu_cpu.cuda()
    h0 = torch.randn(len(lens), HV, 128, 128, device="cuda")
    o, ht = run_ours(q, k, v, g, beta, gkw, initial_state=h0, cu_seqlens=cu,
                     cu_seqlens_cpu=cu_cpu if host_lengths else None)
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw, initial_state=h0, cu_seqlens=cu)
    check(o, ht, o_r, ht_r, case)
    # an empty sequence hands its initial state through unchanged
    for n, L in enumerate(lens):
        if L == 0:
            assert torch.equal(ht[n], h0[n])


@pytest.mark.parametrize("cp", [False, True], ids=["serial", "cp"])
def test_non_finite_sequence_stays_in_its_rows(cp):
    """A sequence whose inputs hold NaN and Inf must not reach the outputs or states of its neighbours: both
    stages work on 64-token tiles, which reach past a segment's end into the next sequence's tokens unless the
    kernel zero-fills or masks those rows. Every other sequence equals its run without the poisoned one's values
    (same batch layout, finite inputs), bit for bit."""
    lens = [100, 37, 200, 64, 5000]
    T = sum(lens)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, T, 2, 4, gate="safe", seed=11)
    gkw = gate_kwargs("safe", A_log, dt_bias)
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu_cpu.cuda()
    h0 = torch.randn(len(lens), 4, 128, 128, device="cuda")
    kw = dict(initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, intracard_cp=cp)
    o, ht = run_ours(q, k, v, g, beta, gkw, **kw)
    bad = 1  # the 37-token sequence: a partial chunk between two others
    a, b = int(cu_cpu[bad]), int(cu_cpu[bad + 1])
    for t in (q, k, v):
        t[:, a:b] = float("nan")
    g[:, a:b] = float("inf")
    o_bad, ht_bad = run_ours(q, k, v, g, beta, gkw, **kw)
    for n in range(len(lens)):
        s, e = int(cu_cpu[n]), int(cu_cpu[n + 1])
        if n == bad:
            assert not torch.isfinite(o_bad[:, s:e]).all()
            continue
        assert torch.equal(o_bad[:, s:e], o[:, s:e]), n
        assert torch.equal(ht_bad[n], ht[n]), n


def test_no_final_state_and_chunk_kda_no_grad():
    import cula

    q, k, v, g, beta, A_log, dt_bias = make_raw(2, 300, 2, 4, gate="softplus", seed=5)
    gkw = gate_kwargs("softplus", A_log, dt_bias)
    o, ht = cula.kda_prefill(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gkw)
    assert ht is None
    o2, ht2 = run_ours(q, k, v, g, beta, gkw, op="chunk_kda")
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw)
    check(o2, ht2, o_r, ht_r, "chunk_kda")
    assert torch.equal(o, o2)


@pytest.mark.parametrize(("lens", "HV"), [([131072], 8), ([65536, 65536], 8), ([40000, 64, 1, 0, 3000], 8),
                                          ([16384], 4)])
def test_cp_on_equals_off(lens, HV):
    """CP on vs off with a mild precomputed decay (|g| ~ 1e-3 per token: the state remembers across many
    chunks, so each piece's map M is far from zero and the scan matters). A strong gate would forget within a
    chunk, make M underflow to 0 and the two paths agree trivially."""
    T = sum(lens)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, T, HV, HV, gate="precomputed", seed=T)
    g = (g.float() / 200).to(g.dtype)  # logsigmoid / 800: mean log decay ~ -1e-3 per token
    gkw = gate_kwargs("precomputed", A_log, dt_bias)
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu_cpu.cuda()
    h0 = torch.randn(len(lens), HV, 128, 128, device="cuda")
    kw = dict(initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    o_on, ht_on = run_ours(q, k, v, g, beta, gkw, intracard_cp=True, **kw)
    o_off, ht_off = run_ours(q, k, v, g, beta, gkw, intracard_cp=False, **kw)
    from cula_core import cp_planner

    plan = cp_planner.plan(tuple(lens), HV, torch.cuda.get_device_properties(0).multi_processor_count, "on")
    assert plan.split
    e_ht, e_o = rel_err(ht_on, ht_off), rel_err(o_on, o_off)
    print(f"CP_ERR {lens} o={e_o:.3e} ht={e_ht:.3e}")
    assert e_ht <= CP_TOL_STATE and e_o <= CP_TOL_O, (e_o, e_ht)
    if T <= 20000:
        o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw, **{k_: kw[k_] for k_ in ("initial_state", "cu_seqlens")})
        check(o_on, ht_on, o_r, ht_r, "cp")


@pytest.mark.parametrize(("op", "cp"), [("kda_prefill", False), ("kda_prefill", True), ("chunk_kda", False)],
                         ids=["kda_prefill-serial", "kda_prefill-cp", "chunk_kda"])
def test_v_first_states_equal_k_first_transposed(op, cp):
    """state_v_first=True: stage 2 reads the [N, HV, V, K] initial state and writes the final state so, with no
    copies around it: o identical to the K-first call's, the final state its transpose (bit for bit without CP: the
    same arithmetic, another address; to fp32 rounding with CP, whose scan multiplies a transposed view).
    chunk_kda does not run intra-card CP."""
    lens = [20000, 1, 0, 700]
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 4, gate="safe", seed=11)
    gkw = gate_kwargs("safe", A_log, dt_bias)
    h0 = torch.randn(len(lens), 4, 128, 128, device="cuda")
    kw = dict(cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu, **({"intracard_cp": cp} if op == "kda_prefill" else {}))
    o_k, ht_k = run_ours(q, k, v, g, beta, gkw, op=op, initial_state=h0, **kw)
    h0_v = h0.transpose(-1, -2).contiguous()
    o_v, ht_v = run_ours(q, k, v, g, beta, gkw, op=op, initial_state=h0_v, state_v_first=True, **kw)
    assert torch.equal(h0_v, h0.transpose(-1, -2))  # the input is left as it was
    assert ht_v.shape == (len(lens), 4, 128, 128) and ht_v.is_contiguous()
    if cp:
        assert rel_err(ht_v, ht_k.transpose(-1, -2)) <= 1e-6 and rel_err(o_v, o_k) <= 1e-6
    else:
        assert torch.equal(ht_v, ht_k.transpose(-1, -2)) and torch.equal(o_v, o_k)
    assert torch.equal(ht_v[2], h0_v[2])  # the empty sequence hands its initial state through


@pytest.mark.parametrize("lens", [None, [700, 1, 0, 2000, 65]], ids=["B2-T1000", "varlen"])
def test_vs_flashkda(lens):
    """cula and FlashKDA (MoonshotAI's CUTLASS forward) on the same bf16 inputs, in FlashKDA's setup: safe gate
    (lower_bound -5) from raw g with A_log / dt_bias, q/k L2 norm and sigmoid(beta) in kernel, K = V = 128, no GVA.
    Both against the fp64 reference: cula within REL_TOL and no further from it than FlashKDA (o and the final
    state), and the two within FLA_TOL of each other."""
    flash_kda = pytest.importorskip("flash_kda")
    H, K = 4, 128
    B, T = (2, 1000) if lens is None else (1, sum(lens))
    N = B if lens is None else len(lens)
    q, k, v, g, beta, A_log, dt_bias = make_raw(B, T, H, H, gate="safe", seed=11)
    gkw = gate_kwargs("safe", A_log, dt_bias)
    cu_cpu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = None if cu_cpu is None else cu_cpu.cuda()
    o, ht = run_ours(q, k, v, g, beta, gkw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    o_fk = torch.empty_like(v)
    ht_fk = torch.empty(N, H, K, K, dtype=torch.float32, device="cuda")  # FlashKDA's state is [N, H, V, K]
    flash_kda.fwd(q, k, v, g, beta, K ** -0.5, o_fk, A_log=A_log, dt_bias=dt_bias.view(H, K), lower_bound=-5.0,
                  initial_state=None, final_state=ht_fk, cu_seqlens=None if cu is None else cu.long())
    ht_fk = ht_fk.transpose(-1, -2)
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw, cu_seqlens=cu)
    errs = {"o": rel_err(o, o_r), "ht": rel_err(ht, ht_r), "o_fk": rel_err(o_fk, o_r), "ht_fk": rel_err(ht_fk, ht_r),
            "o_vs_fk": rel_err(o, o_fk), "ht_vs_fk": rel_err(ht, ht_fk)}
    print("FLASHKDA_ERR " + " ".join(f"{n}={e:.3e}" for n, e in errs.items()))
    assert errs["o"] <= REL_TOL and errs["ht"] <= REL_TOL, errs
    assert errs["o"] <= errs["o_fk"] and errs["ht"] <= errs["ht_fk"], errs
    assert errs["o_vs_fk"] <= FLA_TOL and errs["ht_vs_fk"] <= FLA_TOL, errs


@pytest.mark.parametrize("gate", ["safe", "precomputed"])
def test_long_sequence_strong_decay_vs_reference(gate):
    """One 65536-token sequence with a strong decay (the safe gate at the lowest bound the public op accepts,
    lower_bound -5, on raw g pushed towards the bound; or a precomputed log decay of ~-0.8 per channel and token),
    CP as the planner picks it: o and the final state finite and within REL_TOL of the fp64 reference."""
    T, H = 65536, 2
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, T, H, H, gate=gate, seed=5)
    if gate == "safe":
        g = (g.float() + 4.0).to(g.dtype)  # sigmoid(A (g + dt_bias)) near 1: decays near lower_bound per token
        gkw = dict(gate_kwargs("safe", A_log, dt_bias), lower_bound=-5.0)
    else:
        g = (g.float() * 4).to(g.dtype)  # make_raw's logsigmoid(x) / 4 times 4: mean ~-0.8 per channel and token
        gkw = gate_kwargs("precomputed", A_log, dt_bias)
    o, ht = run_ours(q, k, v, g, beta, gkw, intracard_cp="auto")
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw)
    check(o, ht, o_r, ht_r, f"T=65536 strong {gate}")


@pytest.mark.parametrize("cp", [False, True], ids=["serial", "cp"])
def test_stage2_widths_agree(monkeypatch, cp):
    """Stage 2 at 64 and at 128 state columns per CTA (forward.state_cols picks one from the grid's size) on one
    varlen batch with odd lengths and an initial state, with and without CP: both within the reference bound, and
    the same o and final state (each state column's products are the same; only the CTA running them differs)."""
    from cula_sm90.prefill import forward

    lens = [130, 0, 1, 63, 65, 3000 if cp else 700]
    HQK, HV = 2, 8
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), HQK, HV, gate="safe", seed=7)
    gkw = gate_kwargs("safe", A_log, dt_bias)
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    h0 = torch.randn(len(lens), HV, 128, 128, device="cuda")
    kw = dict(initial_state=h0, cu_seqlens=cu_cpu.cuda())
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gkw, **kw)
    outs = {}
    for cols in (64, 128):
        monkeypatch.setattr(forward, "state_cols", lambda seq_heads, num_sms, cols=cols: cols)
        outs[cols] = run_ours(q, k, v, g, beta, gkw, cu_seqlens_cpu=cu_cpu, intracard_cp=cp, **kw)
        check(*outs[cols], o_r, ht_r, f"{cols} columns, cp={cp}")
    (o64, ht64), (o128, ht128) = outs[64], outs[128]
    e_o, e_ht = rel_err(o128, o64), rel_err(ht128, ht64)
    print(f"WIDTH_ERR cp={cp} o={e_o:.3e} ht={e_ht:.3e}")
    assert e_o <= CP_TOL_O and e_ht <= CP_TOL_STATE, (e_o, e_ht)


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_clean_on_odd_shapes():
    r = run_memcheck(HERE / "prefill_memcheck_case.py")
    assert r.returncode == 0 and "cases ok" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr
