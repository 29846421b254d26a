"""GPU: the opt-in fused chunk_delta_h + fwd_o (forward/chunk_delta_h_o.py, CULA_SM100_FUSED_O=1) against the
unfused forward (chunk_delta_h then fwd_o) and the fp32 reference; the public op with the switch on (and its
backward, which recomputes through the unfused forward); compute-sanitizer on odd shapes.

Written in a session with no GPU: compiled only until these run. What the fused kernel must show before it is
promoted: o and the final state BITWISE equal to the unfused forward's (same bf16 roundings of h, v_new and qg,
the same MMA k-block order per output element, the same fp32 scale step), hence within the reference tolerance;
then a speed-up in `tools/bench/train_fwd.py --fused-o`.

Run this file as a program (`python tests/sm100/test_sm100_fused_o_gpu.py`) for the memcheck cases alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sm100_cases import TOL, make_inputs, reference, rel_err, require_gpu, seqlens_to_cu

pytestmark = pytest.mark.gpu

# (B, T, HQK, HV): T = 1, 63, 65 (rows past the chunk end), 1000, at GVA ratio 1, 2 and 4
FIXED = [(1, 1, 2, 2), (2, 63, 2, 4), (1, 65, 2, 8), (2, 1000, 2, 4), (1, 1000, 4, 4), (1, 300, 1, 4)]
# varlen: length-1 and empty sequences, lengths around the chunk size
VARLEN = [[1, 100, 64], [17, 1, 64, 65, 200], [5, 1, 63, 64, 65, 130, 0, 7, 300, 20], [0, 1, 0]]
GATE = dict(gate="precomputed", lower_bound=None, beta_activation="none", use_qk_l2norm_in_kernel=False)


def _run(q, k, v, g, beta, h0, cu, cu_cpu, final, fused):
    from cula_sm100.forward import launch

    o, ht, it = launch.forward(q, k, v, g, beta, None, None, h0, cu, cu_cpu, scale=q.shape[-1] ** -0.5,
                               output_final_state=final, fused_o=fused, **GATE)
    return o, ht, it


def _compare(q, k, v, g, beta, h0, cu, cu_cpu, final, label):
    o1, ht1, it1 = _run(q, k, v, g, beta, h0, cu, cu_cpu, final, False)
    o2, ht2, it2 = _run(q, k, v, g, beta, h0, cu, cu_cpu, final, True)
    assert it2.h is None and it2.v_new is None and it1.h is not None
    o_ref, ht_ref, _ = reference(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0, cu_seqlens=cu)
    e_o = rel_err(o2, o_ref)
    line = f"\n{label}: fused o={e_o:.2e} unfused o={rel_err(o1, o_ref):.2e}"
    if final:
        line += f" ht={rel_err(ht2, ht_ref):.2e}"
    print(line)
    assert torch.equal(o2, o1), line + f" | fused vs unfused o {rel_err(o2, o1):.2e} (expected bitwise)"
    if o2.numel():
        assert e_o < TOL["o"], line
    if final:
        assert torch.equal(ht2, ht1), line + f" | fused vs unfused ht {rel_err(ht2, ht1):.2e} (expected bitwise)"
        assert rel_err(ht2, ht_ref) < TOL["ht"], line
    else:
        assert ht2 is None


@pytest.mark.parametrize("states", ["none", "h0", "ht", "h0+ht"])
@pytest.mark.parametrize("B,T,HQK,HV", FIXED)
def test_fused_fixed_length(B, T, HQK, HV, states):
    require_gpu()
    q, k, v, g, beta, h0 = make_inputs(B, T, HQK, HV, seed=T + HV, h0=True)
    _compare(q, k, v, g, beta, h0 if "h0" in states else None, None, None, "ht" in states,
             f"{B=} {T=} {HQK=} {HV=} {states}")


@pytest.mark.parametrize("states", ["none", "h0+ht"])
@pytest.mark.parametrize("lengths", VARLEN, ids=lambda x: f"{len(x)}seqs-{sum(x)}")
def test_fused_varlen(lengths, states):
    require_gpu()
    T = sum(lengths)
    cu, cu_cpu = seqlens_to_cu(lengths)
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 8, seed=len(lengths), h0=True, N=len(lengths))
    _compare(q, k, v, g, beta, h0 if "h0" in states else None, cu, cu_cpu, "ht" in states, f"varlen {lengths} {states}")


def test_fused_strong_decay_long():
    """Strong decay over 16 chunks (exp(G) far below 1: qg's bf16 rounding at small magnitudes)."""
    require_gpu()
    q, k, v, g, beta, h0 = make_inputs(1, 1000, 2, 4, seed=5, decay="strong", h0=True)
    _compare(q, k, v, g, beta, h0, None, None, True, "strong decay T=1000")


def _fla_o_ht(q, k, v, g, beta, kw):
    """FLA 0.6.0's chunk_kda (o, final state) on the same call, or None when FLA is not installed."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    fkw = {name: x for name, x in kw.items() if name != "cu_seqlens_cpu"}
    if "cu_seqlens" in fkw:
        fkw["cu_seqlens"] = fkw["cu_seqlens"].long()  # FLA takes int64 offsets
    with torch.no_grad():
        return fla_chunk_kda(q, k, v, g, beta, **fkw)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_public_op_with_fused_o(varlen, monkeypatch):
    """cula.chunk_kda on sm100 with CULA_SM100_FUSED_O=1 (softplus gate with A_log / dt_bias, q/k L2 norm, h0 and
    ht, GVA 2) bitwise against the same call with the switch off, within tolerance of the reference backend and of
    FLA 0.6.0 when installed; with autograd on, o and the q / k / v gradients equal the unfused run's (the
    backward never uses the fused kernel: its recompute calls chunk_delta_h itself)."""
    require_gpu()
    import cula_core

    lengths = [1, 64, 100, 168] if varlen else None
    B, T, HV = (1, sum(lengths), 4) if varlen else (2, 200, 4)
    q, k, v, g, beta, h0 = make_inputs(B, T, 2, HV, seed=13, h0=True, N=len(lengths) if varlen else None)
    kw = dict(A_log=torch.log(torch.arange(1.0, HV + 1, device="cuda")), dt_bias=torch.zeros(HV * 128, device="cuda"),
              use_gate_in_kernel=True, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if varlen:
        kw["cu_seqlens"], kw["cu_seqlens_cpu"] = seqlens_to_cu(lengths)

    def run(backend, fused, grad=False):
        monkeypatch.setenv("CULA_BACKEND", backend)
        monkeypatch.setenv("CULA_SM100_FUSED_O", fused)
        if not grad:
            with torch.no_grad():
                return cula_core.chunk_kda(q, k, v, g, beta, **kw)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o, ht = cula_core.chunk_kda(*leaves, g, beta, **kw)
        (o.float().square().sum() + ht.square().sum()).backward()
        return o.detach(), [x.grad for x in leaves]

    (o2, ht2), (o1, ht1), (o_ref, ht_ref) = run("sm100", "1"), run("sm100", "0"), run("reference", "0")
    line = (f"\nvarlen={varlen}: fused o={rel_err(o2, o_ref):.2e} ht={rel_err(ht2, ht_ref):.2e} | "
            f"unfused o={rel_err(o1, o_ref):.2e}")
    assert torch.equal(o2, o1) and torch.equal(ht2, ht1), line + f" | fused vs unfused o {rel_err(o2, o1):.2e}"
    assert rel_err(o2, o_ref) < TOL["o"] and rel_err(ht2, ht_ref) < TOL["ht"], line
    (og2, grads2), (og1, grads1) = run("sm100", "1", grad=True), run("sm100", "0", grad=True)
    assert torch.equal(og2, og1), line
    for name, a, b in zip("qkv", grads2, grads1, strict=True):
        assert torch.equal(a, b), f"d{name}: fused run {rel_err(a, b):.2e} from the unfused run"
    fla = _fla_o_ht(q, k, v, g, beta, kw)
    if fla is None:
        print(line + " (FLA not installed)")
        return
    print(line + f" | fused vs FLA o={rel_err(o2, fla[0]):.2e} ht={rel_err(ht2, fla[1]):.2e}")
    assert rel_err(o2, fla[0]) < TOL["o"] and rel_err(ht2, fla[1]) < TOL["ht"]


# ------------------------------------------------------------------ compute-sanitizer


def memcheck_cases():
    """The fused kernel (through chunk_kda with the switch on, as the public op calls it) on odd shapes: T = 1, 63,
    65, 130, N = 1, GVA 1 / 2 / 4, varlen with empty and length-1 sequences (first, last, alone), with and without
    states."""
    from cula_sm100.forward import launch

    assert launch.fused_o_enabled(), "run with CULA_SM100_FUSED_O=1"
    n = 0
    kw = dict(scale=0.1, gate="precomputed", lower_bound=None, beta_activation="none", use_qk_l2norm_in_kernel=False)
    for T, HQK, HV, B in ((1, 1, 1, 1), (63, 2, 4, 2), (65, 1, 4, 1), (130, 2, 2, 1)):
        q, k, v, g, beta, h0 = make_inputs(B, T, HQK, HV, seed=T, h0=True)
        for h, final in ((None, False), (h0, True)):
            launch.chunk_kda(q, k, v, g, beta, None, None, h, None, None, output_final_state=final, **kw)
            n += 1
    for lengths in ([0, 1, 63, 0, 65, 1], [0, 1], [1]):
        cu, cu_cpu = seqlens_to_cu(lengths)
        q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 8, seed=1, h0=True, N=len(lengths))
        for h, final in ((None, False), (h0, True)):
            launch.chunk_kda(q, k, v, g, beta, None, None, h, cu, cu_cpu, output_final_state=final, **kw)
            n += 1
    torch.cuda.synchronize()
    print(f"{n} fused cases ok")


def test_memcheck_fused_o_on_odd_shapes():
    """memcheck_cases (this file as a program) under compute-sanitizer with CULA_SM100_FUSED_O=1 (the forward's
    other kernels are covered by sm100_memcheck_case.py, which runs launch.forward: never the fused kernel)."""
    require_gpu()
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    here = Path(__file__).resolve().parent
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
           "--report-api-errors", "no", sys.executable, str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=here,
                          env=dict(os.environ, CULA_SM100_FUSED_O="1"))
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[:6000] + proc.stderr[-3000:]
    assert "fused cases ok" in proc.stdout
    assert "ERROR SUMMARY: 0 errors" in proc.stdout


if __name__ == "__main__":
    memcheck_cases()
