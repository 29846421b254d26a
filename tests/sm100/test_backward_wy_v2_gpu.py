"""cula-sm100 chunk_wy_dqkg v2 (backward/chunk_wy_dqkg_v2.py, opt-in) on the GPU: against fp64 autograd of the terms
it differentiates, against v1 (chunk_wy_dqkg.py, the default) on the same inputs, for GVA 1 / 2 / 4, T not a
multiple of the chunk, varlen with empty and 1-token sequences; bitwise determinism; the whole backward with
CULA_SM100_WY_DQKG=v2 against fp64 autograd through cula_core.reference; compute-sanitizer on odd shapes.

v2 was written and compiled (sm_90a, sm_100a) in a CPU-only session: these tests are its first run."""

from __future__ import annotations

import pytest
import torch

from backward_cases import run_memcheck, wy_dqkg_expected, wy_problem
from sm100_cases import rel_err, require_gpu

pytestmark = pytest.mark.gpu

WY_NAMES = ("dq", "dk", "dv", "dbeta", "dG", "dL")
# ||v2 - fp64|| / ||fp64||: the same bounds as v1's (test_backward_gpu.WY_TOL): bf16 operands (2^-8) in a few
# chained products; dL passes two bf16 roundings of a 64 x 64 intermediate
WY_TOL = dict(dq=1e-2, dk=1e-2, dv=1e-2, dbeta=1e-2, dG=2e-2, dL=2e-2)
# ||v2 - v1|| / ||v1||: the same products in bf16 with fp32 accumulation; only the summation order (8 warps,
# register-held dq / dk) and the rounding points of a few fp32 products differ
V1_TOL = dict(dq=2e-3, dk=2e-3, dv=2e-3, dbeta=2e-3, dG=5e-3, dL=5e-3)

# (B, T, HQK, HV, lengths): GVA 1, 2, 4; T = 1, 63, 64, 65, 1000; varlen with empty and 1-token sequences
CASES = [(1, 1, 1, 1, None), (2, 64, 1, 1, None), (1, 63, 2, 4, None), (2, 65, 2, 4, None), (1, 1000, 2, 4, None),
         (1, 130, 1, 4, None), (1, 300, 4, 8, None), (1, 0, 2, 4, [17, 1, 64, 65, 0, 200]),
         (1, 0, 1, 2, [1, 0, 63, 64, 65, 0, 2])]


def _run(args, ctab, scale, variant):
    from cula_sm100.backward import launch

    return launch.chunk_wy_dqkg(*args, ctab, scale=scale, variant=variant)


@pytest.mark.parametrize("B,T,HQK,HV,lengths", CASES)
def test_v2_vs_fp64_and_v1(B, T, HQK, HV, lengths):
    require_gpu()
    args, ch, ctab, scale, _ = wy_problem(B, T, HQK, HV, lengths, seed=T + HV + 11)
    v2 = _run(args, ctab, scale, "v2")
    v1 = _run(args, ctab, scale, "v1")
    exp = wy_dqkg_expected(*args, ch, scale=scale)
    errs = {n: rel_err(o, e) for n, o, e in zip(WY_NAMES, v2, exp, strict=True)}
    errs1 = {n: rel_err(o, e) for n, o, e in zip(WY_NAMES, v1, exp, strict=True)}
    diff = {n: rel_err(a, b) for n, a, b in zip(WY_NAMES, v2, v1, strict=True)}
    print(f"\n{B=} {T=} {HQK=} {HV=} {lengths=}: v2 vs fp64 " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
          + " | v1 vs fp64 " + " ".join(f"{n}={e:.2e}" for n, e in errs1.items())
          + " | v2 vs v1 " + " ".join(f"{n}={e:.2e}" for n, e in diff.items()))
    for n in WY_NAMES:
        assert torch.isfinite(v2[WY_NAMES.index(n)]).all(), n
        assert errs[n] < WY_TOL[n], f"{n}: v2 rel err vs fp64 {errs[n]:.3e} >= {WY_TOL[n]:.1e}"
        assert diff[n] < V1_TOL[n], f"{n}: v2 vs v1 rel diff {diff[n]:.3e} >= {V1_TOL[n]:.1e}"
    for a, b, n in zip(v2, v1, WY_NAMES, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, n


def test_v2_deterministic():
    require_gpu()
    args, _, ctab, scale, _ = wy_problem(1, 0, 2, 8, [300, 1, 500, 0, 64], seed=3)
    a, b = _run(args, ctab, scale, "v2"), _run(args, ctab, scale, "v2")
    for n, x, y in zip(WY_NAMES, a, b, strict=True):
        assert torch.equal(x, y), n


@pytest.mark.parametrize("B,T,HQK,HV,lengths,gate,l2", [(1, 1000, 2, 4, None, "softplus", True),
                                                         (1, 0, 1, 2, [37, 0, 64, 99, 1], "safe", False)])
def test_whole_backward_with_v2(B, T, HQK, HV, lengths, gate, l2, monkeypatch):
    require_gpu()
    from test_backward_gpu import GRAD_NAMES, GRAD_TOL, _expected, _grads, _problem

    monkeypatch.setenv("CULA_SM100_WY_DQKG", "v2")
    p = _problem(B, T, HQK, HV, lengths, gate, seed=T + HV + len(lengths or []), l2=l2)
    ours = _grads("sm100", monkeypatch, *p, gate=gate, l2=l2, lengths=lengths)
    exp = _expected(*p, gate=gate, l2=l2, lengths=lengths)
    errs = {n: rel_err(ours[n], exp[n]) for n in GRAD_NAMES if exp.get(n) is not None}
    print(f"\nv2 whole backward {B=} {T=} {HQK=} {HV=} {lengths=} {gate} l2={l2}: "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < GRAD_TOL, f"{n}: rel err {e:.3e} >= {GRAD_TOL:.1e}"


def test_v2_memcheck_clean_on_odd_shapes():
    import shutil

    require_gpu()
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    proc = run_memcheck(CULA_SM100_WY_DQKG="v2")
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout
