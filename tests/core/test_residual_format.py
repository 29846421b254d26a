"""Residuals handed from a training forward to a backward by FORMAT (docs/backends.md, "Residuals"): the forward's
backend names the format it produces (`residual_format`), the backward's backend the formats it reads
(`accepts_residuals`); core saves them only when both agree, whichever backends they are. On Hopper that is
cula-sm90's forward (the safe gate on the tensor-core stage 1) feeding cula-sm100's backward.

The CPU part runs two test backends, one serving only the forward and one only the backward (added to the
registry's list for each test), through the public `chunk_kda` with autograd, opcheck and torch.compile; the Hopper
part asks the dispatcher about a synthetic 9.0 device with the installed cula-sm90 and cula-sm100 backends."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cula_core import chunk_kda, dispatch, registry
from cula_core.backend import FLA_CHUNK64_RESIDUALS, Backend, CallConfig, DeviceInfo

K = 4  # what the two test backends serve (no installed backend serves K = 4 on CPU)


class ForwardOnly(Backend):
    """chunk_kda on CPU by the reference; with save_residuals, Aqk = sum(q) and Akk = -sum(k) (deterministic)."""

    name = "fwdonly"
    arch = (0, 0)
    ops = ("chunk_kda",)
    produces = FLA_CHUNK64_RESIDUALS
    forwards: list = []  # per call: whether residuals were asked

    def runs_on(self, device):
        return device.type == "cpu"

    def unsupported_reason(self, call):
        reason = super().unsupported_reason(call)
        return reason if reason is not None or call.K == K else f"fwdonly serves K == {K} only"

    def residual_format(self, call):
        return self.produces if call.requires_grad else ""

    def kernel(self, op):
        from cula_core import reference_backend

        cls = type(self)

        def forward(q, k, v, *args, save_residuals=False, **kwargs):
            cls.forwards.append(save_residuals)
            o, ht = reference_backend.chunk_kda(q, k, v, *args, **kwargs)
            if not save_residuals:
                return o, ht
            shape = (*q.shape[:2], v.shape[2], 64)
            return o, ht, (torch.full(shape, float(q.sum()), dtype=q.dtype),
                           torch.full(shape, -float(k.sum()), dtype=q.dtype))
        return forward


class BackwardOnly(Backend):
    """chunk_kda_backward on CPU by the reference; reads residuals of the formats in `reads`, recording them."""

    name = "bwdonly"
    arch = (0, 0)
    ops = ("chunk_kda_backward",)
    reads = (FLA_CHUNK64_RESIDUALS,)
    seen: list = []  # per call: the residuals it got (None: none)

    def runs_on(self, device):
        return device.type == "cpu"

    def unsupported_reason(self, call):
        reason = super().unsupported_reason(call)
        return reason if reason is not None or call.K == K else f"bwdonly serves K == {K} only"

    def accepts_residuals(self, call, fmt):
        return fmt in self.reads

    def kernel(self, op):
        from cula_core import reference_backend

        cls = type(self)

        def backward(*args, residuals=None, **kwargs):
            cls.seen.append(None if residuals is None else tuple(r.clone() for r in residuals))
            return reference_backend.chunk_kda_backward(*args, **kwargs)
        return backward


@pytest.fixture
def backends(monkeypatch):
    """The installed backends plus the two test ones; their records emptied, their formats reset."""
    fwd, bwd = ForwardOnly(), BackwardOnly()
    ForwardOnly.forwards, BackwardOnly.seen = [], []
    installed = registry.backends()
    monkeypatch.setattr(registry, "backends", lambda: [*installed, fwd, bwd])
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.delenv("CULA_STRICT", raising=False)
    dispatch.reset_fallback_warnings()
    yield fwd, bwd
    dispatch.reset_fallback_warnings()


def _inputs(T=20, HV=2, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, HV, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, HV, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, K, generator=gen)
    g = -torch.rand(1, T, HV, K, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _loss(*inputs):
    o, ht = chunk_kda(*inputs, output_final_state=True)
    return o.square().sum() + ht.sum()


def _grads(inputs, loss=_loss):
    loss(*inputs).backward()
    return [t.grad for t in inputs]


@pytest.fixture
def expected(monkeypatch):
    """The gradients of `_inputs()` through the reference (forward and backward), bitwise what the test backends
    must give (they run the reference too)."""
    monkeypatch.setenv("CULA_BACKEND", "reference")
    grads = _grads(_inputs())
    monkeypatch.delenv("CULA_BACKEND")
    return grads


def _assert_equal(grads, expected):
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_forward_feeds_another_backends_backward_that_reads_its_format(backends, expected):
    inputs = _inputs()
    _assert_equal(_grads(inputs), expected)
    assert ForwardOnly.forwards == [True]
    (Aqk, Akk), = BackwardOnly.seen  # the forward's, bitwise: Aqk = sum(q), Akk = -sum(k), [B, T, HV, 64]
    q_sum, k_sum = float(inputs[0].detach().sum()), float(inputs[1].detach().sum())
    assert torch.equal(Aqk, torch.full((1, 20, 2, 64), q_sum)) and torch.equal(Akk, torch.full((1, 20, 2, 64), -k_sum))


def test_no_residuals_when_the_backward_reads_another_format(backends, expected, monkeypatch):
    monkeypatch.setattr(BackwardOnly, "reads", ("another-format",))
    _assert_equal(_grads(_inputs()), expected)
    assert ForwardOnly.forwards == [False]  # not even asked: the memory would be spent for nothing
    assert BackwardOnly.seen == [None]


def test_no_residuals_when_the_reference_runs_the_backward(backends, expected, monkeypatch):
    """Without a backward backend (cula-sm100 not installed, on Hopper) the forward still runs on its kernel and
    saves nothing; the reference backward recomputes."""
    installed = [b for b in registry.backends() if b.name != "bwdonly"]
    monkeypatch.setattr(registry, "backends", lambda: installed)
    with pytest.warns(dispatch.CulaFallbackWarning, match="chunk_kda_backward runs on the reference"):
        _assert_equal(_grads(_inputs()), expected)
    assert ForwardOnly.forwards == [False] and BackwardOnly.seen == []


def test_no_residuals_without_gradients(backends):
    with torch.no_grad():
        chunk_kda(*_inputs())
    chunk_kda(*(t.detach() for t in _inputs()))
    assert ForwardOnly.forwards == [False, False]


def test_mixed_route_under_opcheck_and_torch_compile(backends, expected):
    """The fake op decides as the real one (opcheck compares the residual outputs); a compiled training step hands
    the forward's residuals to the other backend's backward as the eager one does."""
    flags = (None,) * 5 + (0.5, True, False, "precomputed", None, "none", True)
    torch.library.opcheck(torch.ops.cula.chunk_kda.default, (*_inputs(), *flags))
    BackwardOnly.seen.clear()
    _assert_equal(_grads(_inputs(), torch.compile(_loss, fullgraph=True, backend="aot_eager")), expected)
    assert len(BackwardOnly.seen) == 1 and BackwardOnly.seen[0] is not None


# ---- Hopper: the installed cula-sm90 forward and cula-sm100 backward

H100 = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="fake H100")


def _hopper_call(op="chunk_kda", gate="safe", lower_bound=-5.0, **kw):
    options = {"use_qk_l2norm_in_kernel": True, "beta_activation": "none", "lower_bound": lower_bound,
               "tokens": 16384, **kw.pop("options", {})}
    return CallConfig(op=op, device=H100, dtype=torch.bfloat16, K=128, V=128, HQK=32, HV=32, T=8192, gate=gate,
                      requires_grad=True, options=options, **kw)


@pytest.fixture
def hopper(monkeypatch):
    pytest.importorskip("cula_sm90")
    pytest.importorskip("cula_sm100")
    pytest.importorskip("cutlass")  # cula-sm100 serves only where CuTe DSL is installed
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    names = {b.name: b for b in registry.backends()}
    if not {"sm90", "sm100"} <= set(names):
        pytest.skip(f"cula-sm90 and cula-sm100 backends not both registered: {sorted(names)}")
    return names


def test_hopper_trains_the_safe_gate_on_sm90_forward_and_sm100_backward(hopper):
    call = _hopper_call()
    forward = dispatch.choose(call).backend
    backward_call = dataclasses.replace(call, op="chunk_kda_backward")
    backward = dispatch.choose(backward_call).backend
    assert (forward.name, backward.name) == ("sm90", "sm100")
    fmt = forward.residual_format(call)
    assert fmt == FLA_CHUNK64_RESIDUALS and backward.accepts_residuals(backward_call, fmt)
    # the same format from sm100's own forward: a backward does not care which forward made it
    assert hopper["sm100"].residual_format(call) == fmt
    assert not hopper["sm90"].accepts_residuals(backward_call, fmt)  # sm90 has no backward
    assert forward.residual_format(dataclasses.replace(call, requires_grad=False)) == ""


@pytest.mark.parametrize(("gate", "lower_bound", "tokens"), [
    ("softplus", None, 16384),  # unbounded decays: the SIMT stage 1, which does not write Akk
    ("precomputed", None, 16384),
    ("safe", -6.0, 16384),  # past the tensor-core stage 1's bound (a safe gate without safe_gate's check)
    ("safe", -5.0, 2**20 * 16),  # tokens * HV * K past int32: cula-sm100 indexes in 64 bits
])
def test_hopper_trains_the_rest_on_sm100(hopper, gate, lower_bound, tokens):
    call = _hopper_call(gate=gate, lower_bound=lower_bound, options={"tokens": tokens})
    assert dispatch.choose(call).backend.name == "sm100"
    assert "sm90 " in hopper["sm90"].unsupported_reason(call)
    # inference keeps sm90 for every gate
    assert dispatch.choose(dataclasses.replace(call, requires_grad=False)).backend.name == "sm90"


def test_forcing_sm90_cannot_train(hopper, monkeypatch):
    """CULA_BACKEND forces one backend for every op: sm90 serves the forward, and the backward call is refused
    with the reason (a training step needs CULA_BACKEND unset, or =sm100)."""
    monkeypatch.setenv("CULA_BACKEND", "sm90")
    call = _hopper_call()
    assert dispatch.choose(call).backend.name == "sm90"
    with pytest.raises(dispatch.BackendUnavailableError,
                       match="CULA_BACKEND=sm90: chunk_kda_backward: sm90 does not implement chunk_kda_backward"):
        dispatch.choose(dataclasses.replace(call, op="chunk_kda_backward"))
