"""CPU checks of the cula-sm90 prefill: every kernel compiles for sm_90a (fake pointers, no GPU), and the
backend's serving predicate declines what it does not serve, with the reason."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _arch(tmp_path_factory):
    """CuTe DSL present; compiled kernels cached in a folder of this test session (not the user's cache)."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from cula_core import cute_runtime as rt

    old = os.environ.get("CULA_CACHE_DIR")
    os.environ["CULA_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "cula-cache")
    rt.reset()
    yield
    rt.reset()
    if old is None:
        os.environ.pop("CULA_CACHE_DIR", None)
    else:
        os.environ["CULA_CACHE_DIR"] = old


@pytest.mark.parametrize(("gate", "beta_act", "l2", "a_log", "dtb", "g_dtype", "b_dtype", "kind"), [
    ("safe", "sigmoid", True, True, True, torch.bfloat16, torch.bfloat16, "tc"),
    ("safe", "2sigmoid", False, False, True, torch.float32, torch.float32, "tc"),
    ("softplus", "none", True, True, False, torch.float32, torch.float32, "simt"),
    ("precomputed", "2sigmoid", False, False, False, torch.float32, torch.bfloat16, "simt"),
])
def test_stage1_compiles(gate, beta_act, l2, a_log, dtb, g_dtype, b_dtype, kind):
    from cula_sm90.prefill import forward

    fn = forward.compile_intra(gate, beta_act, l2, a_log, dtb, torch.bfloat16, g_dtype, b_dtype, kind)
    # prefill() passes 15 addresses, 6 sizes, scale, lower bound and the stream
    with pytest.raises(TypeError, match="Expects 24 parameters"):
        fn(1)


def test_stage1_kind():
    """The TC stage 1 serves the safe gate down to TC_LOWER_BOUND_MIN; every other call goes to the SIMT one."""
    from cula_sm90.prefill import forward

    assert forward.intra_kind("safe", -5.0) == "tc"
    assert forward.intra_kind("safe", forward.TC_LOWER_BOUND_MIN) == "tc"
    assert forward.intra_kind("safe", forward.TC_LOWER_BOUND_MIN - 1) == "simt"
    assert forward.intra_kind("softplus", -5.0) == "simt"
    assert forward.intra_kind("precomputed", -5.0) == "simt"


@pytest.mark.parametrize("affine", [False, True], ids=["main", "affine-map"])
def test_stage2_compiles(affine):
    from cula_sm90.prefill import forward

    fn = forward.compile_state(affine, torch.bfloat16)
    with pytest.raises(TypeError, match="Expects 17 parameters"):  # 10 addresses, 6 sizes, the stream
        fn(1)


def _call(**kw):
    from cula_core.backend import CallConfig, DeviceInfo

    base = dict(op="kda_prefill", device=DeviceInfo(type="cuda", capability=(9, 0), name="H100"),
                dtype=torch.bfloat16, K=128, V=128, HQK=4, HV=8, T=64)
    base.update(kw)
    return CallConfig(**base)


def test_serves_and_declines_with_reasons():
    from cula_sm90 import prefill

    assert prefill.unsupported_reason(_call()) is None
    assert prefill.unsupported_reason(_call(op="chunk_kda")) is None
    assert "without autograd" in prefill.unsupported_reason(_call(op="chunk_kda", requires_grad=True))
    assert "K=V=128" in prefill.unsupported_reason(_call(K=64, V=64))
    assert "bf16" in prefill.unsupported_reason(_call(dtype=torch.float32))
    assert "bf16" in prefill.unsupported_reason(_call(dtype=torch.float16))
    assert "does not implement" in prefill.unsupported_reason(_call(op="kda_decode"))
    assert "int32" in prefill.unsupported_reason(_call(T=2**20, HV=16, HQK=16))


def test_stage2_fits_two_ctas_per_sm():
    """Stage 2's compiled footprint lets two CTAs share an SM (one wave for up to 2 x SMs CTAs): at most 128
    registers per thread at 256 threads, and the shared memory of its single-buffered tiles (w, kg, u slice, and
    in the main pass qg and Aqk; the split h, whose region the split v_new reuses; 128 decays) under half an SM."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from tools import kernel_report as kr

    why = kr.missing_tools()
    if why:
        pytest.skip(f"kernel_report needs a CUDA binary tool: {why}")
    names = {"prefill.chunk_state_tc (stage 2)": False, "prefill.chunk_state_tc[affine] (CP maps)": True}
    args = [a for n in names for a in ("--kernel", n)]
    proc = subprocess.run([sys.executable, "-m", "tools.kernel_report", *args, "--json"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = {r["name"]: r for r in json.loads(proc.stdout)}
    bt, dk, bv = 64, 128, 64
    for name, affine in names.items():
        r = reports[name]
        assert not r["error"], r["error"]
        assert r["threads"] == 256
        assert r["regs"] <= kr.SM_REGS // (2 * 256), r["regs"]
        tiles = 2 * dk * bt + bt * bv + 2 * dk * bv + (0 if affine else dk * bt + bt * bt)
        assert r["dynamic_smem"] == 2 * tiles + 4 * dk
        assert 2 * (r["dynamic_smem"] + r["static_smem"] + kr.SMEM_RESERVED_PER_CTA) <= kr.SM_SMEM
        assert r["ctas_per_sm"] >= 2, (r["ctas_per_sm"], r["limiter"])
