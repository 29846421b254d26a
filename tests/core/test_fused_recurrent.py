"""`fused_recurrent_kda` on the reference backend (CPU): FLA 0.6.0's signature and results, and the
continuous-batching mode of FLA's kernel (state pools, slot indices, accepted draft tokens), every behaviour
FLA's `tests/ops/test_kda.py` checks of it, plus padding, bf16 / V-first pools, validation before any write,
dispatch to a backend kernel, and the custom-op contract."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import cula
import cula_core
from cula_core import registry
from cula_core import reference as ref
from cula_core.backend import Backend

# FLA 0.6.0's fla.ops.kda.fused_recurrent_kda parameters, in order (fla/ops/kda/fused_recurrent.py).
FLA_PARAMS = [
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state", "output_final_state",
    "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound",
    "state_v_first", "cu_seqlens",
]
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cula_core.CulaFallbackWarning)
        yield


def inputs(B=2, T=12, HQK=1, HV=2, K=8, V=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(B, T, HQK, K).to(dtype), r(B, T, HQK, K).to(dtype), r(B, T, HV, V).to(dtype)
    g = F.logsigmoid(r(B, T, HV, K))
    beta = torch.rand(B, T, HV, generator=gen).to(dtype)
    return q, k, v, g, beta


def recurrent(q, k, v, g, beta, h0=None, cu=None, scale=None):
    """The definition on L2-normalised q / k, fp32."""
    return ref.recurrent_kda(ref.l2norm(q.float()), ref.l2norm(k.float()), v.float(), g.float(), beta.float(),
                             scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)


def plain(q, k, v, g, beta, h0):
    """The definition on q / k as given."""
    return ref.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def vk(state):
    return state.transpose(-1, -2).contiguous()


def test_signature_is_flas():
    for fn in (cula_core.fused_recurrent_kda, cula.fused_recurrent_kda):
        params = inspect.signature(fn).parameters
        assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == FLA_PARAMS


# ------------------------------------------------------------------------------------------------ FLA's modes

@pytest.mark.parametrize("HQK,HV,scale,l2_in_kernel", [(1, 1, 1.0, False), (2, 4, 0.1, True), (1, 3, None, True)])
def test_matches_the_recurrent_definition(HQK, HV, scale, l2_in_kernel):
    q, k, v, g, beta = inputs(HQK=HQK, HV=HV)
    h0 = torch.randn(2, HV, 8, 8)
    o_ref, ht_ref = recurrent(q, k, v, g, beta, h0, scale=scale)
    qi, ki = (q, k) if l2_in_kernel else (ref.l2norm(q), ref.l2norm(k))
    o, ht = cula_core.fused_recurrent_kda(qi, ki, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=l2_in_kernel)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)
    assert ht.dtype == torch.float32 and not o.requires_grad
    _, none = cula_core.fused_recurrent_kda(qi, ki, v, g, beta, scale=scale, initial_state=h0,
                                            use_qk_l2norm_in_kernel=l2_in_kernel)
    assert none is None


def test_matches_chunk_kda():
    q, k, v, g, beta = inputs(T=70)
    h0 = torch.randn(2, 2, 8, 8)
    o1, ht1 = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    o2, ht2 = cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o1, o2, **TOL)
    torch.testing.assert_close(ht1, ht2, **TOL)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_sigmoid_in_kernel(allow_neg_eigval):
    q, k, v, g, _ = inputs()
    logits = torch.randn(2, 12, 2)
    h0 = torch.randn(2, 2, 8, 8)
    post = torch.sigmoid(logits) * (2 if allow_neg_eigval else 1)
    o_ref, ht_ref = cula_core.fused_recurrent_kda(q, k, v, g, post, initial_state=h0, output_final_state=True)
    o, ht = cula_core.fused_recurrent_kda(q, k, v, g, logits, initial_state=h0, output_final_state=True,
                                          use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"):
        cula_core.fused_recurrent_kda(q, k, v, g, logits, allow_neg_eigval=True)


def test_beta_per_value_channel():
    q, k, v, g, beta = inputs()
    beta4 = torch.rand(2, 12, 2, 8)
    o, ht = cula_core.fused_recurrent_kda(q, k, v, g, beta4, output_final_state=True, use_qk_l2norm_in_kernel=True)
    # by hand: the delta of value channel j is scaled by beta4[..., j]
    qn, kn = ref.l2norm(q).repeat_interleave(2, 2), ref.l2norm(k).repeat_interleave(2, 2)
    S = torch.zeros(2, 2, 8, 8)
    for t in range(12):
        S = S * g[:, t].exp()[..., None]
        pred = torch.einsum("nhk,nhkv->nhv", kn[:, t], S)
        S = S + kn[:, t][..., None] * (beta4[:, t] * (v[:, t] - pred))[:, :, None, :]
        torch.testing.assert_close(o[:, t], torch.einsum("nhk,nhkv->nhv", qn[:, t] * 8 ** -0.5, S), **TOL)
    torch.testing.assert_close(ht, S, **TOL)


def test_state_v_first_and_its_alias():
    q, k, v, g, beta = inputs()
    h0 = torch.randn(2, 2, 8, 8)
    o1, ht1 = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, ht2 = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=vk(h0), output_final_state=True,
                                            state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(vk(ht1), ht2)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o3, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=vk(h0), transpose_state_layout=True)
    assert torch.equal(o3, o1)
    with pytest.raises(ValueError, match="state_v_first and its deprecated alias"):
        cula_core.fused_recurrent_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("has_a_log,has_dt_bias,lower_bound", [
    (True, False, None), (True, True, None), (True, True, -5.0), (False, False, -5.0), (False, True, -3.0),
])
def test_gate_in_kernel(has_a_log, has_dt_bias, lower_bound):
    q, k, v, g, beta = inputs(HQK=1, HV=4)
    raw = torch.randn_like(g)
    A_log = torch.log(torch.empty(4).uniform_(1, 16)) if has_a_log else None
    dt_bias = torch.randn(4 * 8) if has_dt_bias else None
    h0 = torch.randn(2, 4, 8, 8)
    gate = ref.kda_gate(raw, A_log, dt_bias, lower_bound=lower_bound)
    o_ref, ht_ref = cula_core.fused_recurrent_kda(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    o, ht = cula_core.fused_recurrent_kda(
        q, k, v, raw, beta, A_log.reshape(1, 1, 4, 1) if has_a_log else None, dt_bias, initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lower_bound)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-6, atol=1e-6)


def test_varlen_rows_equal_separate_calls():
    q, k, v, g, beta = inputs(B=1, T=20)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    h0 = torch.randn(3, 2, 8, 8)
    o, ht = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    for n, (a, b) in enumerate([(0, 7), (7, 7), (7, 20)]):
        o_n, ht_n = recurrent(*(t[:, a:b] for t in (q, k, v, g, beta)), h0[n:n + 1])
        torch.testing.assert_close(o[:, a:b], o_n, **TOL)
        torch.testing.assert_close(ht[n:n + 1], ht_n, **TOL)
    with pytest.raises(ValueError, match=r"cu_seqlens requires batch size B == 1"):
        cula_core.fused_recurrent_kda(*(torch.cat([t, t]) for t in (q, k, v, g, beta)), cu_seqlens=cu)


# ------------------------------------------------------------------------------------------------ state pools

def pool_and_slots(P, HV=2, K=8, V=8, dtype=torch.float32):
    pool = torch.full((P, HV, K, V), 1e30).to(dtype)  # any read of a slot not given would show
    return pool


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
def test_decode_over_a_pool(pool_dtype, v_first):
    """vLLM's decode: one token per request in one varlen row, 1-D slots, the pool updated in place."""
    N, P = 5, 12
    q, k, v, g, beta = inputs(B=1, T=N)
    cu = torch.arange(N + 1, dtype=torch.int32)
    slots = torch.tensor([7, 2, 11, 0, 5], dtype=torch.int32)
    states = torch.randn(N, 2, 8, 8).to(pool_dtype)
    pool = pool_and_slots(P, dtype=pool_dtype)
    pool[slots.long()] = vk(states) if v_first else states
    before = pool.clone()
    o, ret = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                           use_qk_l2norm_in_kernel=True, state_v_first=v_first,
                                           ssm_state_indices=slots)
    assert ret is pool
    o_ref, ht_ref = recurrent(q, k, v, g, beta, states.float(), cu)
    torch.testing.assert_close(o, o_ref, **TOL)
    written = pool[slots.long()]
    torch.testing.assert_close(written, (vk(ht_ref) if v_first else ht_ref).to(pool_dtype), rtol=0, atol=0)
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_per_token_slots_and_accepted_tokens():
    """Speculative decoding: [N, T] slots, the state after token t goes to slots[n, t]; the read slot is
    slots[n, num_accepted_tokens[n] - 1]."""
    N, T, P = 3, 4, 16
    q, k, v, g, beta = inputs(B=N, T=T)
    slots = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    accepted = torch.tensor([1, 3, 4], dtype=torch.int32)
    pool = torch.randn(P, 2, 8, 8)
    before = pool.clone()
    read = torch.stack([before[slots[n, accepted[n] - 1]] for n in range(N)])
    o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, use_qk_l2norm_in_kernel=True,
                                         ssm_state_indices=slots, num_accepted_tokens=accepted)
    o_ref, _ = recurrent(q, k, v, g, beta, read)
    torch.testing.assert_close(o, o_ref, **TOL)
    for t in range(T):
        _, ht_t = recurrent(*(x[:, :t + 1] for x in (q, k, v, g, beta)), read)
        torch.testing.assert_close(pool[slots[:, t].long()], ht_t, **TOL)
    assert torch.equal(pool[12:], before[12:])


def test_per_token_slots_in_a_varlen_row():
    """Columns past a sequence's length are not written; an empty sequence reads and writes nothing."""
    P = 10
    q, k, v, g, beta = inputs(B=1, T=5)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    slots = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    pool = torch.randn(P, 2, 8, 8)
    before = pool.clone()
    o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                         ssm_state_indices=slots)
    for n, (a, b) in enumerate([(0, 3), (3, 3), (3, 5)]):
        for t in range(b - a):
            _, ht = ref.recurrent_kda(*(x[:, a:a + t + 1] for x in (q, k, v, g, beta)),
                                      initial_state=before[slots[n, 0]][None], output_final_state=True)
            torch.testing.assert_close(pool[slots[n, t]], ht[0], **TOL)
    for s in (3, 4, 5, 8, 9):  # sequence 1 (empty), the unused column of sequence 2, the slot never named
        assert torch.equal(pool[s], before[s])
    assert o.shape == v.shape


def test_negative_slots_are_padding():
    q, k, v, g, beta = inputs(B=3, T=2)
    pool = torch.randn(6, 2, 8, 8)
    before = pool.clone()
    o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,
                                         ssm_state_indices=torch.tensor([2, -1, 4], dtype=torch.int64))
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    o_ref, ht_ref = plain(q[[0, 2]], k[[0, 2]], v[[0, 2]], g[[0, 2]], beta[[0, 2]], before[[2, 4]])
    torch.testing.assert_close(o[[0, 2]], o_ref, **TOL)
    torch.testing.assert_close(pool[[2, 4]], ht_ref, **TOL)
    assert torch.equal(pool[[0, 1, 3, 5]], before[[0, 1, 3, 5]])
    # per-token slots: a negative write slot skips that write only; a negative read slot pads the sequence
    pool = before.clone()
    slots = torch.tensor([[0, -1], [-1, 3], [5, 1]], dtype=torch.int32)
    o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(pool[3], before[3])
    _, ht0 = plain(q[:1, :1], k[:1, :1], v[:1, :1], g[:1, :1], beta[:1, :1], before[:1])
    torch.testing.assert_close(pool[0], ht0[0], **TOL)
    _, ht2 = plain(q[2:], k[2:], v[2:], g[2:], beta[2:], before[5:6])
    torch.testing.assert_close(pool[1], ht2[0], **TOL)


# ------------------------------------------------------------------------------------------------ validation

POOL_CASES = [
    (dict(ssm_state_indices=torch.tensor([0, 9], dtype=torch.int32)), ValueError,
     r"ssm_state_indices\[1\] = 9 is out of range for a state pool of P = 6 slots"),
    (dict(ssm_state_indices=torch.tensor([2, 2], dtype=torch.int32)), ValueError,
     r"ssm_state_indices gives slot 2 to sequences 0 and 1"),
    (dict(ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 1]], dtype=torch.int32)), ValueError,
     r"gives slot 1 to sequences 0 and 1"),
    (dict(ssm_state_indices=torch.tensor([0, 1], dtype=torch.int32),
          num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32)), ValueError,
     r"num_accepted_tokens requires ssm_state_indices of shape \[N, T\]"),
    (dict(ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
          num_accepted_tokens=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
     r"num_accepted_tokens\[0\] = 0 is outside \[1, T\] = \[1, 3\]"),
    (dict(ssm_state_indices=torch.tensor([[0, 1], [3, 4]], dtype=torch.int32)), ValueError,
     r"needs a slot for every token: sequence 0 has 3 tokens, ssm_state_indices has 2 columns"),
    (dict(ssm_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError,
     r"ssm_state_indices must have N = 2 rows"),
    (dict(ssm_state_indices=torch.tensor([0.0, 1.0])), TypeError,
     r"ssm_state_indices must have dtype in \(int32, int64\), got float32"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(6, 2, 7, 8)), ValueError,
     r"initial_state \(the state pool\) must have shape \[P, HV, K, V\] = \[P, 2, 8, 8\], got \[6, 2, 7, 8\]"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(6, 2, 8, 8, dtype=torch.int32)),
     TypeError, r"initial_state must have dtype in \(float16, bfloat16, float32\), got int32"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state=None), ValueError,
     r"ssm_state_indices requires initial_state"),
    (dict(num_accepted_tokens=torch.tensor([1, 1])), ValueError, r"num_accepted_tokens requires ssm_state_indices"),
    (dict(initial_state=torch.zeros(3, 2, 8, 8)), ValueError,
     r"initial_state must have shape \[N, HV, K, V\] = \[2, 2, 8, 8\], got \[3, 2, 8, 8\]"),
    (dict(bogus=1), TypeError, r"fused_recurrent_kda\(\) got an unexpected keyword argument 'bogus'"),
    (dict(use_gate_in_kernel=True), ValueError, r"use_gate_in_kernel=True requires A_log"),
]


@pytest.mark.parametrize("changes,exc,message", POOL_CASES, ids=[m[:40] for _, _, m in POOL_CASES])
def test_bad_arguments_are_rejected_before_any_write(changes, exc, message):
    q, k, v, g, beta = inputs(B=2, T=3)
    pool = torch.randn(6, 2, 8, 8)
    before = pool.clone()
    kw = dict(initial_state=pool)
    kw.update(changes)
    with pytest.raises(exc, match=message):
        cula_core.fused_recurrent_kda(q, k, v, g, beta, **kw)
    assert torch.equal(pool, before)


def test_non_contiguous_pool_slots_are_rejected_but_a_slot_stride_is_accepted():
    q, k, v, g, beta = inputs(B=2, T=1)
    big = torch.randn(6, 2, 2, 8, 8)
    pool = big[:, 0]  # slot stride 2 * HV * K * V, slots contiguous
    before = big.clone()
    o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,
                                         ssm_state_indices=torch.tensor([1, 4]))
    _, ht = ref.recurrent_kda(q, k, v, g, beta, initial_state=before[[1, 4], 0], output_final_state=True)
    torch.testing.assert_close(big[[1, 4], 0], ht, **TOL)
    assert torch.equal(big[:, 1], before[:, 1])
    with pytest.raises(ValueError, match=r"must have contiguous slots"):
        cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=big[:, :, 0].transpose(-1, -2),
                                      ssm_state_indices=torch.tensor([1, 4]))


# ------------------------------------------------------------------------------------------------ dispatch

class _PoolBackend(Backend):
    """A CPU backend whose fused_recurrent_kda kernel is the reference's; records the pool it was handed."""

    name = "pooltest"
    package = "tests"
    ops = ("fused_recurrent_kda",)

    def __init__(self, v_first: bool):
        self.v_first = v_first
        self.handed = []

    def runs_on(self, device):
        return True

    def serves_state_v_first(self, call):
        return self.v_first

    def kernel(self, op):
        from cula_core import reference_backend

        def run(*args, **kw):
            self.handed.append((args[7], kw.get("state_v_first", False)))
            return reference_backend.fused_recurrent_kda(*args, **kw)

        return run


@pytest.mark.parametrize("v_first", [False, True])
def test_a_backend_serving_fused_recurrent_kda_gets_the_pool(monkeypatch, v_first):
    backend = _PoolBackend(v_first)
    monkeypatch.setattr(registry, "backends", lambda: [backend])
    q, k, v, g, beta = inputs(B=2, T=1)
    pool = torch.randn(4, 2, 8, 8)
    expected = pool.clone()
    cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=expected, ssm_state_indices=torch.tensor([3, 0]),
                                  state_v_first=True)
    monkeypatch.setattr(registry, "backends", lambda: [backend])
    o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,
                                         ssm_state_indices=torch.tensor([3, 0]), state_v_first=True)
    handed, flag = backend.handed[-1]
    assert flag is v_first
    if v_first:
        assert handed is pool
    else:  # a K-first copy of the V-first pool, copied back after the kernel
        assert handed.data_ptr() != pool.data_ptr() and handed.is_contiguous()
    torch.testing.assert_close(pool, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ custom ops

def test_opcheck():
    q, k, v, g, beta = inputs(B=2, T=3, K=4, V=4)
    h0 = torch.randn(2, 2, 4, 4)
    torch.library.opcheck(torch.ops.cula.fused_recurrent_kda.default,
                          (q, k, v, g, beta, None, None, h0, None, 0.5, True, True, "precomputed", None, "none", True))
    pool = torch.randn(5, 2, 4, 4)
    slots = torch.tensor([[4, 1, 0], [2, -1, 3]], dtype=torch.int32)
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cula.fused_recurrent_kda_pool.default,
                          (q, k, v, g, beta, None, None, pool, slots, accepted, None, 0.5, True, "precomputed", None,
                           "sigmoid", False))


def test_torch_compile_pool_decode():
    q, k, v, g, beta = inputs(B=2, T=1)
    pool = torch.randn(4, 2, 8, 8)
    eager = pool.clone()
    slots = torch.tensor([3, 1], dtype=torch.int32)

    def step(q, k, v, g, beta, pool):
        o, _ = cula_core.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots,
                                             use_qk_l2norm_in_kernel=True)
        return o * 2

    o_eager = step(q, k, v, g, beta, eager)
    o = torch.compile(step, fullgraph=True, backend="eager")(q, k, v, g, beta, pool)
    torch.testing.assert_close(o, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(pool, eager, rtol=0, atol=0)
