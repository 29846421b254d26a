"""Backend discovery and dispatch, with the test-only package tests/fixtures/cula-testbackend installed
for real (pip --target into a temporary directory put on sys.path): its entry points are found by
importlib.metadata exactly as an arch wheel's would be."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from cula_core import dispatch, kda_prefill, registry
from cula_core.backend import CallConfig, DeviceInfo
from cula_core.cli import info

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cula-testbackend"

H100 = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="fake H100")
L40 = DeviceInfo(type="cuda", index=0, capability=(8, 9), name="fake L40")
T4 = DeviceInfo(type="cuda", index=0, capability=(7, 5), name="fake T4")
CPU = DeviceInfo(type="cpu")


@pytest.fixture(scope="module", autouse=True)
def testbackend(tmp_path_factory):
    target = tmp_path_factory.mktemp("testbackend")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--target", str(target),
         str(FIXTURE)],
        check=True,
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    registry.reload()
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.startswith("cula_testbackend")]:
        del sys.modules[name]
    registry.reload()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.delenv("CULA_STRICT", raising=False)
    dispatch.reset_fallback_warnings()


def call(device, op="kda_prefill", dtype=torch.bfloat16, K=128, **kw):
    return CallConfig(op=op, device=device, dtype=dtype, K=K, V=K, HQK=4, HV=4, T=256, **kw)


def small_inputs(K, T=40, HV=2):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, T, HV, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, HV, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, K, generator=gen)
    g = -torch.rand(1, T, HV, K, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    return q, k, v, g, beta


def test_entry_points_are_discovered_and_broken_ones_recorded():
    loaded = {b.name for b in registry.backends()}
    assert {"fakesm89", "fakesm90", "cpuecho"} <= loaded
    failed = {e.entry_name: e for e in registry.failed()}
    assert "ImportError: libcula_fake.so" in failed["broken"].error
    assert failed["broken"].distribution == "cula-testbackend"
    assert "not a cula_core.backend.Backend" in failed["notabackend"].error


def test_exact_architecture_is_preferred():
    # Both fake backends run on 9.0 and serve bf16 K=128: the one built for 9.0 wins.
    assert dispatch.choose(call(H100)).backend.name == "fakesm90"
    # fp32 is declined by fakesm90, so the sm89 build that also runs on 9.0 serves it.
    assert dispatch.choose(call(H100, dtype=torch.float32)).backend.name == "fakesm89"
    assert dispatch.choose(call(L40)).backend.name == "fakesm89"


def test_fallback_reason_names_every_declining_backend():
    sel = dispatch.choose(call(H100, K=32))
    assert sel.backend is dispatch.REFERENCE_BACKEND
    assert "fakesm90 serves K=V=128 only, got K=32" in sel.fallback_reason
    assert "fakesm89 serves K=V in (64, 128), got K=32" in sel.fallback_reason


def test_fallback_reason_for_an_architecture_without_a_package():
    sel = dispatch.choose(call(T4))
    assert sel.backend is dispatch.REFERENCE_BACKEND
    assert sel.fallback_reason == "no cula kernel package targets sm_75"


def test_op_a_backend_does_not_implement():
    sel = dispatch.choose(call(L40, op="kda_decode", K=64))
    assert sel.backend is dispatch.REFERENCE_BACKEND
    assert "fakesm89 does not implement kda_decode" in sel.fallback_reason


def test_public_op_routes_to_the_cpu_backend():
    from cula_testbackend.backends import CpuEcho

    before = CpuEcho.calls
    q, k, v, g, beta = small_inputs(K=16)
    o, ht = kda_prefill(q, k, v, g, beta, output_final_state=True)
    assert CpuEcho.calls == before + 1
    o_ref, ht_ref = dispatch.REFERENCE_BACKEND.kernel("kda_prefill")(
        q, k, v, g, beta, None, None, None, None, None, scale=16**-0.5, output_final_state=True,
        use_qk_l2norm_in_kernel=False, gate="precomputed", lower_bound=None, beta_activation="none",
        intracard_cp="auto")
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


def test_fallback_warning_is_issued_once_per_reason():
    q, k, v, g, beta = small_inputs(K=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kda_prefill(q, k, v, g, beta)
        kda_prefill(q, k, v, g, beta)
        q2, k2, v2, g2, beta2 = small_inputs(K=48)
        kda_prefill(q2, k2, v2, g2, beta2)
    messages = [str(w.message) for w in caught if issubclass(w.category, dispatch.CulaFallbackWarning)]
    assert messages == [
        "cula: kda_prefill runs on the reference implementation: cpuecho serves K <= 32 only, got K=64",
        "cula: kda_prefill runs on the reference implementation: cpuecho serves K <= 32 only, got K=48",
    ]


def test_strict_mode_turns_fallback_into_an_error(monkeypatch):
    monkeypatch.setenv("CULA_STRICT", "1")
    q, k, v, g, beta = small_inputs(K=64)
    with pytest.raises(dispatch.BackendUnavailableError, match=r"cpuecho serves K <= 32 only, got K=64.*CULA_STRICT"):
        kda_prefill(q, k, v, g, beta)
    # A call a backend serves is unaffected.
    q, k, v, g, beta = small_inputs(K=16)
    kda_prefill(q, k, v, g, beta)


def test_forced_backend(monkeypatch):
    monkeypatch.setenv("CULA_BACKEND", "fakesm89")
    assert dispatch.choose(call(H100)).backend.name == "fakesm89"
    with pytest.raises(dispatch.BackendUnavailableError, match="fakesm89: kda_prefill: fakesm89 serves K=V in"):
        dispatch.choose(call(H100, K=32))
    with pytest.raises(dispatch.BackendUnavailableError, match=r"does not run on cuda:0 \(sm_75"):
        dispatch.choose(call(T4))
    monkeypatch.setenv("CULA_BACKEND", "reference")
    assert dispatch.choose(call(H100)).backend is dispatch.REFERENCE_BACKEND
    monkeypatch.setenv("CULA_BACKEND", "broken")
    with pytest.raises(dispatch.BackendUnavailableError, match=r"failed to load \(ImportError: libcula_fake\.so"):
        dispatch.choose(call(H100))
    monkeypatch.setenv("CULA_BACKEND", "nosuch")
    with pytest.raises(dispatch.BackendUnavailableError, match="no such backend is installed"):
        dispatch.choose(call(H100))


def test_forced_backend_reaches_the_public_op(monkeypatch):
    monkeypatch.setenv("CULA_BACKEND", "fakesm90")
    q, k, v, g, beta = small_inputs(K=16)
    with pytest.raises(dispatch.BackendUnavailableError, match="backend fakesm90 does not run on cpu"):
        kda_prefill(q, k, v, g, beta)


def test_int32_indexing_limit_is_enforced_before_the_kernel(monkeypatch):
    from cula_testbackend.backends import CpuEcho

    monkeypatch.setattr("cula_core.validation.INT32_MAX", 1000)
    before = CpuEcho.calls
    q, k, v, g, beta = small_inputs(K=16)  # 1 * 40 * 2 * 16 = 1280 elements > 1000
    with pytest.raises(ValueError, match=r"q has 1280 elements, more than the cpuecho kernels can index"):
        kda_prefill(q, k, v, g, beta)
    assert CpuEcho.calls == before


def test_info_reports_backends_and_dispatch():
    out = io.StringIO()
    assert info(out) == 0
    text = out.getvalue()
    assert "fakesm90 loaded" in text and "fakesm89 loaded" in text
    assert "broken   FAILED" in text and "ImportError: libcula_fake.so" in text
    assert "cula-testbackend 0.0.1" in text
    # On this machine (no GPU visible in CI) every op shows the CPU route: cpuecho declines K=128.
    if not torch.cuda.is_available():
        assert "kda_prefill                    reference (cpuecho serves K <= 32 only, got K=128)" in text
