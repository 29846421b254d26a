"""GPU tests of chunk_kda training on Hopper through the public op with the default dispatch (CULA_STRICT=1): the
forward on cula-sm90 (the safe gate on the tensor-core stage 1, saving Aqk / Akk in FLA 0.6.0's chunk-64 format),
the backward on cula-sm100 reading them. Odd lengths, varlen with empty and 1-token sequences (with and without
host lengths), GVA, initial state and final-state gradient.

Bounds: gradients against fp64 autograd through cula_core.reference within GRAD_TOL (the bound
tests/sm100/test_backward_gpu.py holds for the sm100 forward + backward); the backward given the sm90 residuals
against the same backward recomputing them within RESIDUAL_TOL (both bf16 roundings of one matrix); two runs bitwise
equal; memcheck clean."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prefill_cases import make_raw, rel_err, require_gpu, run_memcheck

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
GRAD_TOL = 3e-2
RESIDUAL_TOL = 1e-2
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")

CASES = {  # B, T, HQK, HV, lengths, lower_bound
    "B1-T63-G2": (1, 63, 2, 4, None, -5.0),
    "B2-T65-G1-mild": (2, 65, 1, 1, None, -1.0),
    "varlen-empty-G2": (1, 0, 1, 2, [37, 0, 64, 99, 1], -5.0),
    "B1-T1000-G2": (1, 1000, 2, 4, None, -5.0),
}


def _require():
    require_gpu()
    pytest.importorskip("cula_sm100")


def _problem(B, T, HQK, HV, lengths, seed):
    """make_raw's inputs (beta as logits: use_beta_sigmoid_in_kernel) plus h0 and the cotangents do, dht."""
    T = sum(lengths) if lengths else T
    raw = make_raw(B, T, HQK, HV, gate="safe", seed=seed)
    N = len(lengths) if lengths else B
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    h0, dht = (0.1 * torch.randn(N, HV, 128, 128, generator=gen, device="cuda") for _ in range(2))
    return (*raw, h0, torch.randn(B, T, HV, 128, generator=gen, device="cuda").bfloat16(), dht)


def _cu(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu.cuda(), cu


@pytest.fixture
def routes(monkeypatch):
    """Default dispatch, no fallback; records what the sm90 forward and the sm100 backward were asked."""
    from cula_sm100.backward import launch as bwd
    from cula_sm90.prefill import forward as fwd

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setenv("CULA_STRICT", "1")
    seen = {"forward": [], "backward": []}
    prefill, backward = fwd.prefill, bwd.chunk_kda_backward

    def spy_forward(*a, **kw):
        seen["forward"].append(kw.get("save_residuals", False))
        return prefill(*a, **kw)

    def spy_backward(*a, **kw):
        seen["backward"].append(kw.get("residuals") is not None)
        return backward(*a, **kw)

    monkeypatch.setattr(fwd, "prefill", spy_forward)
    monkeypatch.setattr(bwd, "chunk_kda_backward", spy_backward)
    return seen


def _grads(p, lower_bound, lengths, host=True):
    import cula_core

    q, k, v, g, beta, A_log, dt_bias, h0, do, dht = p
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0, A_log, dt_bias)]
    kw = dict(initial_state=ins[5], output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=ins[6], dt_bias=ins[7], safe_gate=True, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True)
    if lengths:
        kw["cu_seqlens"], cpu = _cu(lengths)
        kw["cu_seqlens_cpu"] = cpu if host else None
    o, ht = cula_core.chunk_kda(*ins[:5], **kw)
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    return dict(zip(NAMES, [x.grad for x in ins], strict=True))


def _expected(p, lower_bound, lengths):
    from cula_core import reference_backend

    d = torch.float64
    q, k, v, g, beta, A_log, dt_bias, h0, do, dht = (x.to(d) for x in p)
    cu = _cu(lengths)[0] if lengths else None
    out = reference_backend.chunk_kda_backward(
        do, dht, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu, scale=128 ** -0.5, use_qk_l2norm_in_kernel=True,
        gate="safe", lower_bound=lower_bound, beta_activation="sigmoid")
    return dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"), out, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_sm90_forward_sm100_backward(case, routes):
    _require()
    B, T, HQK, HV, lengths, lb = CASES[case]
    p = _problem(B, T, HQK, HV, lengths, seed=len(case))
    for host in ((True, False) if lengths else (True,)):
        got = _grads(p, lb, lengths, host)
        exp = _expected(p, lb, lengths)
        errs = {n: rel_err(got[n], exp[n]) for n in NAMES}
        print(f"TRAIN_GRAD_ERR {case} host={host} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
        assert all(e <= GRAD_TOL for e in errs.values()), errs
    # the forward ran on sm90 saving residuals, the backward on sm100 reading them
    assert routes["forward"] == [True] * len(routes["backward"]) and all(routes["backward"]), routes


def test_residuals_against_recomputed_and_deterministic(routes, monkeypatch):
    """The sm100 backward given the sm90 residuals against the same backward recomputing Aqk / Akk itself (a
    backward that reads no format): within RESIDUAL_TOL; and two runs bitwise equal."""
    _require()
    from cula_sm100 import backward

    lengths = [300, 0, 1, 129]
    p = _problem(1, 0, 2, 4, lengths, seed=21)
    first = _grads(p, -5.0, lengths)
    again = _grads(p, -5.0, lengths)
    assert all(torch.equal(first[n], again[n]) for n in NAMES), [n for n in NAMES
                                                                 if not torch.equal(first[n], again[n])]
    monkeypatch.setattr(backward, "accepts_residuals", lambda call, fmt: False)
    recomputed = _grads(p, -5.0, lengths)
    assert routes["forward"] == [True, True, False] and routes["backward"] == [True, True, False]
    errs = {n: rel_err(first[n], recomputed[n]) for n in NAMES}
    print("TRAIN_RESIDUAL_VS_RECOMPUTE " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    assert all(e <= RESIDUAL_TOL for e in errs.values()), errs


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_clean_with_residuals():
    require_gpu()
    r = run_memcheck(HERE / "train_memcheck_case.py")
    assert r.returncode == 0 and "cases ok" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr
