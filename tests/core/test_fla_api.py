"""`chunk_kda` / `kda_prefill` take FLA 0.6.0's arguments with FLA's meaning (CPU, reference backend):
positional order, V-first states (and the deprecated alias), per-chunk intermediate states, gate parameters of
any shape, FLA's error texts, empty inputs, and the state-layout capability of backends. Every behaviour FLA's
own `tests/ops/test_kda.py` checks of `chunk_kda` has a test here; the GPU comparison with FLA itself is
tests/core/test_fla_ops_gpu.py."""

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

# FLA 0.6.0's fla.ops.kda.chunk_kda parameters, in order (fla/ops/kda/chunk.py).
FLA_CHUNK_KDA_PARAMS = [
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
    "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "cp_context",
    "use_graph", "max_num_seqs",
]


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cula_core.CulaFallbackWarning)
        yield


def inputs(B=2, T=40, HQK=1, HV=2, K=8, V=8, dtype=torch.float32, raw_gate=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = r(B, T, HQK, K).to(dtype), r(B, T, HQK, K).to(dtype)
    v = r(B, T, HV, V).to(dtype)
    g = r(B, T, HV, K) if raw_gate else F.logsigmoid(r(B, T, HV, K))
    beta = torch.rand(B, T, HV, generator=gen).to(dtype)
    h0 = r(B, HV, K, V)
    return q, k, v, g, beta, h0


def vk(state):
    return state.transpose(-1, -2).contiguous()


# ------------------------------------------------------------------------------------------------ signatures

@pytest.mark.parametrize("fn", [cula_core.chunk_kda, cula_core.kda_prefill, cula.chunk_kda])
def test_positional_order_is_flas(fn):
    params = inspect.signature(fn).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == FLA_CHUNK_KDA_PARAMS
    for name in ("A_log", "dt_bias"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_positional_flags_mean_what_flas_do():
    q, k, v, g, beta, h0 = inputs()
    logits = torch.randn_like(beta)
    # position 10: use_beta_sigmoid_in_kernel, 11: allow_neg_eigval (FLA's order; A_log does not shift them)
    o_pos, ht_pos = cula_core.chunk_kda(q, k, v, g, logits, None, h0, True, True, False, True, True)
    o_kw, ht_kw = cula_core.chunk_kda(q, k, v, g, 2 * torch.sigmoid(logits), initial_state=h0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_pos, o_kw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht_pos, ht_kw, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors

def test_chunk_size_error_text_is_flas():
    q, k, v, g, beta, _ = inputs(B=1, T=64, HV=1)
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        cula_core.chunk_kda(q, k, v, g, beta, chunk_size=16)
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        cula_core.kda_prefill(q, k, v, g, beta, chunk_size=128)


def test_unknown_keyword_and_cp_context():
    q, k, v, g, beta, _ = inputs()
    with pytest.raises(TypeError, match=r"chunk_kda\(\) got an unexpected keyword argument 'head_first'"):
        cula_core.chunk_kda(q, k, v, g, beta, head_first=True)
    with pytest.raises(ValueError, match=r"cp_context\.group is None"):
        cula_core.chunk_kda(q, k, v, g, beta, cp_context=object())
    with pytest.raises(NotImplementedError, match=r"kda_prefill does not take cp_context"):
        cula_core.kda_prefill(q, k, v, g, beta, cp_context=object())


def test_use_graph_checks_max_num_seqs_and_keeps_the_result():
    q, k, v, g, beta, _ = inputs(B=1, T=30)
    cu = torch.tensor([0, 10, 30, 30], dtype=torch.int32)
    base, ht = cula_core.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    same, ht2 = cula_core.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, use_graph=True,
                                    max_num_seqs=3)
    assert torch.equal(base, same) and torch.equal(ht, ht2)
    with pytest.raises(ValueError, match=r"max_num_seqs \+ 1 = 5 entries, got 4"):
        cula_core.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_graph=True, max_num_seqs=4)


# ------------------------------------------------------------------------------------------------ state_v_first

@pytest.mark.parametrize("varlen", [False, True])
def test_state_v_first_forward_and_gradients(varlen):
    q, k, v, g, beta, h0 = inputs(B=1 if varlen else 2, T=50)
    cu = torch.tensor([0, 17, 50], dtype=torch.int32) if varlen else None
    if varlen:
        h0 = torch.randn(2, *h0.shape[1:])
    leaves_kv = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    leaves_vk = [t.clone().requires_grad_() for t in (q, k, v, g, beta)] + [vk(h0).requires_grad_()]
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    o1, ht1 = cula_core.chunk_kda(*leaves_kv[:5], initial_state=leaves_kv[5], output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True)
    o2, ht2 = cula_core.chunk_kda(*leaves_vk[:5], initial_state=leaves_vk[5], output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True, state_v_first=True)
    assert ht2.shape == (h0.shape[0], h0.shape[1], h0.shape[3], h0.shape[2])
    torch.testing.assert_close(o2, o1, rtol=0, atol=0)
    torch.testing.assert_close(ht2, vk(ht1), rtol=0, atol=0)
    ((o1 * do).sum() + (ht1 * dht).sum()).backward()
    ((o2 * do).sum() + (ht2 * vk(dht)).sum()).backward()
    for a, b in zip(leaves_kv[:5], leaves_vk[:5], strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(leaves_vk[5].grad, vk(leaves_kv[5].grad), rtol=1e-6, atol=1e-6)


def test_state_v_first_in_kda_prefill():
    q, k, v, g, beta, h0 = inputs()
    o1, ht1 = cula_core.kda_prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, ht2 = cula_core.kda_prefill(q, k, v, g, beta, initial_state=vk(h0), output_final_state=True,
                                    state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(vk(ht1), ht2)


def test_transpose_state_layout_is_a_deprecated_alias():
    q, k, v, g, beta, h0 = inputs()
    _, ht = cula_core.chunk_kda(q, k, v, g, beta, initial_state=vk(h0), output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        _, ht_alias = cula_core.chunk_kda(q, k, v, g, beta, initial_state=vk(h0), output_final_state=True,
                                          transpose_state_layout=True)
    assert torch.equal(ht, ht_alias)
    with pytest.raises(ValueError, match="state_v_first and its deprecated alias transpose_state_layout"):
        cula_core.chunk_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


def test_state_v_first_shape_error_names_the_layout():
    q, k, v, g, beta, _ = inputs(V=6)
    bad = torch.zeros(2, 2, 8, 6)  # K-first, while V-first [N, HV, V, K] = [2, 2, 6, 8] is expected
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, V, K\] \(state_v_first=True\) = "
                                         r"\[2, 2, 6, 8\], got \[2, 2, 8, 6\]"):
        cula_core.chunk_kda(q, k, v, g, beta, initial_state=bad, state_v_first=True)


class _LayoutBackend(Backend):
    """A CPU backend serving chunk_kda by the reference; records what its kernel was handed."""

    name = "layouttest"
    package = "tests"
    ops = ("chunk_kda", "kda_prefill")

    def __init__(self, v_first: bool):
        self.v_first = v_first
        self.seen = []

    def runs_on(self, device):
        return True

    def serves_state_v_first(self, call):
        return self.v_first

    def kernel(self, op):
        from cula_core import reference_backend

        def run(*args, state_v_first=False, **kw):
            self.seen.append((args[7], state_v_first))
            h0 = args[7].transpose(-1, -2).contiguous() if state_v_first else args[7]
            o, ht = getattr(reference_backend, op)(*args[:7], h0, *args[8:], **kw)
            return o, (ht.transpose(-1, -2).contiguous() if state_v_first and ht is not None else ht)

        return run


@pytest.mark.parametrize("v_first", [False, True])
def test_backend_capability_decides_whether_core_copies(monkeypatch, v_first):
    backend = _LayoutBackend(v_first)
    monkeypatch.setattr(registry, "backends", lambda: [backend])
    q, k, v, g, beta, h0 = inputs()
    h0_vk = vk(h0)
    o, ht = cula_core.kda_prefill(q, k, v, g, beta, initial_state=h0_vk, output_final_state=True,
                                  state_v_first=True)
    handed, flag = backend.seen[-1]
    assert flag is v_first
    if v_first:  # the caller's tensor itself, no transposing copy
        assert handed.data_ptr() == h0_vk.data_ptr()
    else:  # a K-first contiguous copy
        assert torch.equal(handed, h0) and handed.is_contiguous()
    o_ref, ht_ref = cula_core.kda_prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          intracard_cp=False)
    assert torch.equal(o, o_ref) and torch.equal(ht, vk(ht_ref))


# ------------------------------------------------------------------------------------------------ intermediates

def prefix_states(q, k, v, g, beta, h0, BT, cu=None):
    """The state before each chunk, from chunk_kda's final states on growing prefixes of each sequence."""
    bounds = cu.tolist() if cu is not None else None
    out = []
    for n in range(len(bounds) - 1 if cu is not None else q.shape[0]):
        sl = slice(bounds[n], bounds[n + 1]) if cu is not None else slice(None)
        row = 0 if cu is not None else n
        seq = [t[row:row + 1, sl] for t in (q, k, v, g, beta)]
        L = seq[0].shape[1]
        for c in range(-(-L // BT)):
            part = [t[:, :c * BT] for t in seq]
            _, ht = cula_core.chunk_kda(*part, initial_state=h0[n:n + 1], output_final_state=True)
            out.append(ht[0])
    return torch.stack(out)


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_intermediate_states_are_the_states_at_chunk_starts(chunk_size):
    q, k, v, g, beta, h0 = inputs(B=2, T=100, dtype=torch.float64)
    h0 = h0.double()
    with torch.inference_mode():
        o, ht, h = cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       return_intermediate_states=True, chunk_size=chunk_size)
    NT = -(-100 // chunk_size)
    assert h.shape == (2, NT, 2, 8, 8) and h.dtype == torch.float64
    expected = prefix_states(q, k, v, g, beta, h0, chunk_size).reshape(2, NT, 2, 8, 8)
    torch.testing.assert_close(h, expected, rtol=1e-10, atol=1e-10)
    o2, ht2 = cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ht, ht2, rtol=1e-12, atol=1e-12)


def test_intermediate_states_varlen_layout_and_dtype():
    q, k, v, g, beta, _ = inputs(B=1, T=150, dtype=torch.bfloat16)
    cu = torch.tensor([0, 70, 70, 150], dtype=torch.int64)  # 2 chunks, none, 2 chunks (chunk 64)
    h0 = torch.randn(3, 2, 8, 8)
    with torch.no_grad():
        o, ht, h = cula_core.chunk_kda(q, k, v, g, beta, initial_state=vk(h0), output_final_state=False,
                                       cu_seqlens=cu, return_intermediate_states=True, state_v_first=True)
    assert ht is None
    assert h.shape == (1, 4, 2, 8, 8) and h.dtype == torch.bfloat16  # [B, NT, HV, V, K] in q's dtype
    expected = prefix_states(q.float(), k.float(), v.float(), g, beta.float(), h0, 64, cu)
    torch.testing.assert_close(h[0].float(), vk(expected), rtol=1e-2, atol=1e-2)
    assert torch.equal(h[0, 0], vk(h0[0]).bfloat16()) and torch.equal(h[0, 2], vk(h0[2]).bfloat16())
    # the same from kda_prefill
    _, _, h_p = cula_core.kda_prefill(q, k, v, g, beta, initial_state=vk(h0), cu_seqlens=cu,
                                      return_intermediate_states=True, state_v_first=True)
    assert torch.equal(h, h_p)


def test_intermediate_states_refuse_autograd_and_disable_recompute():
    q, k, v, g, beta, _ = inputs()
    with pytest.raises(ValueError, match=r"return_intermediate_states=True is for inference"):
        cula_core.chunk_kda(q.requires_grad_(), k, v, g, beta, return_intermediate_states=True)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"requires disable_recompute=False"):
        cula_core.chunk_kda(q, k, v, g, beta, return_intermediate_states=True, disable_recompute=True)


def test_intermediate_states_reference_function():
    q, k, v, g, beta, h0 = inputs(T=70)
    o, ht, h = ref.chunk_kda_states_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              chunk_size=32)
    o_r, ht_r = ref.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_r, rtol=1e-4, atol=1e-4)
    _, h32 = ref.recurrent_kda(*(t[:, :32] for t in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    assert h.shape == (2, 3, 2, 8, 8) and torch.equal(h[:, 0], h0)
    torch.testing.assert_close(h[:, 1], h32, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ gate params

@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_params_of_any_shape(lower_bound):
    q, k, v, g, beta, h0 = inputs(raw_gate=True)
    HV, K = 2, 8
    A_flat = torch.log(torch.empty(HV).uniform_(1, 16))
    b_flat = torch.randn(HV * K)
    A_4d = A_flat.reshape(1, 1, HV, 1).clone().requires_grad_()
    b_2d = b_flat.reshape(HV, K).clone().requires_grad_()
    A1, b1 = A_flat.clone().requires_grad_(), b_flat.clone().requires_grad_()
    kw = dict(initial_state=h0, output_final_state=True, use_gate_in_kernel=True, safe_gate=lower_bound is not None,
              lower_bound=lower_bound)
    o1, ht1 = cula_core.chunk_kda(q, k, v, g, beta, A_log=A1, dt_bias=b1, **kw)
    o2, ht2 = cula_core.chunk_kda(q, k, v, g, beta, A_log=A_4d, dt_bias=b_2d, **kw)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    gate = ref.kda_gate(g, A_flat, b_flat, lower_bound=lower_bound)
    o_r, _ = ref.recurrent_kda(q, k, v, gate, beta, initial_state=h0)
    torch.testing.assert_close(o2, o_r, rtol=1e-4, atol=1e-4)
    (o1.sum() + ht1.sum()).backward()
    (o2.sum() + ht2.sum()).backward()
    assert A_4d.grad.shape == (1, 1, HV, 1) and b_2d.grad.shape == (HV, K)
    torch.testing.assert_close(A_4d.grad.reshape(HV), A1.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b_2d.grad.reshape(-1), b1.grad, rtol=1e-6, atol=1e-6)


def test_gate_params_with_a_wrong_element_count():
    q, k, v, g, beta, _ = inputs(raw_gate=True)
    with pytest.raises(ValueError, match=r"A_log must have shape \[HV\] = \[2\], got \[1, 1, 3, 1\]"):
        cula_core.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(1, 1, 3, 1))
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[HV\*K\] = \[16\], got \[2, 7\]"):
        cula_core.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2, 7))


# ------------------------------------------------------------------------------------------------ empty inputs

@pytest.mark.parametrize("op", ["chunk_kda", "kda_prefill", "fused_recurrent_kda"])
@pytest.mark.parametrize("varlen", [False, True])
def test_no_tokens_returns_a_copy_of_the_initial_state(op, varlen):
    q, k, v, g, beta, _ = inputs(B=1 if varlen else 2, T=0)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32) if varlen else None
    h0 = torch.randn(2, 2, 8, 8)  # N = 2 either way
    fn = getattr(cula_core, op)
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape
    assert torch.equal(ht, h0) and ht.data_ptr() != h0.data_ptr()
    # through the dispatcher as well (where returning an input is an aliasing error)
    o, ht = fn(*(t.clone() for t in (q, k, v, g, beta)), initial_state=vk(h0), output_final_state=True,
               cu_seqlens=cu, state_v_first=True)
    assert torch.equal(ht, vk(h0))


def test_no_tokens_through_the_custom_op():
    q, k, v, g, beta, h0 = inputs(T=0)
    o, ht, _, _ = torch.ops.cula.chunk_kda(q, k, v, g, beta, None, None, h0, None, None, 0.5, True, False,
                                           "precomputed", None, "none", False, False)
    assert torch.equal(ht, h0) and ht.data_ptr() != h0.data_ptr()


# ------------------------------------------------------------------------------------------------ custom ops

def test_opcheck_new_op_arguments():
    q, k, v, g, beta, h0 = inputs(B=1, T=20, K=4, V=4)
    q.requires_grad_()
    args = (q, k, v, g, beta, None, None, vk(h0[:1]), None, None, 0.5, True, True, "precomputed", None, "none", True,
            True)
    torch.library.opcheck(torch.ops.cula.chunk_kda.default, args)
    states = (q.detach(), *args[1:-2], 32, True)
    torch.library.opcheck(torch.ops.cula.kda_prefill_chunk_states.default, states)
