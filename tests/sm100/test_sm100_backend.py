"""CPU tests of the sm100 backend's forward family: which calls it serves, which it declines (with which
reason), that importing it loads no CuTe DSL, the chunk tables, and core's HV % HQK rejection."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cula_core.backend import CallConfig, DeviceInfo

HOPPER = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="NVIDIA H100")
BLACKWELL = DeviceInfo(type="cuda", index=0, capability=(10, 0), name="NVIDIA B200")


def call(op="chunk_kda", *, device=BLACKWELL, dtype=torch.bfloat16, K=128, V=None, HQK=4, HV=8, T=1000,
         gate="precomputed", varlen=False, requires_grad=False, **options):
    return CallConfig(op=op, device=device, dtype=dtype, K=K, V=K if V is None else V, HQK=HQK, HV=HV, T=T, gate=gate,
                      varlen=varlen, requires_grad=requires_grad, options=options)


@pytest.fixture
def backend(monkeypatch):
    from cula_sm100 import forward
    from cula_sm100.backend import backend

    monkeypatch.setattr(forward, "dsl_missing", lambda: None)
    return backend


@pytest.mark.parametrize("device", [HOPPER, BLACKWELL], ids=["sm90", "sm100"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("gate", ["precomputed", "softplus", "safe"])
def test_serves_chunk_kda_with_and_without_grad(backend, device, requires_grad, gate):
    c = call(device=device, requires_grad=requires_grad, gate=gate, varlen=True, use_qk_l2norm_in_kernel=True,
             beta_activation="sigmoid", initial_state=True, output_final_state=True)
    assert backend.unsupported_reason(c) is None
    assert device.capability in backend.capabilities


@pytest.mark.parametrize(("HQK", "HV"), [(1, 1), (2, 4), (4, 16), (16, 64)])
def test_serves_gva(backend, HQK, HV):
    assert backend.unsupported_reason(call(HQK=HQK, HV=HV)) is None


@pytest.mark.parametrize(("dtype", "name"), [(torch.float32, "float32"), (torch.float16, "float16")])
def test_declines_other_dtypes(backend, dtype, name):
    assert backend.unsupported_reason(call(dtype=dtype)) == f"sm100 serves bf16 q/k/v only, got {name}"


@pytest.mark.parametrize(("K", "V"), [(64, 64), (256, 256), (128, 64)])
def test_declines_other_head_dims(backend, K, V):
    assert backend.unsupported_reason(call(K=K, V=V)) == f"sm100 serves K=V=128 only, got K={K}, V={V}"


@pytest.mark.parametrize("op", ["kda_prefill", "kda_decode", "kda_decode_mtp"])
def test_declines_other_ops(backend, op):
    assert backend.unsupported_reason(call(op)) == f"sm100 does not implement {op}"


def test_declines_without_cute_dsl(monkeypatch):
    from cula_sm100 import forward
    from cula_sm100.backend import backend

    reason = "sm100 needs nvidia-cutlass-dsl (CuTe DSL), which is not installed"
    monkeypatch.setattr(forward, "dsl_missing", lambda: reason)
    assert "nvidia-cutlass-dsl" in backend.unsupported_reason(call())


def test_import_loads_no_cute_dsl():
    code = ("import sys, cula_sm100.backend as b; b.backend.unsupported_reason; "
            "import cula_sm100.forward; print('cutlass' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_chunk_tables():
    from cula_sm100.forward.launch import host_tables

    chunks, seqs = host_tables((0, 1, 1, 130, 194))  # lengths 1, 0, 129, 64
    assert chunks.tolist() == [[0, 1], [1, 64], [65, 64], [129, 1], [130, 64]]
    assert seqs.tolist() == [[0, 1, 0], [1, 1, 1], [1, 130, 1], [130, 194, 4]]
    assert chunks.dtype == seqs.dtype == torch.int32


def test_hv_not_multiple_of_hqk_rejected():
    import cula_core

    q = torch.randn(1, 8, 3, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 4, 128, dtype=torch.bfloat16)
    g = torch.randn(1, 8, 4, 128)
    beta = torch.rand(1, 8, 4)
    with pytest.raises(ValueError, match=r"HV % HQK must be 0 .*got HV = 4, HQK = 3"):
        cula_core.chunk_kda(q, q, v, g, beta)
