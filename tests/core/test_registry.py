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

from cula_core import chunk_kda, dispatch, kda_prefill, registry
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


def test_reference_backend_has_a_kernel_for_every_op_and_no_other():
    from cula_core.backend import OPS

    assert all(dispatch.REFERENCE_BACKEND.kernel(op).__name__ == op for op in OPS)
    with pytest.raises(NotImplementedError, match="backend 'reference' has no kernel for kda_verify"):
        dispatch.REFERENCE_BACKEND.kernel("kda_verify")


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
        "cula: kda_prefill runs on the reference implementation: cpuecho serves K <= 32 only, got K=64; "
        "cpusaver does not implement kda_prefill",
        "cula: kda_prefill runs on the reference implementation: cpuecho serves K <= 32 only, got K=48; "
        "cpusaver does not implement kda_prefill",
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
        assert ("kda_prefill                    reference (cpuecho serves K <= 32 only, got K=128; "
                "cpusaver does not implement kda_prefill)") in text


# ------------------------------------------------------------------- residuals: forward -> its own backward


@pytest.fixture
def saver():
    from cula_testbackend.backends import CpuSaver

    CpuSaver.forwards, CpuSaver.seen = [], []
    CpuSaver.residual_shape = CpuSaver.residual_dtype = None
    yield CpuSaver
    CpuSaver.residual_shape = CpuSaver.residual_dtype = None


def training_inputs(T=20):
    """K = 8 (what cpusaver serves), leaves that require grad."""
    return [t.clone().requires_grad_() for t in small_inputs(K=8, T=T)]


def grads_of(inputs, **kw):
    o, ht = chunk_kda(*inputs, output_final_state=True, **kw)
    (o.square().sum() + ht.sum()).backward()
    return [t.grad for t in inputs]


def reference_grads(monkeypatch, **kw):
    monkeypatch.setenv("CULA_BACKEND", "reference")
    grads = grads_of(training_inputs(), **kw)
    monkeypatch.delenv("CULA_BACKEND")
    return grads


def test_residuals_reach_the_backward_of_the_backend_that_saved_them(saver, monkeypatch):
    expected = reference_grads(monkeypatch)
    inputs = training_inputs()
    grads = grads_of(inputs)
    assert saver.forwards == [True]
    (Aqk, Akk), = saver.seen
    # [B, T, HV, 64] in q's dtype, the forward's values bitwise (Aqk = sum(q), Akk = -sum(k))
    assert Aqk.shape == (1, 20, 2, 64) and Aqk.dtype == torch.float32
    q_sum, k_sum = float(inputs[0].detach().sum()), float(inputs[1].detach().sum())
    assert torch.equal(Aqk, torch.full_like(Aqk, q_sum)) and torch.equal(Akk, torch.full_like(Akk, -k_sum))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_residuals_without_gradients(saver):
    q, k, v, g, beta = small_inputs(K=8)
    chunk_kda(q, k, v, g, beta)
    with torch.no_grad():
        chunk_kda(*training_inputs())
    assert saver.forwards == [False, False]


def test_a_backward_served_by_another_backend_gets_no_residuals(saver, monkeypatch):
    expected = reference_grads(monkeypatch)
    inputs = training_inputs()
    o, ht = chunk_kda(*inputs, output_final_state=True)
    assert saver.forwards == [True]
    monkeypatch.setenv("CULA_BACKEND", "reference")  # the backward now runs elsewhere: it must recompute
    (o.square().sum() + ht.sum()).backward()
    assert saver.seen == []
    for t, want in zip(inputs, expected, strict=True):
        torch.testing.assert_close(t.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("field, value, message", [
    ("residual_shape", (1, 20, 2, 32), r"residual Aqk is \(1, 20, 2, 32\) torch.float32, expected contiguous "
                                       r"\(1, 20, 2, 64\) torch.float32"),
    ("residual_dtype", torch.float64, r"residual Aqk is \(1, 20, 2, 64\) torch.float64"),
])
def test_residuals_that_break_the_promised_shape_are_an_error(saver, field, value, message):
    setattr(saver, field, value)
    with pytest.raises(RuntimeError, match=r"backend cpusaver: " + message):
        chunk_kda(*training_inputs())


def test_residuals_under_opcheck_and_torch_compile(saver, monkeypatch):
    """The fake op promises the residuals the real op returns (opcheck compares them); a compiled training
    step hands them to the backward as the eager one does."""
    q, k, v, g, beta = training_inputs()
    args = (q, k, v, g, beta, None, None, None, None, None, 0.5, True, False, "precomputed", None, "none", True)
    torch.library.opcheck(torch.ops.cula.chunk_kda.default, args)
    saver.seen.clear()

    def step(*inputs):
        o, ht = chunk_kda(*inputs, output_final_state=True)
        return o.square().sum() + ht.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    inputs = training_inputs()
    compiled(*inputs).backward()
    assert len(saver.seen) == 1 and saver.seen[0] is not None
    for t, want in zip(inputs, reference_grads(monkeypatch), strict=True):
        torch.testing.assert_close(t.grad, want, rtol=0, atol=0)
