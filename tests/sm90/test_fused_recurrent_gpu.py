"""GPU tests of `cula.fused_recurrent_kda` on cula-sm90's decode kernels (CULA_BACKEND=sm90: a test cannot pass on
the reference), against cula_core's reference run in fp64 on the same inputs, and against FLA 0.6.0's
fused_recurrent_kda (its launch `fused_recurrent_kda_fwd` for the in-place pool mode; FLA_CULA=0 so that FLA runs
its own kernel even where cula.fla is registered).

Pool mode (vLLM / SGLang decode): one token per sequence as q [N, 1] or as one row [1, N] with cu_seqlens, and
T = 3 tokens per sequence; padded (-1) and out-of-range (= P) slots; slots no sequence owns stay bitwise equal;
bf16 and V-first pools. New
state: T = 1 with an fp32 initial state or none; outputs only at T = 1, 4, 9. A CUDA-graph capture of pool decode.

FLA is compared where its semantics are cula's: without padded slots (FLA 0.6.0 reads and writes pool[-1], outside
the pool) and at T = 1 in pool mode (with [N] indices and T > 1, FLA writes token t's state to slot idx[n + t])."""

from __future__ import annotations

import os

import pytest
import torch

import cula_core
from cula_core import reference_backend
from decode_cases import REL_TOL, REL_TOL_BF16_OUT, backend, rel_err, require_sm90

pytestmark = pytest.mark.gpu

K = V = 128
#: a bf16 pool holds each state rounded once per call: kernel and reference agree to one bf16 ulp
REL_TOL_BF16_STATE = 2.0 ** -8
#: FLA against cula, both fp32 math in different orders (fp32 inputs and states)
REL_TOL_FLA = 1e-4


@pytest.fixture(autouse=True)
def _sm90():
    require_sm90()


def make(N, T=1, HQK=2, HV=4, *, varlen=False, safe=False, dtype=torch.float32, P=None, seed=0):
    """Inputs of a call (keyword arguments of cula.fused_recurrent_kda): raw g with A_log / dt_bias (softplus
    gate, or the safe gate at lower_bound -5), post-sigmoid beta, unnormalised q / k (L2 norm in kernel); `varlen`:
    the N sequences of T tokens in one row with cu_seqlens (and its host copy). Returns (kwargs, pool [P, HV, K, V]
    fp32, P = N + 3 by default)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).cuda()

    B, L = (1, N * T) if varlen else (N, T)
    kw = dict(q=r(B, L, HQK, K).to(dtype), k=r(B, L, HQK, K).to(dtype), v=r(B, L, HV, V).to(dtype),
              g=r(B, L, HV, K).to(dtype), beta=torch.sigmoid(r(B, L, HV)).to(dtype),
              A_log=torch.log(torch.rand(HV, generator=gen) * 15 + 1).cuda(), dt_bias=r(HV * K, scale=0.5),
              use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0 if safe else None)
    if varlen:
        cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
        kw.update(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    return kw, r(N + 3 if P is None else P, HV, K, V, scale=0.1)


def slots_for(N, P, *, padded, seed=0):
    """N distinct slots of a P-slot pool (int32 on the GPU); with `padded`, every third sequence from the second
    on is padded (-1) and, for N > 3, the last one is out of range (= P)."""
    idx = torch.randperm(P, generator=torch.Generator().manual_seed(seed))[:N].to(torch.int32)
    if padded:
        idx[1::3] = -1
        if N > 3:
            idx[-1] = P
    return idx.cuda()


def reference(kw, initial_state=None, ssm_state_indices=None, output_final_state=False, state_v_first=False):
    """cula_core's reference on fp64 copies: (o, final state or the updated fp64 pool). Out-of-range slots are
    passed as -1 (the kernels skip them as padding; the reference would reject them)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    state = d(initial_state).clone() if initial_state is not None else None
    idx = ssm_state_indices
    if idx is not None and state is not None:
        idx = torch.where(idx < state.shape[0], idx, -1)
    lb = kw["lower_bound"]
    o, final = reference_backend.fused_recurrent_kda(
        d(kw["q"]), d(kw["k"]), d(kw["v"]), d(kw["g"]), d(kw["beta"]), d(kw["A_log"]), d(kw["dt_bias"]), state,
        kw.get("cu_seqlens"), idx, None, scale=K ** -0.5, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, gate="safe" if lb is not None else "softplus", lower_bound=lb,
        beta_activation="none", state_v_first=state_v_first)
    return o, (state if idx is not None else final)


def fla_recurrent():
    return pytest.importorskip("fla.ops.kda.fused_recurrent", reason="FLA 0.6.0 not importable")


def fla_call(fn, kw, **extra):
    """FLA's function on the same arguments, on its own kernel (FLA_CULA=0, FLA_FLASH_KDA=0 for this call)."""
    args = {n: kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "use_gate_in_kernel",
                               "use_qk_l2norm_in_kernel", "lower_bound")}
    if "cu_seqlens" in kw:
        args["cu_seqlens"] = kw["cu_seqlens"]
    saved = {n: os.environ.get(n) for n in ("FLA_CULA", "FLA_FLASH_KDA")}
    os.environ.update(FLA_CULA="0", FLA_FLASH_KDA="0")
    try:
        with torch.no_grad():
            return fn(**args, **extra)
    finally:
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


def untouched(pool, before, idx):
    """Slots no live sequence owns are bitwise what they were."""
    P = pool.shape[0]
    keep = torch.ones(P, dtype=torch.bool, device=pool.device)
    live = idx[(idx >= 0) & (idx < P)].long()
    keep[live] = False
    return torch.equal(pool[keep], before[keep])


# ------------------------------------------------------------------------------------------ pool mode


@pytest.mark.parametrize("layout", ["batch", "vllm row"])
@pytest.mark.parametrize("N", [1, 3, 64, 257])
def test_pool_decode_matches_the_reference(N, layout):
    for i, (HV, safe) in enumerate(((2, False), (4, True), (8, False))):
        kw, pool = make(N, HV=HV, varlen=layout == "vllm row", safe=safe, seed=10 * N + i)
        idx = slots_for(N, pool.shape[0], padded=N > 1, seed=i)
        before = pool.clone()
        o_ref, pool_ref = reference(kw, pool, idx)
        with backend():
            o, returned = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
        assert returned is pool
        assert rel_err(o, o_ref) < REL_TOL, (HV, rel_err(o, o_ref))
        assert rel_err(pool, pool_ref) < REL_TOL, (HV, rel_err(pool, pool_ref))
        pad = ((idx < 0) | (idx >= pool.shape[0])).cpu()
        assert (o.reshape(N, HV, V)[pad.cuda()] == 0).all(), "a padded sequence must get zero outputs"
        assert untouched(pool, before, idx), "a slot no live sequence owns changed"


@pytest.mark.parametrize("layout", ["batch", "vllm row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_decode_matches_fla(layout, dtype):
    fla = fla_recurrent()
    N = 48
    kw, pool = make(N, varlen=layout == "vllm row", dtype=dtype, seed=3)
    idx = slots_for(N, pool.shape[0], padded=False, seed=3)
    fla_pool = pool.clone()
    o_fla, _ = fla_call(fla.fused_recurrent_kda_fwd, kw, initial_state=fla_pool, inplace_final_state=True,
                        ssm_state_indices=idx)
    with backend():
        o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
    tol = REL_TOL_FLA if dtype == torch.float32 else REL_TOL_BF16_OUT
    assert rel_err(o, o_fla) < tol
    assert rel_err(pool, fla_pool) < REL_TOL_FLA


@pytest.mark.parametrize("layout", ["batch", "vllm row"])
def test_pool_with_several_tokens_per_sequence(layout):
    """[N] slots and T = 3 tokens per sequence: each slot ends holding the state after its sequence's last token."""
    N, T = 37, 3
    kw, pool = make(N, T, varlen=layout == "vllm row", safe=True, seed=41)
    idx = slots_for(N, pool.shape[0], padded=True, seed=41)
    before = pool.clone()
    o_ref, pool_ref = reference(kw, pool, idx)
    with backend():
        o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
    assert rel_err(o, o_ref) < REL_TOL and rel_err(pool, pool_ref) < REL_TOL
    assert untouched(pool, before, idx)


def test_slot_column_and_int64_slots():
    """[N, T_idx] slots at one token per sequence (column 0 read and written), and int64 slots."""
    N = 9
    kw, pool = make(N, P=30, seed=5)
    idx = slots_for(N, 30, padded=True, seed=5)
    for slots in (torch.stack([idx, torch.flip(idx, (0,))], dim=1), idx.long()):
        work = pool.clone()
        o_ref, pool_ref = reference(kw, pool, slots[:, 0] if slots.dim() == 2 else slots)
        with backend():
            o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=work, ssm_state_indices=slots)
        assert rel_err(o, o_ref) < REL_TOL and rel_err(work, pool_ref) < REL_TOL
        assert untouched(work, pool, idx)


@pytest.mark.parametrize(("pool_dtype", "v_first"), [(torch.bfloat16, False), (torch.float32, True),
                                                      (torch.bfloat16, True)])
def test_serving_pools(pool_dtype, v_first):
    """bf16 and V-first pools, against the reference on the same pool (fp32 math, the pool's dtype and layout)
    and against FLA."""
    for T, N in ((1, 64), (3, 5)):
        kw, pool = make(N, T, seed=60 + T)
        pool = (pool.transpose(-1, -2).contiguous() if v_first else pool).to(pool_dtype)
        idx = slots_for(N, pool.shape[0], padded=True, seed=T)
        before = pool.clone()
        o_ref, pool_ref = reference(kw, pool, idx, state_v_first=v_first)
        with backend():
            o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx,
                                                 state_v_first=v_first)
        tol = REL_TOL_BF16_STATE if pool_dtype == torch.bfloat16 else REL_TOL
        assert rel_err(o, o_ref) < REL_TOL and rel_err(pool, pool_ref.to(pool_dtype)) < tol
        assert untouched(pool, before, idx)
    # FLA, on a batch without padded sequences (FLA indexes pool[-1] for one)
    fla = fla_recurrent()
    kw, pool = make(64, seed=61)
    pool = (pool.transpose(-1, -2).contiguous() if v_first else pool).to(pool_dtype)
    live = slots_for(64, pool.shape[0], padded=False, seed=61)
    fla_pool = pool.clone()
    fla_call(fla.fused_recurrent_kda_fwd, kw, initial_state=fla_pool, inplace_final_state=True,
             ssm_state_indices=live, state_v_first=v_first)
    with backend():
        cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=live, state_v_first=v_first)
    assert rel_err(pool, fla_pool) < (REL_TOL_BF16_STATE if pool_dtype == torch.bfloat16 else REL_TOL_FLA)


def test_cuda_graph_capture_of_pool_decode():
    """vLLM's decode under a CUDA graph: warm-up at N = 2, capture at N = 6 (one row with cu_seqlens), replay with
    new inputs copied into the captured buffers: bitwise the eager result."""
    with backend():
        small, small_pool = make(2, varlen=True, seed=70)
        cula_core.fused_recurrent_kda(**small, initial_state=small_pool,
                                      ssm_state_indices=slots_for(2, 5, padded=False))
        torch.cuda.synchronize()
        kw, pool = make(6, varlen=True, seed=71)
        idx = slots_for(6, pool.shape[0], padded=True, seed=71)
        pool0 = pool.clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            o_g, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
        torch.cuda.current_stream().wait_stream(s)
        new, _ = make(6, varlen=True, seed=72)
        for name in ("q", "k", "v", "g", "beta"):
            kw[name].copy_(new[name])
        pool.copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        eager_pool = pool0.clone()
        o_e, _ = cula_core.fused_recurrent_kda(**kw, initial_state=eager_pool, ssm_state_indices=idx)
    assert torch.equal(o_g, o_e) and torch.equal(pool, eager_pool)


# ------------------------------------------------------------------------------------------ new state / outputs only


@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("N", [1, 3, 64])
def test_new_final_state_matches_the_reference_and_fla(N, initial):
    kw, _ = make(N, safe=N == 3, seed=80 + N)
    h0 = torch.randn(N, 4, K, V, device="cuda") * 0.1 if initial else None
    before = h0.clone() if initial else None
    o_ref, ht_ref = reference(kw, h0, output_final_state=True)
    with backend():
        o, ht = cula_core.fused_recurrent_kda(**kw, initial_state=h0, output_final_state=True)
    assert ht.dtype == torch.float32 and ht.shape == (N, 4, K, V)
    assert rel_err(o, o_ref) < REL_TOL and rel_err(ht, ht_ref) < REL_TOL
    if initial:
        assert torch.equal(h0, before), "the initial state must not change"
    fla_ops = pytest.importorskip("fla.ops.kda", reason="FLA 0.6.0 not importable")
    o_fla, ht_fla = fla_call(fla_ops.fused_recurrent_kda, kw, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_fla) < REL_TOL_FLA and rel_err(ht, ht_fla) < REL_TOL_FLA


@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("N", [2, 40])
def test_outputs_only_match_the_reference_and_fla(N, T):
    kw, _ = make(N, T, HV=8, safe=T == 4, seed=90 + T)
    h0 = torch.randn(N, 8, K, V, device="cuda") * 0.1
    o_ref, _ = reference(kw, h0)
    with backend():
        o, none = cula_core.fused_recurrent_kda(**kw, initial_state=h0)
    assert none is None and rel_err(o, o_ref) < REL_TOL
    fla_ops = pytest.importorskip("fla.ops.kda", reason="FLA 0.6.0 not importable")
    o_fla, _ = fla_call(fla_ops.fused_recurrent_kda, kw, initial_state=h0)
    assert rel_err(o, o_fla) < REL_TOL_FLA
