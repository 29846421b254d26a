"""CPU tests of the sm89 backend object: which calls it serves and which it declines (with which reason), and
that importing it touches neither the extension nor CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import cula_sm89.backend as sm89_backend
from cula_core import registry
from cula_core.backend import CallConfig, DeviceInfo

ADA = DeviceInfo(type="cuda", index=0, capability=(8, 9), name="NVIDIA L40S")
HOPPER = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="NVIDIA H100")


def call(op="kda_prefill", *, device=ADA, dtype=torch.float32, K=128, V=None, HQK=4, HV=4, T=1000, gate="precomputed",
         varlen=False, requires_grad=False, **options):
    return CallConfig(op=op, device=device, dtype=dtype, K=K, V=K if V is None else V, HQK=HQK, HV=HV, T=T, gate=gate,
                      varlen=varlen, requires_grad=requires_grad, options=options)


@pytest.fixture
def built(monkeypatch):
    """As if the extension were built and loadable (the predicate's configuration logic alone)."""
    monkeypatch.setattr(sm89_backend, "extension_error", lambda: None)


@pytest.fixture
def backend():
    return sm89_backend.backend


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("op", ["kda_prefill", "chunk_kda"])
@pytest.mark.parametrize("gate", ["precomputed", "softplus", "safe"])
def test_serves_fp32_prefill(backend, built, K, op, gate):
    assert backend.unsupported_reason(call(op, K=K, gate=gate)) is None
    assert backend.unsupported_reason(call(op, K=K, gate=gate, device=HOPPER)) is None


def test_serves_gva_varlen_and_options(backend, built):
    c = call(HQK=2, HV=8, varlen=True, T=5000, use_qk_l2norm_in_kernel=True, beta_activation="2sigmoid",
             intracard_cp="on", initial_state=True, output_final_state=True)
    assert backend.unsupported_reason(c) is None


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                             (torch.float64, "float64")])
def test_declines_other_dtypes(backend, built, dtype, name):
    assert backend.unsupported_reason(call(dtype=dtype)) == f"sm89 serves fp32 only, got {name}"


@pytest.mark.parametrize(("K", "V"), [(32, 32), (256, 256), (64, 128), (128, 64)])
def test_declines_other_head_dims(backend, built, K, V):
    assert backend.unsupported_reason(call(K=K, V=V)) == f"sm89 serves K=V in (64, 128), got K={K}, V={V}"


def test_declines_autograd_and_other_ops(backend, built):
    assert "without autograd" in backend.unsupported_reason(call("chunk_kda", requires_grad=True))
    for op in ("chunk_kda_backward", "kda_decode", "kda_decode_mtp", "kda_flush_kvbuffer"):
        assert backend.unsupported_reason(call(op)) == f"sm89 does not implement {op}"


def test_declines_without_the_extension(backend, monkeypatch):
    monkeypatch.setattr(sm89_backend, "extension_error",
                        lambda: "cula-sm89 extension not built: no compiled cula_sm89._C")
    assert backend.unsupported_reason(call()).startswith("cula-sm89 extension not built")
    # configuration reasons come first: they say more than a missing build
    assert backend.unsupported_reason(call(dtype=torch.bfloat16)) == "sm89 serves fp32 only, got bfloat16"


def test_runs_on_ada_and_newer_only(backend):
    assert backend.runs_on(ADA) and backend.runs_on(HOPPER)
    assert not backend.runs_on(DeviceInfo(type="cuda", index=0, capability=(8, 6)))
    assert not backend.runs_on(DeviceInfo(type="cpu"))
    assert backend.int32_indexing is False
    assert set(backend.ops) == {"kda_prefill", "chunk_kda"}


def test_registered_through_the_entry_point():
    registry.reload()
    names = {b.name: b for b in registry.backends()}
    assert "sm89" in names and isinstance(names["sm89"], sm89_backend.Sm89Backend)


def test_import_loads_neither_extension_nor_cuda():
    code = (
        "import sys, cula_sm89.backend as b\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('cula_sm89'))\n"
        "assert loaded == ['cula_sm89', 'cula_sm89.backend'], f'extension or launcher loaded at import: {loaded}'\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'\n"
        "print(b.backend.describe())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kda_prefill" in proc.stdout


def test_extension_error_names_a_missing_build(monkeypatch):
    import importlib.util

    sm89_backend.extension_error.cache_clear()
    real = importlib.util.find_spec
    # no compiled module in the package: every submodule lookup but the backend's finds nothing
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("cula_sm89.") else real(name, *a))
    try:
        assert sm89_backend.extension_error().startswith("cula-sm89 extension not built: no compiled cula_sm89._C")
    finally:
        sm89_backend.extension_error.cache_clear()


def test_launcher_rejects_cpu_tensors():
    if sm89_backend.extension_error():
        pytest.skip(sm89_backend.extension_error())
    from cula_sm89.ops import prefill

    x = torch.zeros(1, 4, 1, 64)
    with pytest.raises(ValueError, match="float32 CUDA tensor"):
        prefill(x, x, x, x, torch.zeros(1, 4, 1))
