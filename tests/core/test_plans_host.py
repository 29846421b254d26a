"""The ops' plan paths (cula_core.plans) on the CPU. Plans are made for CUDA tensors only, so these tests key host
tensors with a signature of their own (set over `plans.signature`, which the ops call) and run the reference
backend through the plan code that a GPU call runs: a repeated call gives the full path's results bitwise (the
full path forced by a non-contiguous view, which gets no signature), makes no autograd graph, checks host lengths
on every call, takes FLA's any-shape gate parameters, ignores them without the gate in kernel, and bumps a pool's
version counter."""

import warnings

import pytest
import torch

import cula
from cula_core import plans

H, K = 2, 8


def _host_signature(op, tensors, scalars):
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return None
    return (op, scalars, tuple(map(type, scalars)),
            tuple(None if t is None else (t.shape, t.dtype) for t in tensors))


@pytest.fixture(autouse=True)
def host_plans(monkeypatch):
    monkeypatch.setattr(plans, "signature", _host_signature)
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    plans.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference's fallback warning (inputs on the CPU)
        yield
    plans.forget()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a non-contiguous view: the call takes the full path."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _prefill_inputs(lengths=(5, 0, 9)):
    T = sum(lengths)
    q, k, v = (torch.randn(1, T, H, K) for _ in range(3))
    g, beta = torch.randn(1, T, H, K), torch.rand(1, T, H)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              A_log=torch.rand(1, 1, H, 1), dt_bias=0.1 * torch.randn(H * K), output_final_state=True,
              initial_state=0.1 * torch.randn(len(lengths), H, K, K), cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    return [q, k, v, g, beta], kw


def test_prefill_plan_matches_the_full_path_bitwise():
    x, kw = _prefill_inputs()
    o_first, s_first = cula.kda_prefill(*x, **kw)
    assert plans.count() == 1
    o_full, s_full = cula.kda_prefill(_strided(x[0]), *x[1:], **kw)
    o_plan, s_plan = cula.kda_prefill(*x, **kw)
    assert plans.count() == 1
    assert torch.equal(o_plan, o_full) and torch.equal(s_plan, s_full)
    assert torch.equal(o_first, o_full) and torch.equal(s_first, s_full)
    assert s_plan.data_ptr() != kw["initial_state"].data_ptr()  # a new state, never the caller's
    o_none, s_none = cula.kda_prefill(*x, **dict(kw, output_final_state=False))
    assert s_none is None and torch.equal(o_none, o_full)


def test_prefill_plan_ignores_gate_parameters_without_the_gate_in_kernel():
    x, kw = _prefill_inputs()
    kw.update(use_gate_in_kernel=False, safe_gate=False, lower_bound=None)
    x[3] = -torch.rand_like(x[3])  # a log decay
    without = {n: a for n, a in kw.items() if n not in ("A_log", "dt_bias")}
    o_ref, s_ref = cula.kda_prefill(_strided(x[0]), *x[1:], **without)
    for _ in range(2):  # makes the plan, then runs it
        o, s = cula.kda_prefill(*x, **kw)
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert plans.count() == 1


@pytest.mark.parametrize("grad_input", [None, 0, 5, 7])
def test_prefill_plan_makes_no_graph(grad_input):
    x, kw = _prefill_inputs()
    if grad_input is not None:  # q, A_log or the initial state requires grad
        if grad_input < 5:
            x[grad_input].requires_grad_(True)
        else:
            kw["A_log" if grad_input == 5 else "initial_state"].requires_grad_(True)
    for _ in range(2):
        o, s = cula.kda_prefill(*x, **kw)
        assert not o.requires_grad and o.grad_fn is None
        assert not s.requires_grad and s.grad_fn is None
    assert plans.count() == 1


def test_prefill_plan_checks_host_lengths_every_call():
    x, kw = _prefill_inputs()
    cula.kda_prefill(*x, **kw)
    bad = kw["cu_seqlens_cpu"].clone()
    bad[1] = bad[2] + 1
    with pytest.raises(ValueError, match="non-decreasing"):
        cula.kda_prefill(*x, **dict(kw, cu_seqlens=bad, cu_seqlens_cpu=bad.clone()))
    short = kw["cu_seqlens_cpu"].clone()
    short[-1] -= 1
    with pytest.raises(ValueError, match="must end at T"):
        cula.kda_prefill(*x, **dict(kw, cu_seqlens=short, cu_seqlens_cpu=short.clone()))
    with pytest.raises(ValueError, match="must hold the values of cu_seqlens"):
        cula.kda_prefill(*x, **dict(kw, cu_seqlens_cpu=bad))
    assert plans.count() == 1


@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunk_kda_inference_plan_matches_the_full_path_bitwise(state_v_first):
    """chunk_kda without a graph to record (grad disabled, or no input requiring grad) runs a plan on a repeated
    signature: the full path's results bitwise, the states in the caller's layout, a new final state."""
    x, kw = _prefill_inputs()
    if state_v_first:
        kw.update(state_v_first=True, initial_state=kw["initial_state"].transpose(-1, -2).contiguous())
    o_first, s_first = cula.chunk_kda(*x, **kw)
    assert plans.count() == 1
    o_full, s_full = cula.chunk_kda(_strided(x[0]), *x[1:], **kw)
    with torch.no_grad():
        o_plan, s_plan = cula.chunk_kda(*x, **kw)
    assert plans.count() == 1
    assert torch.equal(o_plan, o_full) and torch.equal(s_plan, s_full)
    assert torch.equal(o_first, o_full) and torch.equal(s_first, s_full)
    assert s_plan.data_ptr() != kw["initial_state"].data_ptr()
    o_none, s_none = cula.chunk_kda(*x, **dict(kw, output_final_state=False))
    assert s_none is None and torch.equal(o_none, o_full)


def test_chunk_kda_with_grad_takes_no_plan_and_keeps_its_graph():
    """An input that requires grad (grad enabled) makes chunk_kda record its graph: no plan is made or used, even
    after an inference call of the same signature made one."""
    x, kw = _prefill_inputs()
    cula.chunk_kda(*x, **kw)
    assert plans.count() == 1
    x[0].requires_grad_(True)
    o, s = cula.chunk_kda(*x, **kw)
    assert o.grad_fn is not None and s.grad_fn is not None
    (o.sum() + s.sum()).backward()
    assert x[0].grad is not None and x[0].grad.abs().sum() > 0
    assert plans.count() == 1
    with torch.no_grad():  # the same tensors under no_grad: inference again, the plan runs
        o2, _ = cula.chunk_kda(*x, **kw)
    assert o2.grad_fn is None and torch.equal(o2, o.detach())


def test_chunk_kda_plan_checks_host_lengths_every_call():
    x, kw = _prefill_inputs()
    cula.chunk_kda(*x, **kw)
    bad = kw["cu_seqlens_cpu"].clone()
    bad[1] = bad[2] + 1
    with pytest.raises(ValueError, match="must hold the values of cu_seqlens"):
        cula.chunk_kda(*x, **dict(kw, cu_seqlens_cpu=bad))
    assert plans.count() == 1


def _decode_inputs(N=3, T=1, P=6):
    x = [torch.randn(N, T, H, K) for _ in range(4)] + [torch.rand(N, T, H)]
    pool = 0.1 * torch.randn(P, H, K, K)
    idx = torch.tensor([4, -1, 1][:N], dtype=torch.int32)
    return x, pool, idx, dict(A_log=torch.rand(H), dt_bias=0.1 * torch.randn(H * K), use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("op", ["kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer"])
def test_decode_plans_match_the_full_path_bitwise(op):
    fn = getattr(cula, op)
    x, pool0, idx, kw = _decode_inputs(T=1 if op == "kda_decode" else 3)
    pools = [pool0.clone() for _ in range(3)]
    first = fn(*x, pools[0], idx, **kw)
    assert plans.count() == 1
    full = fn(_strided(x[0]), *x[1:], pools[1], idx, **kw)
    before = pools[2]._version
    plan = fn(*x, pools[2], idx, **kw)
    assert plans.count() == 1
    for a, b in ((first, full), (plan, full)):
        for ta, tb in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
            assert (ta is None and tb is None) or torch.equal(ta, tb)
    assert torch.equal(pools[0], pools[1]) and torch.equal(pools[2], pools[1])
    if op == "kda_decode_mtp_kvbuffer":  # reads the pool only
        assert torch.equal(pools[1], pool0)
    else:
        assert not torch.equal(pools[1], pool0) and pools[2]._version > before
