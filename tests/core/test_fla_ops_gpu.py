"""cula's FLA-API ops against FLA 0.6.0 itself on the same inputs (GPU machine, FLA installed): `chunk_kda`
with V-first states, per-chunk intermediate states and A_log of FLA's test shapes, and `fused_recurrent_kda`
in every mode FLA's kernel has (plain, varlen, gate in kernel, beta sigmoid, V-first, state pools with [N] and
[N, T] slots and accepted tokens, fp32 and bf16 pools). Whatever backend serves each call on this machine is
what is compared. Run: `pytest -m gpu tests/core/test_fla_ops_gpu.py`."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import cula_core

pytestmark = pytest.mark.gpu

fla_kda = pytest.importorskip("fla.ops.kda", reason="FLA 0.6.0 is installed on the GPU machine only")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cula_core.CulaFallbackWarning)
        yield


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def chunk_inputs(B, T, H, HV, K, dtype=torch.bfloat16, seed=0, raw_gate=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)
    q, k, v = r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype), r(B, T, HV, K).to(dtype)
    g = r(B, T, HV, K) if raw_gate else F.logsigmoid(r(B, T, HV, K))
    beta = torch.rand(B, T, HV, generator=gen, device=DEV).to(dtype)
    h0 = r(B, HV, K, K) * 0.1
    return q, k, v, g, beta, h0


def test_signatures_are_flas():
    def positional(fn):
        return [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional(cula_core.chunk_kda) == positional(fla_kda.chunk_kda)
    assert positional(cula_core.fused_recurrent_kda) == positional(fla_kda.fused_recurrent_kda)


def test_chunk_size_error_matches_fla():
    q, k, v, g, beta, _ = chunk_inputs(1, 64, 1, 1, 64, dtype=torch.float32)
    for fn in (fla_kda.chunk_kda, cula_core.chunk_kda):
        with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
            fn(q, k, v, g, beta, chunk_size=16)


@pytest.mark.parametrize("B,T,H,HV,K,grad", [(2, 500, 2, 2, 128, False), (2, 300, 2, 4, 128, True),
                                              (1, 1000, 4, 4, 64, True)])
def test_chunk_kda_state_v_first_vs_fla(B, T, H, HV, K, grad):
    q, k, v, g, beta, h0 = chunk_inputs(B, T, H, HV, K, seed=T)
    h0_vk = h0.transpose(-1, -2).contiguous()
    kw = dict(initial_state=h0_vk, output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True)
    outs = {}
    for name, fn in (("fla", fla_kda.chunk_kda), ("cula", cula_core.chunk_kda)):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v, g, beta)] + [h0_vk.clone().requires_grad_(grad)]
        o, ht = fn(*leaves[:5], **{**kw, "initial_state": leaves[5]})
        grads = None
        if grad:
            torch.manual_seed(1)
            ((o.float() * torch.randn_like(o.float())).sum() + (ht * torch.randn_like(ht)).sum()).backward()
            grads = [t.grad for t in leaves]
        outs[name] = (o, ht, grads)
    (o_f, ht_f, g_f), (o_c, ht_c, g_c) = outs["fla"], outs["cula"]
    assert ht_c.shape == ht_f.shape == (B, HV, K, K)
    assert rel(o_c, o_f) < 2e-2 and rel(ht_c, ht_f) < 2e-2
    if grad:
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_c, g_f, strict=True):
            assert rel(a, b) < 3e-2, name


@pytest.mark.parametrize("varlen,chunk_size,v_first", [(False, 64, False), (False, 32, True), (True, 64, True),
                                                        (True, 32, False)])
def test_intermediate_states_vs_fla(varlen, chunk_size, v_first):
    B, T, H, K = (1, 1000, 4, 128) if varlen else (2, 1024, 4, 128)
    q, k, v, g, beta, h0 = chunk_inputs(B, T, H, H, K)
    cu = torch.tensor([0, 100, 100, 555, 1000], dtype=torch.int64, device=DEV) if varlen else None
    if varlen:
        h0 = torch.randn(4, H, K, K, device=DEV) * 0.1
    h0 = h0.transpose(-1, -2).contiguous() if v_first else h0
    kw = dict(initial_state=h0, output_final_state=True, return_intermediate_states=True, state_v_first=v_first,
              cu_seqlens=cu, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True)
    with torch.inference_mode():
        o_f, ht_f, h_f = fla_kda.chunk_kda(q, k, v, g, beta, **kw)
        o_c, ht_c, h_c = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    assert h_c.shape == h_f.shape and h_c.dtype == h_f.dtype == torch.bfloat16
    assert rel(o_c, o_f) < 2e-2 and rel(ht_c, ht_f) < 2e-2 and rel(h_c, h_f) < 2e-2


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_a_log_of_flas_test_shape(lower_bound):
    B, T, H, K = 1, 600, 4, 128
    q, k, v, g, beta, h0 = chunk_inputs(B, T, H, H, K, raw_gate=True)
    A_log = torch.log(torch.empty(1, 1, H, 1, device=DEV).uniform_(1, 16))
    dt_bias = torch.randn(H * K, device=DEV)
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
              use_qk_l2norm_in_kernel=True, safe_gate=lower_bound is not None, lower_bound=lower_bound,
              use_beta_sigmoid_in_kernel=True)
    o_f, ht_f = fla_kda.chunk_kda(q, k, v, g, beta, **kw)
    o_c, ht_c = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    assert rel(o_c, o_f) < 2e-2 and rel(ht_c, ht_f) < 2e-2


# ------------------------------------------------------------------------------------------------ fused recurrent

def rec_inputs(B, T, H, HV, K, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)
    q, k, v = r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype), r(B, T, HV, K).to(dtype)
    g = F.logsigmoid(r(B, T, HV, K))
    beta = torch.rand(B, T, HV, generator=gen, device=DEV).to(dtype)
    return q, k, v, g, beta


MODES = {
    "plain": dict(),
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "v_first": dict(state_v_first=True),
    "gate": dict(use_gate_in_kernel=True),
    "gate_lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
    "gate_lower_bound_no_a_log": dict(use_gate_in_kernel=True, lower_bound=-5.0, no_a_log=True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("varlen", [False, True])
def test_fused_recurrent_vs_fla(mode, varlen):
    kw = dict(MODES[mode])
    no_a_log = kw.pop("no_a_log", False)
    B, T, H, HV, K = (1, 300, 2, 4, 128) if varlen else (3, 100, 2, 4, 64)
    q, k, v, g, beta = rec_inputs(B, T, H, HV, K)
    if not kw.get("use_qk_l2norm_in_kernel"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    N = 3 if varlen else B
    cu = torch.tensor([0, 50, 50, 300], dtype=torch.int32, device=DEV) if varlen else None
    h0 = torch.randn(N, HV, K, K, device=DEV) * 0.1
    if kw.get("use_gate_in_kernel"):
        g = torch.randn_like(g)
        kw["A_log"] = None if no_a_log else torch.log(torch.empty(1, 1, HV, 1, device=DEV).uniform_(1, 16))
        kw["dt_bias"] = torch.randn(HV * K, device=DEV)
    if kw.get("use_beta_sigmoid_in_kernel"):
        beta = torch.randn_like(beta)
    res = {}
    for name, fn in (("fla", fla_kda.fused_recurrent_kda), ("cula", cula_core.fused_recurrent_kda)):
        call_kw = dict(kw)
        if name == "fla" and call_kw.get("A_log") is not None:
            call_kw["A_log"] = call_kw["A_log"].reshape(-1)  # FLA's kernel indexes A_log flat
        res[name] = fn(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, cu_seqlens=cu, **call_kw)
    (o_f, ht_f), (o_c, ht_c) = res["fla"], res["cula"]
    assert ht_c.shape == ht_f.shape and ht_c.dtype == ht_f.dtype == torch.float32
    assert rel(o_c, o_f) < 1e-4 and rel(ht_c, ht_f) < 1e-4


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("spec", [False, True])
def test_fused_recurrent_pool_vs_fla(pool_dtype, v_first, spec):
    """FLA's continuous batching (`fused_recurrent_kda_fwd(inplace_final_state=True)`) against cula's
    ``ssm_state_indices``: decode with [N] slots, or speculative decoding with [N, T] slots and accepted tokens."""
    N, H, HV, K = 16, 4, 8, 128
    T = 4 if spec else 1
    P = 3 * N * T
    q, k, v, g, beta = rec_inputs(1, N * T, H, HV, K, dtype=torch.bfloat16)
    g = torch.randn_like(g)
    A_log = torch.log(torch.empty(HV, device=DEV).uniform_(1, 16))
    dt_bias = torch.randn(HV * K, device=DEV)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=DEV)
    perm = torch.randperm(P, device=DEV)[:N * T].int()
    slots = perm.reshape(N, T) if spec else perm
    accepted = torch.randint(1, T + 1, (N,), device=DEV, dtype=torch.int32) if spec else None
    pool = torch.randn(P, HV, K, K, device=DEV).to(pool_dtype) * 0.1
    pool_fla, pool_cula = pool.clone(), pool.clone()
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              state_v_first=v_first, cu_seqlens=cu)
    o_f, _ = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                                     initial_state=pool_fla, inplace_final_state=True, ssm_state_indices=slots,
                                     num_accepted_tokens=accepted, **kw)
    o_c, ret = cula_core.fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, initial_state=pool_cula,
                                             ssm_state_indices=slots, num_accepted_tokens=accepted, **kw)
    assert ret is pool_cula
    assert rel(o_c, o_f) < 1e-2
    touched = slots.reshape(-1).long()
    tol = 1e-4 if pool_dtype == torch.float32 else 1e-2
    assert rel(pool_cula[touched], pool_fla[touched]) < tol
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[touched] = False
    assert torch.equal(pool_cula[untouched], pool[untouched])
