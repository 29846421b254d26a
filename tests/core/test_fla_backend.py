"""cula as an FLA backend (`cula.fla`), on the CPU.

`cula_core.dispatch.kernel_backend_for` runs without FLA. The rest needs FLA 0.6.0 importable (fla-core and
triton; FLA imports on a CPU machine, its kernels do not run) and skips otherwise: FLA is not in
tools/requirements-test.txt because triton alone installs about 650 MB. The test-only backends of
tests/fixtures/cula-testbackend are installed for the whole module (test_registry's fixture): `cpusaver` serves
chunk_kda and its backward on CPU tensors with K == 8, so FLA's dispatch can reach a cula "kernel" here; every
other CPU call has only the reference and must stay on FLA.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_registry import testbackend  # noqa: F401 - module-wide fixture: installs the test backends

import cula_core
from cula_core import dispatch, registry
from cula_core.backend import CallConfig, DeviceInfo

CPU = DeviceInfo(type="cpu")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("CULA_BACKEND", "CULA_STRICT", "FLA_CULA"):
        monkeypatch.delenv(name, raising=False)
    dispatch.reset_fallback_warnings()


def saver():
    """The test backend that serves chunk_kda (K == 8) on CPU tensors; it records each forward it runs."""
    return next(b for b in registry.backends() if b.name == "cpusaver")


# ------------------------------------------------------------------------------------------------------------
# cula_core.dispatch.kernel_backend_for (no FLA needed)
# ------------------------------------------------------------------------------------------------------------


def chunk_call(K, op="chunk_kda"):
    return CallConfig(op=op, device=CPU, dtype=torch.float32, K=K, V=K, HQK=2, HV=2, T=16)


def test_kernel_backend_for_names_the_backend_that_serves_the_call():
    backend, reason = dispatch.kernel_backend_for(chunk_call(8))
    assert (backend.name, reason) == ("cpusaver", None)


def test_kernel_backend_for_gives_the_reason_when_only_the_reference_serves(monkeypatch):
    monkeypatch.setenv("CULA_STRICT", "1")  # asking must not raise, nor warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend, reason = dispatch.kernel_backend_for(chunk_call(16))
    assert backend is None
    assert "cpusaver serves K == 8 only, got K=16" in reason


@pytest.mark.parametrize(("forced", "expected"), [
    ("reference", "CULA_BACKEND=reference forces the reference"),
    ("fakesm90", "CULA_BACKEND=fakesm90: backend fakesm90 does not run on cpu"),
    ("nosuch", "CULA_BACKEND=nosuch: no such backend is installed"),
])
def test_kernel_backend_for_follows_cula_backend(monkeypatch, forced, expected):
    monkeypatch.setenv("CULA_BACKEND", forced)
    backend, reason = dispatch.kernel_backend_for(chunk_call(8))
    assert backend is None
    assert reason.startswith(expected)


# ------------------------------------------------------------------------------------------------------------
# FLA
# ------------------------------------------------------------------------------------------------------------

try:
    import cula.fla  # registers cula with FLA
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    FLA_MISSING = None
except ImportError as exc:
    FLA_MISSING = f"FLA 0.6.0 cannot be imported (install the fla-core wheel and triton): {exc}"

needs_fla = pytest.mark.skipif(FLA_MISSING is not None, reason=FLA_MISSING or "")


def run_python(script: str, env: dict) -> list[str]:
    """Runs `script` in a fresh interpreter (an import-time switch needs one); returns its printed words."""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def inputs(K=8, T=16, H=2, B=1, requires_grad=False, gate_in_kernel=False):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, K, generator=gen)
    g = torch.randn(B, T, H, K, generator=gen) if gate_in_kernel else -torch.rand(B, T, H, K, generator=gen)
    beta = torch.randn(B, T, H, generator=gen)
    out = dict(q=q, k=k, v=v, g=g, beta=beta)
    if requires_grad:
        for t in out.values():
            t.requires_grad_(True)
    return out


def verify(**kwargs):
    return cula.fla.ChunkKDABackend().verify("chunk_kda", **kwargs)


@needs_fla
def test_import_registers_cula_for_fla():
    assert cula.fla.is_registered()
    assert cula.fla.register() is True  # idempotent


@needs_fla
def test_fla_chunk_kda_runs_on_the_cula_kernel_and_logs_it(caplog, monkeypatch):
    x = inputs()
    before = len(saver().forwards)
    with caplog.at_level(logging.INFO, logger="cula.fla"):
        o, ht = fla_chunk_kda(**x, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              output_final_state=True)
    assert len(saver().forwards) == before + 1
    expected_o, expected_ht = cula_core.chunk_kda(**x, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                                  output_final_state=True)
    torch.testing.assert_close(o, expected_o, rtol=0, atol=0)
    torch.testing.assert_close(ht, expected_ht, rtol=0, atol=0)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    ref_o, ref_ht = cula_core.chunk_kda(**x, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                        output_final_state=True)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, ref_ht, rtol=1e-5, atol=1e-5)
    assert "cula.fla: FLA's chunk_kda runs on cula (backend cpusaver)" in caplog.messages


@needs_fla
def test_gradients_through_fla_reach_the_cula_backward(monkeypatch):
    x = inputs(requires_grad=True, gate_in_kernel=True)
    A_log = torch.rand(1, 1, 2, 1, requires_grad=True)  # FLA takes any shape holding HV values
    dt_bias = torch.randn(2 * 8, requires_grad=True)
    seen = len(saver().seen)
    o, _ = fla_chunk_kda(**x, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    o.square().sum().backward()
    assert len(saver().seen) == seen + 1
    grads = [x[n].grad for n in ("q", "k", "v", "g", "beta")] + [A_log.grad, dt_bias.grad]
    assert A_log.grad.shape == (1, 1, 2, 1)

    y = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    A_ref = A_log.detach().reshape(2).clone().requires_grad_(True)
    dt_ref = dt_bias.detach().clone().requires_grad_(True)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_ref, _ = cula_core.chunk_kda(**y, use_gate_in_kernel=True, A_log=A_ref, dt_bias=dt_ref,
                                   use_beta_sigmoid_in_kernel=True)
    o_ref.square().sum().backward()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    expected = [y[n].grad for n in ("q", "k", "v", "g", "beta")] + [A_ref.grad.reshape(1, 1, 2, 1), dt_ref.grad]
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_fla
def test_v_first_states_and_their_deprecated_alias(monkeypatch):
    # FLA's layers always pass state_v_first=True: states [N, HV, V, K] in and out
    x = inputs(B=2)
    h0 = torch.randn(2, 2, 8, 8)  # [N, HV, K, V]
    before = len(saver().forwards)
    o, ht = fla_chunk_kda(**x, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                          state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_alias, ht_alias = fla_chunk_kda(**x, initial_state=h0.transpose(-1, -2).contiguous(),
                                          output_final_state=True, transpose_state_layout=True)
    assert len(saver().forwards) == before + 2
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_ref, ht_ref = cula_core.chunk_kda(**x, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, ht_ref.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((o_alias, ht_alias), (o, ht), rtol=0, atol=0)


@needs_fla
def test_flash_kda_runs_the_inference_calls_it_serves(monkeypatch):
    # the preference table gives FlashKDA the calls below 4096 tokens: where FlashKDA accepts such an inference
    # call, cula declines; from 4096 tokens on cula takes it
    from fla.ops.kda.backends.flash_kda import FlashKDABackend

    monkeypatch.setattr(FlashKDABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(FlashKDABackend, "chunk_kda_verifier", lambda self, *a, **kw: (True, None))
    with torch.no_grad():
        assert verify(**inputs()) == (
            False, "FlashKDA serves this call and is faster on its shape (cula.fla.PREFERENCE_VS_FLASH_KDA)")
        assert verify(**inputs(T=2048, B=2)) == (True, None)  # 4096 tokens
        assert verify(**inputs(T=4095)) == (
            False, "FlashKDA serves this call and is faster on its shape (cula.fla.PREFERENCE_VS_FLASH_KDA)")
    assert verify(**inputs(requires_grad=True)) == (True, None)  # training: FlashKDA runs inference only
    monkeypatch.setenv("FLA_FLASH_KDA", "0")  # FlashKDA switched off in FLA: cula takes the call
    with torch.no_grad():
        assert verify(**inputs()) == (True, None)


@needs_fla
def test_intermediate_states_need_a_kernel_for_them():
    with torch.inference_mode():
        ok, reason = verify(**inputs(), return_intermediate_states=True)
    assert not ok
    assert reason.startswith("no cula kernel serves kda_prefill_chunk_states: ")


@needs_fla
def test_keyword_arguments_fla_ignores_are_ignored():
    x = inputs()
    o, _ = fla_chunk_kda(**x, not_an_fla_option=1)
    torch.testing.assert_close(o, cula_core.chunk_kda(**x)[0], rtol=0, atol=0)


@needs_fla
def test_calls_no_cula_kernel_serves_are_declined():
    assert verify(**inputs(K=16)) == (
        False, "no cula kernel serves chunk_kda: cpuecho does not implement chunk_kda; cpusaver serves K == 8 only, "
               "got K=16")


@needs_fla
def test_a_training_call_needs_a_kernel_for_the_backward_too(monkeypatch):
    # cpusaver serves both: accepted; with cula's dispatch forced to the reference, neither is served
    assert verify(**inputs(requires_grad=True)) == (True, None)
    with torch.no_grad():
        assert verify(**inputs(requires_grad=True)) == (True, None)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    ok, reason = verify(**inputs(requires_grad=True))
    assert not ok and reason == "no cula kernel serves chunk_kda: CULA_BACKEND=reference forces the reference"


def bad(name, value):
    x = inputs()
    x[name] = value
    return x


@needs_fla
@pytest.mark.parametrize(("kwargs", "reason"), [
    (dict(bad("g", torch.zeros(1, 16, 2, 4))), "g must be [1, 16, 2, 8], got [1, 16, 2, 4]"),
    (dict(bad("beta", torch.zeros(1, 16, 3))), "beta must be [1, 16, 2], got [1, 16, 3]"),
    (dict(bad("k", torch.zeros(1, 16, 1, 8))), "q and k shapes differ"),
    ({**inputs(B=2), "cu_seqlens": torch.tensor([0, 8, 16])}, "cu_seqlens needs batch size 1, got 2"),
    ({**inputs(), "cu_seqlens": torch.tensor([0, 8, 16]), "initial_state": torch.zeros(3, 2, 8, 8)},
     "initial_state has 3 states for 2 sequences"),
    ({**inputs(), "initial_state": torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16)}, "float32 initial_state"),
    ({**inputs(), "use_gate_in_kernel": True}, "use_gate_in_kernel=True needs A_log or lower_bound"),
    ({**inputs(), "chunk_size": 16}, "chunk_size must be 32 or 64, got 16"),
    ({**inputs(), "use_gate_in_kernel": True, "safe_gate": True, "A_log": torch.zeros(2)},
     "safe_gate=True needs lower_bound in [-5, 0), got None"),
    ({**inputs(), "use_gate_in_kernel": True, "safe_gate": True, "A_log": torch.zeros(2), "lower_bound": -6.0},
     "safe_gate=True needs lower_bound in [-5, 0), got -6.0"),
    ({**inputs(), "allow_neg_eigval": True}, "allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True"),
    ({**inputs(), "state_v_first": True, "transpose_state_layout": True}, "together with its deprecated alias"),
    ({**inputs(), "return_intermediate_states": True}, "return_intermediate_states only in inference mode"),
])
def test_calls_fla_refuses_are_left_to_fla(kwargs, reason):
    ok, why = verify(**kwargs)
    assert not ok
    assert why.startswith("left to FLA, which refuses the call: ") and reason in why


@needs_fla
@pytest.mark.parametrize(("kwargs", "reason"), [
    ({**inputs(), "cp_context": object()}, "cula does not run FLA's context parallel (cp_context)"),
    ({**inputs(), "use_graph": True}, "cula does not take FLA's use_graph (its padded varlen chunk lists)"),
    (bad("k", torch.zeros(1, 16, 2, 8, dtype=torch.float64)), "k is torch.float64, q torch.float32"),
    ({**inputs(), "use_gate_in_kernel": True, "A_log": torch.zeros(3)}, "A_log holds 3 values, HV = 2"),
    ({**inputs(), "use_gate_in_kernel": True, "A_log": torch.zeros(2), "dt_bias": torch.zeros(2)},
     "dt_bias holds 2 values, HV * K = 16"),
])
def test_calls_cula_cannot_take_are_declined(kwargs, reason):
    assert verify(**kwargs) == (False, reason)


@needs_fla
def test_an_exception_in_the_verifier_declines_the_call():
    ok, reason = verify(**bad("q", "not a tensor"))
    assert not ok and "object has no attribute" in reason


@needs_fla
def test_fla_cula_0_at_call_time_sends_calls_to_flas_own_kernels(monkeypatch):
    monkeypatch.setenv("FLA_CULA", "0")
    before = len(saver().forwards)
    with pytest.raises(RuntimeError):  # FLA's Triton kernels cannot run on the CPU
        fla_chunk_kda(**inputs())
    assert len(saver().forwards) == before


@needs_fla
def test_fla_cula_0_at_import_registers_nothing(testbackend):  # noqa: F811
    # the test backends are on the path: with cula registered, this call would run on cpusaver
    script = (
        "import torch, cula.fla\n"
        "from cula_core import registry\n"
        "from fla.ops.kda import chunk_kda\n"
        "saver = next(b for b in registry.backends() if b.name == 'cpusaver')\n"
        "x = [torch.randn(1, 16, 2, 8) for _ in range(3)] + [-torch.rand(1, 16, 2, 8), torch.rand(1, 16, 2)]\n"
        "try:\n"
        "    chunk_kda(*x)\n"
        "    ran = 'cula'\n"
        "except RuntimeError:\n"
        "    ran = 'fla'\n"
        "print(cula.fla.is_registered(), ran, len(saver.forwards))\n"
    )
    env = {"FLA_CULA": "0", "PYTHONPATH": os.pathsep.join([str(testbackend), *sys.path])}
    assert run_python(script, env) == ["False", "fla", "0"]


@needs_fla
def test_cpu_tensors_are_declined_where_no_cula_kernel_runs_on_the_cpu():
    # a real install (no test backends): CPU calls have only cula's reference
    script = (
        "import torch, cula.fla\n"
        "x = [torch.randn(1, 16, 2, 128) for _ in range(3)] + [-torch.rand(1, 16, 2, 128), torch.rand(1, 16, 2)]\n"
        "print(cula.fla.ChunkKDABackend().verify('chunk_kda', *x)[1])\n"
    )
    path = [p for p in sys.path if "testbackend" not in p]
    assert " ".join(run_python(script, {"PYTHONPATH": os.pathsep.join(path)})) == (
        "no cula kernel serves chunk_kda: inputs are on cpu; cula kernels run on CUDA devices")


@needs_fla
def test_preference_table_is_ordered_and_names_a_known_winner():
    rows = cula.fla.PREFERENCE_VS_FLASH_KDA
    assert rows[0].tokens == 0
    assert [r.tokens for r in rows] == sorted({r.tokens for r in rows})
    repo = Path(__file__).resolve().parents[2]
    assert all(r.winner in ("cula", "flash_kda") and (repo / r.evidence).is_file() for r in rows)
    for r in rows:
        assert cula.fla.preferred_over_flash_kda(r.tokens) == r.winner


# --- the recurrent entry (FLA's fused_recurrent_kda -> fused_recurrent_kda_fwd)


def verify_recurrent(**kwargs):
    return cula.fla.RecurrentKDABackend().verify("fused_recurrent_kda_fwd", **kwargs)


@needs_fla
@pytest.mark.parametrize(("kwargs", "reason"), [
    ({}, "cula serves a new final state without ssm_state_indices, or an in-place pool update with them; got "
         "inplace_final_state=True without ssm_state_indices"),
    ({"inplace_final_state": False, "ssm_state_indices": torch.zeros(1, dtype=torch.int32)},
     "cula serves a new final state without ssm_state_indices, or an in-place pool update with them; got "
     "inplace_final_state=False with ssm_state_indices"),
    ({"inplace_final_state": False, "out": torch.zeros(1, 16, 2, 8)}, "cula does not write into a caller's out buffer"),
    ({"inplace_final_state": False, "allow_neg_eigval": True},
     "allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True"),
    ({"inplace_final_state": False, "use_gate_in_kernel": True}, "use_gate_in_kernel=True needs A_log or lower_bound"),
])
def test_recurrent_calls_cula_does_not_take_are_declined(kwargs, reason):
    assert verify_recurrent(**inputs(), **kwargs) == (False, reason)


@needs_fla
@pytest.mark.parametrize("pool", [False, True], ids=["new-state", "pool"])
def test_recurrent_cpu_calls_stay_on_fla(pool):
    # no test backend serves fused_recurrent_kda on the CPU: only cula's reference would
    kwargs = {"inplace_final_state": False}
    if pool:
        kwargs = {"initial_state": torch.zeros(3, 2, 8, 8), "ssm_state_indices": torch.tensor([1])}
    assert verify_recurrent(**inputs(), **kwargs) == (
        False, "no cula kernel serves fused_recurrent_kda: cpuecho does not implement fused_recurrent_kda; cpusaver "
               "does not implement fused_recurrent_kda")


@needs_fla
def test_fla_fused_recurrent_kda_is_dispatched_to_the_verifier(monkeypatch):
    # FLA's public function reaches cula's verifier (through fused_recurrent_kda_fwd) with what it sends
    seen = {}

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return False, "spy"

    monkeypatch.setattr(cula.fla.RecurrentKDABackend, "fused_recurrent_kda_fwd_verifier", spy)
    with pytest.raises(RuntimeError):  # then FLA's Triton kernel, which cannot run on the CPU
        fla_fused_recurrent_kda(**inputs(), output_final_state=True, state_v_first=True)
    assert seen["inplace_final_state"] is False and seen["state_v_first"] is True
    assert seen["output_final_state"] is True


def naive_recurrent(x, h0):
    """FLA's own definition (fla.ops.kda.naive), K-first states; g is a log decay, beta post-sigmoid."""
    from fla.ops.kda.naive import naive_recurrent_kda

    o, ht = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"].sigmoid(), initial_state=h0,
                                output_final_state=True)
    return o, ht


@needs_fla
def test_recurrent_implementation_gives_flas_results_with_v_first_states():
    # the backend's implementation called as FLA's dispatch would call it (on CPU it runs cula's reference)
    x = inputs(T=5, B=2)
    h0 = torch.randn(2, 2, 8, 8)  # [N, HV, K, V]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cula_core.CulaFallbackWarning)
        o, ht = cula.fla.RecurrentKDABackend().fused_recurrent_kda_fwd(
            **x, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True, inplace_final_state=False,
            state_v_first=True, use_beta_sigmoid_in_kernel=True)
    o_ref, ht_ref = naive_recurrent(x, h0)
    torch.testing.assert_close(o, o_ref.to(o.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, ht_ref.transpose(-1, -2), rtol=1e-5, atol=1e-5)


@needs_fla
def test_recurrent_implementation_updates_a_pool_in_place():
    x = inputs(T=1, B=2)
    pool = torch.randn(4, 2, 8, 8)  # [P, HV, V, K]
    untouched = pool[[1, 3]].clone()
    slots = torch.tensor([2, 0])
    h0 = pool[slots].transpose(-1, -2).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cula_core.CulaFallbackWarning)
        o, returned = cula.fla.RecurrentKDABackend().fused_recurrent_kda_fwd(
            **x, initial_state=pool, inplace_final_state=True, ssm_state_indices=slots, state_v_first=True,
            use_beta_sigmoid_in_kernel=True)
    o_ref, ht_ref = naive_recurrent(x, h0)
    assert returned is pool
    torch.testing.assert_close(o, o_ref.to(o.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], ht_ref.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 3]], untouched, rtol=0, atol=0)
