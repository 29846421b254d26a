"""CPU: the fused chunk_intra + recompute_w_u kernel (chunk_intra_wu.py) and its raw-gate variant
(chunk_intra_wu_gate.py: gate + cumsum in the same CTA) compile for sm_90a and sm_100a with fake pointers through
cula_core.cute_runtime, at the configurations of launch.intra_wu_kernel / launch.intra_wu_gate_kernel (two processes
started together: the time of one arch), the
gate variant for every value of every compile key it adds (gate mode, g dtype, A_log / dt_bias present or not,
beta dtype and activation); the shared-memory plan keeps 2 CTAs per SM; launch.chunk_intra_wu and
launch.chunk_intra_wu_gate allocate and launch as the stages they replace do, and forward takes the fused gate
stage (kernels and launches stubbed: nothing runs). Two of the gate keys also compile with
qg_out (qg = bf16(q e^G) and G's last rows out; its host side: test_fused_qg_cpu.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")
# chunk_intra_wu_gate's compile keys (gate, g, A_log, dt_bias dtypes, has A_log, has dt_bias, lower_bound, beta dtype,
# beta activation): together they take every value of every key (the forward's main one first)
GATE_KEYS = (("softplus", "f32", "f32", "f32", True, True, None, "bf16", "none"),
             ("precomputed", "f32", "f32", "f32", False, False, None, "bf16", "sigmoid"),
             ("softplus", "bf16", "bf16", "f32", True, False, None, "f32", "none"),
             ("safe", "f32", "f32", "bf16", False, True, -5.0, "bf16", "2sigmoid"),
             ("safe", "f16", "f32", "f32", True, True, -2.0, "f32", "sigmoid"),
             ("precomputed", "bf16", "f32", "f32", False, False, None, "f32", "none"))
# compiled with qg_out as well (the forward's main key with qg_out: sm100_compile_check.py)
QG_KEYS = (GATE_KEYS[3], GATE_KEYS[5])
COMPILE = ("import sys, torch\n"
           "from cula_sm100.runtime import compile_kernel\n"
           "arch = sys.argv[1]\n"
           "from cula_sm100.forward.launch import intra_wu_kernel\n"
           "for beta_dtype, act in ((torch.bfloat16, 'sigmoid'), (torch.float32, 'none')):\n"
           "    compile_kernel(intra_wu_kernel(beta_dtype, act), arch)\n"
           "    print('compiled', beta_dtype, act, flush=True)\n"
           "from cula_sm100.forward.launch import intra_wu_gate_kernel\n"
           f"for key in {GATE_KEYS!r}:\n"
           "    gate, g, a, b, has_a, has_b, lb, beta, act = key\n"
           "    dt = {'f32': torch.float32, 'bf16': torch.bfloat16, 'f16': torch.float16}\n"
           "    kernel = intra_wu_gate_kernel(gate, dt[g], dt[a], dt[b], has_a, has_b, lb, dt[beta], act)\n"
           "    compile_kernel(kernel, arch)\n"
           "    print('compiled', key, flush=True)\n"
           f"for key in {QG_KEYS!r}:\n"
           "    gate, g, a, b, has_a, has_b, lb, beta, act = key\n"
           "    kernel = intra_wu_gate_kernel(gate, dt[g], dt[a], dt[b], has_a, has_b, lb, dt[beta], act, True)\n"
           "    compile_kernel(kernel, arch)\n"
           "    print('compiled qg_out', key, flush=True)\n")

needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")


def _compile(arch):
    return subprocess.run([sys.executable, "-c", COMPILE, arch], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled_by_arch():
    with ThreadPoolExecutor(len(ARCHS)) as pool:  # the archs' compiles run side by side
        return dict(zip(ARCHS, pool.map(_compile, ARCHS), strict=True))


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_kernel_compiles(arch, compiled_by_arch):
    proc = compiled_by_arch[arch]
    rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert rc == 0, stdout[-2000:] + stderr[-4000:]
    assert stdout.count("compiled ") == 2 + len(GATE_KEYS) + len(QG_KEYS), stdout


@needs_dsl
def test_shared_memory_plan():
    """Region R holds the score GEMMs' decayed keys, then bk | L | Aqk; the whole CTA fits 2 per SM (228 KiB per
    SM, 1 KiB reserved and 1 KiB static per CTA); the pieces of R keep the alignments their accesses need."""
    from cula_sm100.forward.chunk_intra_wu import ChunkIntraWU as C

    BT, K = C.BT, C.K
    assert C.R_BYTES >= C.Y_BLOCKS * C.BC * K * 2
    assert C.BK_BYTES == BT * K * 2 and C.L_BYTES == BT * C.L_STRIDE * 4 and C.AQK_BYTES == BT * BT * 2
    assert C.BK_BYTES % 1024 == 0 and (C.BK_BYTES + C.L_BYTES) % 1024 == 0  # swizzled tiles start on 1 KiB
    assert C.L_BYTES >= BT * K * 2  # w is staged where L was
    sG = BT * C.G_STRIDE * 4
    assert sG >= BT * K * 2 + 4 * C.BC * C.D_STRIDE * 4  # u staged where G was, past nothing still needed
    total = 2 * BT * K * 2 + sG + C.R_BYTES + BT * 4
    assert 2 * (total + 2048) <= 228 * 1024, total
    assert C.R_BYTES >= BT * K * 4  # chunk_intra_wu_gate: the raw g rows (fp32 at most) are loaded into R


def _stub_launches(monkeypatch, launch, kernel_cache: str):
    """launch's kernel function `kernel_cache` returns ("kernel", *key) and launch_kernel records its calls
    (returned)."""
    calls = []
    monkeypatch.setattr(launch, kernel_cache, lambda *key: ("kernel", *key))
    monkeypatch.setattr(launch, "launch_kernel", lambda kern, dtypes, tensors, scalars: calls.append(
        (kern, dtypes, tensors, scalars)))
    return calls


def _stage_inputs():
    """(TT, HQK, HV, q, k, v, chunk table) on the CPU: 70 tokens in chunks of 64 and 6."""
    TT, HQK, HV = 70, 2, 4
    q = k = torch.zeros(TT, HQK, 128, dtype=torch.bfloat16)
    v = torch.zeros(TT, HV, 128, dtype=torch.bfloat16)
    return TT, HQK, HV, q, k, v, torch.tensor([[0, 64], [64, 6]], dtype=torch.int32)


def test_wrapper_allocates_and_launches(monkeypatch):
    """Outputs [TT, HV, 64] x 2 and [TT, HV, 128] x 3 bf16 on G's device; the kernel gets (q, k, v, G, beta, the 5
    outputs, chunk table) and (TT, NC, HQK, HV, scale), is keyed by (beta dtype, activation); no launch without
    chunks."""
    from cula_sm100.forward import launch

    calls = _stub_launches(monkeypatch, launch, "intra_wu_kernel")
    TT, HQK, HV, q, k, v, ctab = _stage_inputs()
    bf = torch.bfloat16
    G = torch.zeros(TT, HV, 128)
    beta = torch.zeros(TT, HV)
    outs = launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=0.5, beta_activation="sigmoid")
    assert [tuple(o.shape) for o in outs] == [(TT, HV, 64)] * 2 + [(TT, HV, 128)] * 3
    assert all(o.dtype == bf for o in outs)
    (kern, dtypes, tensors, scalars), = calls
    assert kern == ("kernel", torch.float32, "sigmoid") and dtypes == launch.intra_wu_dtypes(torch.float32)
    assert tensors[:5] == (q, k, v, G, beta) and all(a is b for a, b in zip(tensors[5:10], outs, strict=True))
    assert tensors[10] is ctab and scalars == (TT, 2, HQK, HV, 0.5)
    assert [t.dtype for t in tensors] == list(dtypes)
    launch.chunk_intra_wu(q, k, v, G, beta, ctab[:0], scale=0.5, beta_activation="none")
    assert len(calls) == 1


def test_gate_wrapper_allocates_and_launches(monkeypatch):
    """launch.chunk_intra_wu_gate: G [TT, HV, 128] fp32 and the five outputs of chunk_intra_wu; the kernel gets (q, k,
    v, g, A_log, dt_bias, G, beta, the 5 outputs, chunk table, qg absent) and (TT, NC, HQK, HV, scale), keyed by
    gate_cumsum's key (absent A_log / dt_bias: fp32 dtype, not present; lower_bound only for the safe gate) then beta
    dtype, activation and qg_out (False); no launch without chunks. (qg_out: test_fused_qg_cpu.py.)"""
    from cula_sm100.forward import launch

    calls = _stub_launches(monkeypatch, launch, "intra_wu_gate_kernel")
    TT, HQK, HV, q, k, v, ctab = _stage_inputs()
    bf = torch.bfloat16
    g = torch.zeros(TT, HV, 128, dtype=bf)
    A_log = torch.zeros(HV)
    beta = torch.zeros(TT, HV, dtype=bf)
    outs = launch.chunk_intra_wu_gate(q, k, v, g, A_log, None, beta, ctab, gate="softplus", lower_bound=-5.0,
                                      scale=0.5, beta_activation="sigmoid")
    assert [tuple(o.shape) for o in outs] == [(TT, HV, 128)] + [(TT, HV, 64)] * 2 + [(TT, HV, 128)] * 3
    assert [o.dtype for o in outs] == [torch.float32] + [bf] * 5
    (kern, dtypes, tensors, scalars), = calls
    assert kern == ("kernel", "softplus", bf, torch.float32, torch.float32, True, False, None, bf, "sigmoid", False)
    assert dtypes == launch.intra_wu_gate_dtypes(bf, torch.float32, torch.float32, bf)
    assert tensors[:6] == (q, k, v, g, A_log, None) and tensors[7] is beta and tensors[13] is ctab
    assert tensors[14] is None  # qg: not written without qg_out
    assert tensors[6] is outs[0] and all(a is b for a, b in zip(tensors[8:13], outs[1:], strict=True))
    assert scalars == (TT, 2, HQK, HV, 0.5)
    assert [None if t is None else t.dtype for t in tensors] == [None if t is None else d
                                                                 for t, d in zip(tensors, dtypes, strict=True)]
    launch.chunk_intra_wu_gate(q, k, v, g, None, None, beta, ctab, gate="safe", lower_bound=-5.0, scale=0.5,
                               beta_activation="none")
    assert calls[-1][0][1:8] == ("safe", bf, torch.float32, torch.float32, False, False, -5.0)
    launch.chunk_intra_wu_gate(q, k, v, g, None, None, beta, ctab[:0], gate="safe", lower_bound=-5.0, scale=0.5,
                               beta_activation="none")
    assert len(calls) == 2


def test_forward_makes_G_in_chunk_intra_wu_gate(monkeypatch):
    """forward: chunk_intra_wu_gate alone makes G (returned in Intermediates) and the five outputs; gate_cumsum and
    chunk_intra_wu (the backward's recompute) do not run. Stages stubbed (CPU tensors; nothing launches)."""
    from cula_sm100.forward import launch

    B, T, HQK, HV = 1, 70, 2, 4
    stages = []
    G = torch.full((B * T, HV, 128), 3.0)
    five = tuple(torch.zeros(1) for _ in range(5))
    monkeypatch.setattr(launch, "chunk_intra_wu_gate", lambda *a, **kw: stages.append("fused") or (G, *five))
    monkeypatch.setattr(launch, "gate_cumsum", lambda *a, **kw: stages.append("gate_cumsum") or G)
    monkeypatch.setattr(launch, "chunk_intra_wu", lambda q, k, v, G_, *a, **kw: stages.append(
        ("chunk_intra_wu", G_ is G)) or five)
    monkeypatch.setattr(launch, "chunk_delta_h", lambda *a, **kw: (torch.zeros(1), torch.zeros(B * T, HV, 128), None))
    monkeypatch.setattr(launch, "fwd_o", lambda *a, **kw: torch.zeros(B * T, HV, 128))
    bf = torch.bfloat16
    q = k = torch.zeros(B, T, HQK, 128, dtype=bf)
    v = torch.zeros(B, T, HV, 128, dtype=bf)
    g = torch.zeros(B, T, HV, 128)
    beta = torch.zeros(B, T, HV, dtype=bf)
    _, _, it = launch.forward(q, k, v, g, beta, None, None, None, None, None, scale=0.1, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, gate="precomputed", lower_bound=None,
                              beta_activation="none")
    assert stages == ["fused"]
    assert it.g_cumsum is G and it.Aqk is five[0] and it.kg is five[4]
