"""CPU: the sm100 backward's pipeline (launch.chunk_kda_backward: recompute, dav, dhu, chunk_wy_dqkg, intra,
finish, in that order) run with every kernel stage replaced by a stand-in in the kernel's calling convention: the
PyTorch forms of tests/sm100/torch_stages.py (dAqk / local dv, the reverse state recurrence, the intra-chunk backward,
the gate / L2-norm / beta backward) and chunk_wy_dqkg's fp64 autograd oracle, fed the reference's intermediates;
against the reference backward (torch.func.vjp through the reference forward) in fp64. This checks the decomposition,
the pipeline's wiring and every PyTorch stage; the kernels themselves are checked on the GPU (test_backward_gpu.py).
Also: the backend's declining reasons, and every backward kernel compiles for sm_90a and sm_100a."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backward_cases import reference_intermediates, wy_dqkg_expected
import torch_stages
from cula_core import reference_backend

HERE = Path(__file__).resolve().parent
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")


def _inputs(B, T, HQK, HV, *, gate, seed, h0, N=None):
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=d)

    q, k, v = r(B, T, HQK, 128), r(B, T, HQK, 128), r(B, T, HV, 128)
    if gate == "precomputed":
        g = F.logsigmoid(r(B, T, HV, 128)) / 4
        A_log = dt_bias = None
    else:
        g, A_log, dt_bias = r(B, T, HV, 128), 0.3 * r(HV), 0.5 * r(HV * 128)
    beta = r(B, T, HV)
    init = 0.1 * r(N if N is not None else B, HV, 128, 128) if h0 else None
    return q, k, v, g, beta, A_log, dt_bias, init


CASES = [
    # (B, T, HQK, HV, lengths or None, gate, l2norm, beta activation, h0 / dht)
    (2, 100, 1, 2, None, "precomputed", False, "none", False),
    (1, 64, 2, 2, None, "softplus", True, "sigmoid", True),
    (1, 63, 1, 4, None, "safe", True, "2sigmoid", True),
    (1, 200, 1, 2, [37, 0, 64, 99], "softplus", False, "sigmoid", True),
]


def _stand_in_stages(monkeypatch, it, bounds):
    """Every stage launch.chunk_kda_backward calls, replaced by its PyTorch form in the kernel's calling convention
    (token layouts, the tables' arguments ignored; intra adds in place and reverse-cumsums dG); recompute returns
    the reference's intermediates `it`."""
    from cula_sm100.backward import launch

    ch = torch_stages.chunks_for(tuple(bounds), torch.device("cpu"))

    def dav(do, v_new, Aqk, ctab):
        dA, dv = torch_stages.dav(do, Aqk, v_new, ch)
        return ch.unchunk(dA.permute(0, 2, 1, 3)), ch.unchunk(dv).to(do.dtype)

    def dhu(qg, kg, w, G, do, dv, dht, ctab, stab, *, want_dh0, bv):
        assert bv in (32, 64)
        dh, dh0, dv2 = torch_stages.dhu(qg, kg, w, G, do, ch.chunk(dv).float(), dht, ch, scale=1.0,
                                        want_dh0=want_dh0)  # qg carries the scale
        return dh, dv2, dh0

    def wy(q, k, v, v_new, G, beta, Akk, h, do, dh, dv, ctab, *, scale):
        return wy_dqkg_expected(q, k, v, v_new, G, beta, Akk, h, do, dh, dv, ch, scale=scale)

    def intra(q, k, G, beta, dA, dL, dq, dk, dbeta, dG, ctab, *, scale):
        parts = torch_stages.intra(q, k, G, beta, ch.chunk(dA).permute(0, 2, 1, 3), dL, ch, scale=scale)
        for out, part in zip((dq, dk, dbeta, dG), parts, strict=True):
            out += part.to(out.dtype)
        dG.copy_(torch_stages.reverse_cumsum(dG, ch))

    def finish(*args, **kw):
        return torch_stages.finish(*args[:-1], ch, summed=True, **kw)

    order = []

    def logged(name, fn):
        return lambda *a, **kw: order.append(name) or fn(*a, **kw)

    def recompute(*a, scale, **kw):
        return it, it.q.repeat_interleave(it.g_cumsum.shape[1] // it.q.shape[1], dim=1) * torch.exp(it.g_cumsum) * scale

    monkeypatch.setattr(launch, "recompute", logged("recompute", recompute))
    for name, fn in (("chunk_bwd_dav", dav), ("chunk_bwd_dhu", dhu), ("chunk_wy_dqkg", wy),
                     ("chunk_bwd_intra", intra), ("finish", finish)):
        monkeypatch.setattr(launch, name, logged(name, fn))
    return launch, order


@pytest.mark.parametrize("B,T,HQK,HV,lengths,gate,l2,act,states", CASES)
def test_pipeline_matches_reference(B, T, HQK, HV, lengths, gate, l2, act, states, monkeypatch):
    N = len(lengths) if lengths else None
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(B, T, HQK, HV, gate=gate, seed=B * T + HV, h0=states, N=N)
    if not l2:  # inputs the forward takes as final: unit-norm keys keep the recurrence stable
        from cula_core.reference import l2norm
        q, k = l2norm(q), l2norm(k)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if lengths else None
    if cu is not None:
        assert int(cu[-1]) == T
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(B, T, HV, 128, generator=gen, dtype=torch.float64)
    dht = torch.randn(N or B, HV, 128, 128, generator=gen, dtype=torch.float64) if states else None
    scale = 128 ** -0.5
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=l2, gate=gate, lower_bound=-5.0 if gate == "safe" else None,
              beta_activation=act)
    expected = reference_backend.chunk_kda_backward(do, dht, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu, **kw)
    it = reference_intermediates(q, k, v, g, beta, A_log, dt_bias, h0, cu, **kw)
    bounds = torch_stages.bounds_of(B, T, cu, cu)
    launch, order = _stand_in_stages(monkeypatch, it, bounds)
    marks = []
    ours = launch.chunk_kda_backward(do, dht, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu, **kw, marks=marks.append)
    assert order == ["recompute", "chunk_bwd_dav", "chunk_bwd_dhu", "chunk_wy_dqkg", "chunk_bwd_intra", "finish"]
    assert marks == ["begin", "start", "dav", "dhu", "chunk_wy_dqkg", "intra", "finish"]
    for name, a, b in zip(NAMES, ours, expected, strict=True):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert err < 1e-4, f"{name}: rel err {err:.2e}"


def test_chunks_roundtrip_and_recurrence_steps():
    bounds = (0, 1, 1, 130, 194)
    ch = torch_stages.Chunks(bounds, "cpu")
    assert ch.NC == 1 + 3 + 1 and ch.N == 4
    x = torch.randn(194, 2, 3)
    assert torch.equal(ch.unchunk(ch.chunk(x)), x)
    xc = ch.chunk(x)
    assert torch.equal(xc[-1], torch.zeros_like(xc[-1]))          # the spare chunk is zero
    assert torch.equal(ch.chunk(x, g_rows=True)[3, 10:], x[129].expand(54, 2, 3))  # 2-token chunk 128..129
    # step 0 takes every sequence's last chunk; the empty sequence never has one
    assert ch.steps[0].tolist() == [0, ch.NC, 3, 4]
    assert ch.steps[2].tolist() == [ch.NC, ch.NC, 1, ch.NC]


def test_declines_with_reasons():
    from cula_core.backend import CallConfig, DeviceInfo
    from cula_sm100 import backward

    def call(**kw):
        base = dict(op="chunk_kda_backward", device=DeviceInfo("cuda", 0, (9, 0)), dtype=torch.bfloat16, K=128, V=128,
                    HQK=2, HV=4, gate="softplus", options={})
        base.update(kw)
        return CallConfig(**base)

    assert "K=V=128" in backward.unsupported_reason(call(K=64))
    assert "bf16" in backward.unsupported_reason(call(dtype=torch.float16))
    assert "CUDA" in backward.unsupported_reason(call(device=DeviceInfo("cpu")))
    assert "beta_activation" in backward.unsupported_reason(call(options={"beta_activation": "relu"}))
    assert backward.unsupported_reason(call(op="kda_decode")) is not None


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "safe"])
@pytest.mark.parametrize(("HQK", "HV"), [(1, 1), (2, 4), (4, 16)])
def test_serves_what_the_forward_serves(gate, HQK, HV, monkeypatch):
    from cula_core.backend import CallConfig, DeviceInfo
    from cula_sm100 import forward
    from cula_sm100.backend import backend

    monkeypatch.setattr(forward, "dsl_missing", lambda: None)
    for cap in ((9, 0), (10, 0)):
        c = CallConfig(op="chunk_kda_backward", device=DeviceInfo("cuda", 0, cap), dtype=torch.bfloat16, K=128,
                       V=128, HQK=HQK, HV=HV, T=1000, gate=gate, varlen=True, requires_grad=True,
                       options=dict(use_qk_l2norm_in_kernel=True, beta_activation="sigmoid"))
        assert backend.unsupported_reason(c) is None


@functools.cache
def _compile_runs() -> dict:
    """Both architectures' compile runs (backward_cases.py in a subprocess each), started together: the two
    tests below then wait on their own, and the pair takes about the time of one."""
    return {arch: subprocess.Popen([sys.executable, str(HERE / "backward_cases.py"), arch], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for arch in ("sm_90a", "sm_100a")}


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernels_compile(arch):
    proc = _compile_runs()[arch]
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    from backward_cases import kernels

    assert sum(line.startswith("compiled ") for line in out.splitlines()) == len(kernels()), out


def test_dhu_slice_width_dispatch(monkeypatch):
    """chunk_bwd_dhu runs V slices of 32 columns up to DHU_NARROW_MAX_PAIRS busy (sequence, head) chains and of 64
    above (the H100 stage times in launch.py), busy counted over the longest sequence; an explicit `bv` wins; each
    width has its own kernel configuration. The launch stubbed (CPU tensors; nothing launches)."""
    import torch

    from cula_sm100.backward import launch

    assert launch.DHU_NARROW_MAX_PAIRS == 64
    assert [launch.dhu_slice_width(N, HV) for N, HV in ((1, 32), (2, 32), (1, 64), (2, 64), (10, 32))] == \
        [32, 32, 32, 64, 64]
    # busy sequences over the longest chain: N for equal lengths, ~1 when one sequence holds most chunks
    assert launch.busy_sequences((0, 8192, 16384)) == 2.0
    skewed = (0, *range(51, 51 * 20, 51), 8192)  # 19 sequences of 51 tokens, one of 7223
    assert abs(launch.busy_sequences(skewed) - (19 + 113) / 113) < 1e-9
    assert launch.dhu_slice_width(launch.busy_sequences(skewed), 32) == 32
    uniform = (*range(0, 8192, 820), 8192)  # 10 sequences of 820 tokens and one of 12
    assert launch.dhu_slice_width(launch.busy_sequences(uniform), 32) == 64
    assert launch.busy_sequences((0, 0)) == 0.0
    asked = []
    monkeypatch.setattr(launch.fwd, "launch_kernel", lambda kernel, *a: asked.append(kernel))
    for N, HV, bv, want in ((2, 32, None, 32), (2, 64, None, 64), (2, 32, 64, 64), (2, 64, 32, 32)):
        TT = 3 * N
        x = torch.zeros(TT, HV, 128, dtype=torch.bfloat16)
        G = torch.zeros(TT, HV, 128)
        ctab, stab = torch.zeros(N, 2, dtype=torch.int32), torch.zeros(N, 3, dtype=torch.int32)
        launch.chunk_bwd_dhu(x, x, x, G, x, x, None, ctab, stab, want_dh0=False, bv=bv, stages=1)
        assert asked[-1] == launch.dhu_kernel(False, False, want, 1), (N, HV, bv)


def test_dhu_stages_dispatch():
    """chunk_bwd_dhu takes 2 pipeline stages (one CTA per SM, each tile loaded a chunk ahead) when its grid fits
    the SMs and 1 above (walk_stages, chunk_delta_h's rule too); the two are distinct kernel configurations."""
    from cula_sm100.backward import launch

    assert [launch.fwd.walk_stages(ctas, 132) for ctas in (1, 64, 132, 133, 1024)] == [2, 2, 2, 1, 1]
    assert launch.dhu_kernel(True, True, 32, 1) != launch.dhu_kernel(True, True, 32, 2)


def test_delta_h_grid_width_matches_the_kernel():
    """chunk_delta_h's stage pick counts its CTAs with launch.DELTA_H_BV columns of V each: the kernel's own BV."""
    pytest.importorskip("cutlass")
    from cula_sm100.forward import chunk_delta_h, launch

    assert launch.DELTA_H_BV == chunk_delta_h.ChunkDeltaH.BV
