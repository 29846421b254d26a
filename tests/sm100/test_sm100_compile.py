"""CPU: every cula-sm100 forward kernel compiles (CuTe DSL, fake pointers) for sm_90a and sm_100a.

The two architectures compile in two processes started together (one fixture), so the test takes the time of
one (about a minute), not of both."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sm100_compile_check import KERNELS

HERE = Path(__file__).resolve().parent
ARCHS = ("sm_90a", "sm_100a")


@pytest.fixture(scope="module")
def compiled_by_arch():
    procs = {arch: subprocess.Popen([sys.executable, str(HERE / "sm100_compile_check.py")],
                                    env=dict(os.environ, CUTE_DSL_ARCH=arch), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for arch in ARCHS}
    out = {}
    for arch, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()  # this test's own child
            stdout, stderr = proc.communicate()
            stderr += "\ntimed out after 600 s"
        out[arch] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile(arch, compiled_by_arch):
    rc, stdout, stderr = compiled_by_arch[arch]
    assert rc == 0, stdout[-2000:] + stderr[-4000:]
    compiled = [line for line in stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(KERNELS), stdout


def test_chunk_intra_switch(monkeypatch):
    """CULA_SM100_CHUNK_INTRA picks chunk_intra's variant per call (v1 when unset or empty), rejects other values
    with a message naming the variable, and the compiled-kernel cache keys on the variant (compile stubbed:
    what is cached is the object handed to cute.compile)."""
    import torch

    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from cula_sm100.forward import launch

    for env, want in ((None, "v1"), ("", "v1"), ("v1", "v1"), ("v2", "v2")):
        if env is None:
            monkeypatch.delenv(launch.INTRA_ENV, raising=False)
        else:
            monkeypatch.setenv(launch.INTRA_ENV, env)
        assert launch.intra_variant() == want
        assert launch.intra_variant("v1") == "v1"  # an explicit variant wins over the environment
    monkeypatch.setenv(launch.INTRA_ENV, "fast")
    with pytest.raises(ValueError, match="CULA_SM100_CHUNK_INTRA must be one of v1, v2, got 'fast'"):
        launch.intra_variant()

    monkeypatch.setattr(cute, "compile", lambda obj, *args: type(obj).__name__)
    launch.intra_kernel.cache_clear()
    try:
        assert launch.intra_kernel(torch.bfloat16, "none", "v1") == "ChunkIntra"
        assert launch.intra_kernel(torch.bfloat16, "none", "v2") == "ChunkIntraV2"
        assert launch.intra_kernel.cache_info().currsize == 2
    finally:
        launch.intra_kernel.cache_clear()  # drop the stubs


def test_fused_o_switch(monkeypatch):
    """CULA_SM100_FUSED_O (read per call) makes chunk_kda, and only chunk_kda, ask forward for the fused
    chunk_delta_h + fwd_o; other values are rejected with a message naming the variable; the fused kernel has its
    own compiled-kernel cache, keyed on the state flags (forward stubbed to record what it was asked; compile
    stubbed: what is cached is the object handed to cute.compile)."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from cula_sm100.forward import launch

    asked = []
    monkeypatch.setattr(launch, "forward", lambda *a, fused_o=False, **kw: (asked.append(fused_o), (1, 2, 3))[1])
    kw = dict(scale=1.0, output_final_state=False, use_qk_l2norm_in_kernel=False, gate="precomputed",
              lower_bound=None, beta_activation="none")
    for env, want in ((None, False), ("", False), ("0", False), ("1", True)):
        if env is None:
            monkeypatch.delenv(launch.FUSED_O_ENV, raising=False)
        else:
            monkeypatch.setenv(launch.FUSED_O_ENV, env)
        assert launch.fused_o_enabled() is want
        assert launch.chunk_kda(*([None] * 10), **kw) == (1, 2)
        assert asked[-1] is want
    monkeypatch.setenv(launch.FUSED_O_ENV, "yes")
    with pytest.raises(ValueError, match="CULA_SM100_FUSED_O must be 0 or 1, got 'yes'"):
        launch.chunk_kda(*([None] * 10), **kw)

    monkeypatch.setattr(cute, "compile", lambda obj, *args: (type(obj).__name__, obj.has_h0, obj.store_ht))
    launch.delta_h_o_kernel.cache_clear()
    try:
        assert launch.delta_h_o_kernel(True, False) == ("ChunkDeltaHO", True, False)
        assert launch.delta_h_o_kernel(False, True) == ("ChunkDeltaHO", False, True)
        assert launch.delta_h_o_kernel.cache_info().currsize == 2
    finally:
        launch.delta_h_o_kernel.cache_clear()  # drop the stubs


def test_forward_fused_o_wiring(monkeypatch):
    """launch.forward(fused_o=True) hands the fused kernel's host function what chunk_delta_h and fwd_o would have
    had (normalised q, w, u, kg, G, Aqk, the initial state, both tables, scale, the final-state flag), runs neither
    of them, and leaves h / v_new out of the intermediates; fused_o=False runs the two and not the fused one.
    Stages stubbed with recorders (CPU tensors; no kernel runs)."""
    import torch

    from cula_sm100.forward import launch

    B, T, HQK, HV = 1, 3, 1, 2
    q, k = torch.zeros(B, T, HQK, 128), torch.zeros(B, T, HQK, 128)
    v, g = torch.zeros(B, T, HV, 128), torch.zeros(B, T, HV, 128)
    h0 = torch.zeros(B, HV, 128, 128)
    tag = {name: torch.zeros(1) for name in ("Aqk", "Akk", "w", "u", "kg", "ctab", "stab", "h", "vn", "ht")}
    tag["qn"], tag["kn"] = torch.zeros_like(q), torch.zeros_like(k)  # forward reshapes them into the intermediates
    calls = {}

    def rec(name, out):
        def f(*a, **kw):
            calls[name] = (a, kw)
            return out
        return f

    monkeypatch.setattr(launch, "tables", rec("tables", (tag["ctab"], tag["stab"])))
    monkeypatch.setattr(launch, "l2norm", lambda x: tag["qn"] if x is q else tag["kn"])
    monkeypatch.setattr(launch, "gate_cumsum", rec("gate", torch.zeros(B * T, HV, 128)))
    monkeypatch.setattr(launch, "chunk_intra", rec("intra", (tag["Aqk"], tag["Akk"])))
    monkeypatch.setattr(launch, "recompute_w_u", rec("w_u", (tag["w"], tag["u"], tag["kg"])))
    monkeypatch.setattr(launch, "chunk_delta_h", rec("delta_h", (tag["h"], tag["vn"], tag["ht"])))
    monkeypatch.setattr(launch, "fwd_o", rec("fwd_o", torch.zeros(B * T, HV, 128)))
    monkeypatch.setattr(launch, "chunk_delta_h_o", rec("delta_h_o", (torch.zeros(B * T, HV, 128), tag["ht"])))
    kw = dict(scale=0.25, output_final_state=True, use_qk_l2norm_in_kernel=True, gate="precomputed",
              lower_bound=None, beta_activation="none")

    o, ht, it = launch.forward(q, k, v, g, None, None, None, h0, None, None, fused_o=True, **kw)
    assert set(calls) == {"tables", "gate", "intra", "w_u", "delta_h_o"}
    a, kwargs = calls["delta_h_o"]
    G = calls["w_u"][0][2]
    want = (tag["qn"], tag["w"], tag["u"], tag["kg"], G, tag["Aqk"], h0, tag["ctab"], tag["stab"])
    assert len(a) == len(want) and all(x is y for x, y in zip(a, want, strict=True))
    assert kwargs == dict(scale=0.25, output_final_state=True)
    assert o.shape == (B, T, HV, 128) and ht is tag["ht"] and it.h is None and it.v_new is None

    calls.clear()
    _, ht, it = launch.forward(q, k, v, g, None, None, None, h0, None, None, **kw)  # default: unfused
    assert "delta_h_o" not in calls and {"delta_h", "fwd_o"} <= set(calls)
    assert it.h is tag["h"] and it.v_new is tag["vn"] and ht is tag["ht"]
