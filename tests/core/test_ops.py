"""The public ops on the reference backend (CPU): results against cula_core.reference, autograd,
the decode family's pool semantics, and the torch custom-op contract (opcheck, torch.compile)."""

from __future__ import annotations

import pytest
import torch

import cula_core
from cula_core import reference as ref

F64 = torch.float64


def make_inputs(B=1, T=70, HQK=2, HV=4, K=8, V=8, dtype=F64, seed=0, raw_gate=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    q, k, v = r(B, T, HQK, K), r(B, T, HQK, K), r(B, T, HV, V)
    g = r(B, T, HV, K) if raw_gate else -torch.rand(B, T, HV, K, generator=gen, dtype=F64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    A_log, dt_bias = r(HV) * 0.5, r(HV * K) * 0.1
    return [t.to(dtype) for t in (q, k, v, g, beta)], A_log.to(dtype), dt_bias.to(dtype)


def expected(q, k, v, g, beta, A_log, dt_bias, *, gate, lower_bound=None, l2norm=True, beta_sigmoid=False, **kw):
    """The op's definition written from the reference's parts: preprocessing, then the recurrence."""
    if l2norm:
        q, k = ref.l2norm(q), ref.l2norm(k)
    if gate == "softplus":
        g = ref.softplus_gate(g, A_log, dt_bias)
    elif gate == "safe":
        g = ref.safe_gate(g, A_log, dt_bias, lower_bound)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    return ref.recurrent_kda(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "safe"])
def test_chunk_kda_matches_the_recurrence(gate):
    (q, k, v, g, beta), A_log, dt_bias = make_inputs(raw_gate=gate != "precomputed")
    h0 = torch.randn(1, 4, 8, 8, dtype=F64)
    kw = dict(use_gate_in_kernel=gate != "precomputed", A_log=A_log, dt_bias=dt_bias,
              lower_bound=-5.0 if gate == "safe" else None, safe_gate=gate == "safe")
    o, ht = cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **kw)
    o_ref, ht_ref = expected(q, k, v, g, beta, A_log, dt_bias, gate=gate, lower_bound=kw["lower_bound"],
                             beta_sigmoid=True, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)


def test_chunk_kda_varlen_with_an_empty_sequence():
    (q, k, v, g, beta), _A_log, _dt_bias = make_inputs(T=150)
    cu = torch.tensor([0, 64, 64, 65, 150], dtype=torch.int32)
    h0 = torch.randn(4, 4, 8, 8, dtype=F64)
    o, ht = cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                cu_seqlens_cpu=cu)
    o_ref, ht_ref = ref.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)  # the empty sequence keeps its state


def test_chunk_kda_bf16_returns_v_dtype_and_fp32_state():
    (q, k, v, g, beta), _, _ = make_inputs(dtype=torch.bfloat16)
    o, ht = cula_core.chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, _ = ref.recurrent_kda(*(t.double() for t in (q, k, v, g, beta)))
    assert (o.double() - o_ref).abs().max() < 2e-2 * o_ref.abs().max()


def test_chunk_kda_gradcheck_fp64():
    (q, k, v, g, beta), A_log, dt_bias = make_inputs(T=20, K=4, V=4, raw_gate=True)
    h0 = torch.randn(2, 4, 4, 4, dtype=F64)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, A_log, dt_bias, h0)]

    def f(q, k, v, g, beta, A_log, dt_bias, h0):
        return cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                   dt_bias=dt_bias, lower_bound=-3.0, cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6)


def test_chunk_kda_gradients_only_for_inputs_that_require_them():
    (q, k, v, g, beta), _, _ = make_inputs(T=10, K=4, V=4)
    v.requires_grad_()
    o, _ = cula_core.chunk_kda(q, k, v, g, beta)
    o.sum().backward()
    assert q.grad is None
    v_ref = v.detach().clone().requires_grad_()
    ref.recurrent_kda(q, k, v_ref, g, beta)[0].sum().backward()
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-10, atol=1e-10)


def test_kda_prefill_equals_chunk_kda_forward_without_a_graph():
    (q, k, v, g, beta), A_log, dt_bias = make_inputs(raw_gate=True)
    q.requires_grad_()
    kw = dict(output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o1, h1 = cula_core.kda_prefill(q, k, v, g, beta, intracard_cp=True, **kw)
    o2, h2 = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    assert not o1.requires_grad and o2.requires_grad
    torch.testing.assert_close(o1, o2.detach(), rtol=0, atol=0)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)
    with pytest.raises(ValueError, match="intracard_cp must be 'auto', True or False, got 'yes'"):
        cula_core.kda_prefill(q, k, v, g, beta, intracard_cp="yes")


# ------------------------------------------------------------------------------------------------- decode

def decode_inputs(N=5, T=3, HQK=2, HV=4, K=8, V=8, P=7, seed=0):
    (q, k, v, g, beta), A_log, dt_bias = make_inputs(B=N, T=T, HQK=HQK, HV=HV, K=K, V=V, seed=seed, raw_gate=True)
    pool = torch.randn(P, HV, K, V, dtype=F64, generator=torch.Generator().manual_seed(seed + 1))
    return (q, k, v, g, beta), A_log, dt_bias, pool


def per_request_reference(q, k, v, g, beta, A_log, dt_bias, pool, idx, lower_bound=None):
    """(o [N,T,HV,V], states after each token [N,T,HV,K,V]) request by request, from recurrent_kda."""
    gate = "safe" if lower_bound is not None else "softplus"
    outs, states = [], []
    for i, slot in enumerate(idx.tolist()):
        if slot < 0:
            outs.append(torch.zeros_like(v[i]))
            states.append(torch.zeros(q.shape[1], *pool.shape[1:], dtype=pool.dtype))
            continue
        per_token = []
        for t in range(1, q.shape[1] + 1):
            sl = lambda x, i=i, t=t: x[i : i + 1, :t]
            o_t, s_t = expected(sl(q), sl(k), sl(v), sl(g), sl(beta), A_log, dt_bias, gate=gate,
                                lower_bound=lower_bound, initial_state=pool[slot : slot + 1].clone(),
                                output_final_state=True)
            per_token.append(s_t[0])
        outs.append(o_t[0])
        states.append(torch.stack(per_token))
    return torch.stack(outs), torch.stack(states)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_decode_steps_equal_the_recurrence(lower_bound):
    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs(T=4)
    idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)
    padded_before = pool.clone()
    o_ref, states_ref = per_request_reference(q, k, v, g, beta, A_log, dt_bias, pool, idx, lower_bound)
    for t in range(4):
        sl = lambda x, t=t: x[:, t : t + 1]
        o = cula_core.kda_decode(sl(q), sl(k), sl(v), sl(g), sl(beta), pool, idx, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, o_ref[:, t : t + 1], rtol=1e-10, atol=1e-10)
    for i, slot in enumerate(idx.tolist()):
        if slot >= 0:
            torch.testing.assert_close(pool[slot], states_ref[i, -1], rtol=1e-10, atol=1e-10)
    for untouched in (1, 4, 5):  # slots no live request uses, bitwise as they were
        assert torch.equal(pool[untouched], padded_before[untouched])


def test_decode_mtp_per_token_states_and_final_state():
    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs()
    idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)
    before = pool.clone()
    o_ref, states_ref = per_request_reference(q, k, v, g, beta, A_log, dt_bias, pool, idx)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
    o, states = cula_core.kda_decode_mtp(q, k, v, g, beta, pool, idx, output_per_token_states=True, **kw)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states, states_ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(pool, before)  # per-token mode only reads the pool
    o2, none = cula_core.kda_decode_mtp(q, k, v, g, beta, pool, idx, **kw)
    assert none is None
    torch.testing.assert_close(o2, o_ref, rtol=0, atol=0)
    for i, slot in enumerate(idx.tolist()):
        if slot >= 0:
            torch.testing.assert_close(pool[slot], states_ref[i, -1], rtol=1e-10, atol=1e-10)


def test_kvbuffer_flush_equals_committing_the_accepted_state():
    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs(N=6, T=4)
    idx = torch.tensor([3, -1, 0, 6, 2, 5], dtype=torch.int32)
    accept = torch.tensor([0, 2, 1, 4, 3, 2], dtype=torch.int32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, lower_bound=-4.0)
    before = pool.clone()
    o, buf = cula_core.kda_decode_mtp_kvbuffer(q, k, v, g, beta, pool, idx, **kw)
    assert torch.equal(pool, before)
    assert buf.shape == (6, 4, 4, 2 * 8 + 8)
    o_ref, states_ref = per_request_reference(q, k, v, g, beta, A_log, dt_bias, pool, idx, lower_bound=-4.0)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(buf[1], torch.zeros_like(buf[1]))  # padded slot
    cula_core.kda_flush_kvbuffer(pool, idx, buf, accept)
    for i, (slot, m) in enumerate(zip(idx.tolist(), accept.tolist(), strict=True)):
        if slot < 0:
            continue
        if m == 0:
            assert torch.equal(pool[slot], before[slot])
        else:
            torch.testing.assert_close(pool[slot], states_ref[i, m - 1], rtol=1e-10, atol=1e-10)
    for untouched in (1, 4):
        assert torch.equal(pool[untouched], before[untouched])


def test_flush_all_layers_equals_per_layer():
    layers = []
    for layer in range(3):
        (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs(seed=layer)
        idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)
        _, buf = cula_core.kda_decode_mtp_kvbuffer(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias)
        layers.append((pool, buf))
    expected_pools = [p.clone() for p, _ in layers]
    for p, (_, buf) in zip(expected_pools, layers, strict=True):
        cula_core.kda_flush_kvbuffer(p, idx, buf, 2)
    cula_core.kda_flush_kvbuffer_all_layers([p for p, _ in layers], idx, [b for _, b in layers], 2)
    for (p, _), e in zip(layers, expected_pools, strict=True):
        assert torch.equal(p, e)


def test_kvbuffer_is_40x_smaller_than_per_token_states_at_k_v_128():
    K = V = 128
    assert (K * V) / (2 * K + V) >= 40


# --------------------------------------------------------------------------------------- custom-op contract

def test_opcheck_chunk_kda_and_prefill():
    (q, k, v, g, beta), A_log, dt_bias = make_inputs(T=10, K=4, V=4, dtype=torch.float32, raw_gate=True)
    h0 = torch.randn(1, 4, 4, 4)
    q.requires_grad_()
    args = (q, k, v, g, beta, A_log, dt_bias, h0, None, None, 0.5, True, True, "softplus", None, "none", True)
    torch.library.opcheck(torch.ops.cula.chunk_kda.default, args)
    # kda_prefill is inference only (no autograd formula): checked on inputs that do not require grad.
    torch.library.opcheck(torch.ops.cula.kda_prefill.default, (q.detach(), *args[1:-1], "auto"))


def test_opcheck_decode_family():
    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs()
    q, k, v, g, beta, A_log, dt_bias, pool = (t.float() for t in (q, k, v, g, beta, A_log, dt_bias, pool))
    idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)
    common = (q, k, v, g, beta, pool, idx, A_log, dt_bias, 0.3, None, True)
    torch.library.opcheck(torch.ops.cula.kda_decode.default, (q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                                                              *common[5:]))
    torch.library.opcheck(torch.ops.cula.kda_decode_mtp.default, (*common, True))
    _, buf = torch.ops.cula.kda_decode_mtp_kvbuffer(*common)
    torch.library.opcheck(torch.ops.cula.kda_decode_mtp_kvbuffer.default, common)
    torch.library.opcheck(torch.ops.cula.kda_flush_kvbuffer.default, (pool, idx, buf, None, 2))
    torch.library.opcheck(torch.ops.cula.kda_flush_kvbuffer_all_layers.default,
                          ([pool, pool.clone()], idx, [buf, buf.clone()], idx.clamp(0, 3), 0))


def test_torch_compile_fullgraph():
    (q, k, v, g, beta), A_log, dt_bias = make_inputs(T=20, K=4, V=4, dtype=torch.float32, raw_gate=True)

    def layer(q, k, v, g, beta):
        o, ht = cula_core.chunk_kda(q, k, v, g, beta, output_final_state=True, use_gate_in_kernel=True,
                                    A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
        return o * 2, ht

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    o, ht = compiled(q, k, v, g, beta)
    o_ref, ht_ref = layer(q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


def test_eager_decode_calls_skip_the_dispatcher_with_the_ops_effects():
    """Eager calls run the op's implementation directly (ops/_common.call_op): same outputs and pool as
    the custom op, and the pool's version counter bumped as the op bumps it."""
    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs()
    idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)
    pool_op = pool.clone()
    v0, v0_op = pool._version, pool_op._version
    o = cula_core.kda_decode_mtp(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, scale=0.3)[0]
    o_op, _ = torch.ops.cula.kda_decode_mtp(q, k, v, g, beta, pool_op, idx, A_log, dt_bias, 0.3, None, False, False)
    assert torch.equal(o, o_op) and torch.equal(pool, pool_op)
    assert pool._version > v0 and pool_op._version > v0_op
    before = pool._version
    cula_core.kda_flush_kvbuffer_all_layers([pool], idx, [torch.zeros(5, 3, 4, 24, dtype=F64)], 0)
    assert pool._version > before


def test_traced_decode_calls_go_through_the_op():
    """Under tracing (make_fx: a dispatch mode is active) the graph holds the op, not its internals."""
    from torch.fx.experimental.proxy_tensor import make_fx

    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs()
    idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)

    def step(q, k, v, g, beta, pool, idx):
        return cula_core.kda_decode_mtp_kvbuffer(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias)

    graph = make_fx(step)(q, k, v, g, beta, pool, idx)
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "cula.kda_decode_mtp_kvbuffer.default" in targets, targets


def test_torch_compile_fullgraph_decode_family():
    """Under torch.compile the decode ops stay single graph nodes (call_op takes the op path while compiling)."""
    (q, k, v, g, beta), A_log, dt_bias, pool = decode_inputs()
    q, k, v, g, beta, A_log, dt_bias, pool = (t.float() for t in (q, k, v, g, beta, A_log, dt_bias, pool))
    idx = torch.tensor([3, -1, 0, 6, 2], dtype=torch.int32)

    def step(pool):
        o, buf = cula_core.kda_decode_mtp_kvbuffer(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias)
        cula_core.kda_flush_kvbuffer(pool, idx, buf, 2)
        return o * 2

    compiled_pool, eager_pool = pool.clone(), pool.clone()
    o = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_pool)
    o_ref = step(eager_pool)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(compiled_pool, eager_pool, rtol=0, atol=0)
    assert not torch.equal(compiled_pool, pool)  # the flush did write the live slots
