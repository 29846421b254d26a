"""GPU tests of `cula.fused_recurrent_kda` on cula-sm90's decode kernels (CULA_BACKEND=sm90: a test cannot pass on
the reference), against cula_core's reference run in fp64 on the same inputs, and against FLA 0.6.0's
fused_recurrent_kda (its launch `fused_recurrent_kda_fwd` for the in-place pool mode; FLA_CULA=0 so that FLA runs
its own kernel even where cula.fla is registered).

Pool mode (vLLM / SGLang decode): one token per sequence as q [N, 1] or as one row [1, N] with cu_seqlens, and
T = 3 tokens per sequence; padded (-1) and out-of-range (= P) slots; slots no sequence owns stay bitwise equal;
bf16 and V-first pools. New
state: T = 1 with an fp32 initial state or none; outputs only at T = 1, 4, 9. A CUDA-graph capture of pool decode.
Each mapping also with a precomputed log decay (use_gate_in_kernel=False) and beta logits (use_beta_sigmoid_in_kernel,
with allow_neg_eigval: 2 sigmoid(beta)). Speculative decoding (vLLM's Kimi-Linear MTP step): a slot per token
(ssm_state_indices [N, T]) with and without num_accepted_tokens, on every pool variant.

FLA is compared where its semantics are cula's: without padded slots (FLA 0.6.0 reads and writes pool[-1], outside
the pool) and at T = 1 in pool mode (with [N] indices and T > 1, FLA writes token t's state to slot idx[n + t])."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import cula_core
from cula_core import reference_backend
from cula_core.fla_args import beta_activation
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


#: FLA's beta flags for each activation of the calling convention
BETA_FLAGS = {"none": {}, "sigmoid": {"use_beta_sigmoid_in_kernel": True},
              "2sigmoid": {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}}


def make(N, T=1, HQK=2, HV=4, *, varlen=False, safe=False, dtype=torch.float32, P=None, seed=0, precomputed=False,
         activation="none"):
    """Inputs of a call (keyword arguments of cula.fused_recurrent_kda): raw g with A_log / dt_bias (softplus
    gate, or the safe gate at lower_bound -5), post-sigmoid beta, unnormalised q / k (L2 norm in kernel); `varlen`:
    the N sequences of T tokens in one row with cu_seqlens (and its host copy). `precomputed`: g is a log decay
    (-softplus of the raw values, use_gate_in_kernel=False; A_log / dt_bias still passed, and ignored); `activation`
    other than "none": beta holds logits (N(0, 4)) and FLA's flags ask for that activation. Returns (kwargs, pool
    [P, HV, K, V] fp32, P = N + 3 by default)."""
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
    pool = r(N + 3 if P is None else P, HV, K, V, scale=0.1)
    if precomputed:
        kw.update(g=-F.softplus(kw["g"].float()).to(dtype), use_gate_in_kernel=False)
    if activation != "none":
        kw.update(beta=r(B, L, HV, scale=2.0).to(dtype), **BETA_FLAGS[activation])
    return kw, pool


def slots_for(N, P, *, padded, seed=0):
    """N distinct slots of a P-slot pool (int32 on the GPU); with `padded`, every third sequence from the second
    on is padded (-1) and, for N > 3, the last one is out of range (= P)."""
    idx = torch.randperm(P, generator=torch.Generator().manual_seed(seed))[:N].to(torch.int32)
    if padded:
        idx[1::3] = -1
        if N > 3:
            idx[-1] = P
    return idx.cuda()


def reference(kw, initial_state=None, ssm_state_indices=None, output_final_state=False, state_v_first=False,
              num_accepted_tokens=None):
    """cula_core's reference on fp64 copies: (o, final state or the updated fp64 pool). Out-of-range slots are
    passed as -1 (the kernels skip them as padding; the reference would reject them)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    state = d(initial_state).clone() if initial_state is not None else None
    idx = ssm_state_indices
    if idx is not None and state is not None:
        idx = torch.where(idx < state.shape[0], idx, -1)
    lb = kw["lower_bound"]
    gate = ("safe" if lb is not None else "softplus") if kw["use_gate_in_kernel"] else "precomputed"
    activation = beta_activation(kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False))
    o, final = reference_backend.fused_recurrent_kda(
        d(kw["q"]), d(kw["k"]), d(kw["v"]), d(kw["g"]), d(kw["beta"]), d(kw["A_log"]), d(kw["dt_bias"]), state,
        kw.get("cu_seqlens"), idx, num_accepted_tokens, scale=K ** -0.5, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, gate=gate, lower_bound=lb, beta_activation=activation,
        state_v_first=state_v_first)
    return o, (state if idx is not None else final)


def fla_recurrent():
    return pytest.importorskip("fla.ops.kda.fused_recurrent", reason="FLA 0.6.0 not importable")


def fla_call(fn, kw, **extra):
    """FLA's function on the same arguments, on its own kernel (FLA_CULA=0, FLA_FLASH_KDA=0 for this call)."""
    args = {n: kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "use_gate_in_kernel",
                               "use_qk_l2norm_in_kernel", "lower_bound", "use_beta_sigmoid_in_kernel",
                               "allow_neg_eigval") if n in kw}
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


#: (precomputed log decay, beta activation): the gate in kernel with beta post-sigmoid, and each of the other modes
#: alone and together
MODES = [(False, "none"), (True, "none"), (False, "sigmoid"), (True, "sigmoid"), (False, "2sigmoid"),
         (True, "2sigmoid")]


def _mode_id(mode):
    return f"{'precomputed' if mode[0] else 'raw'}-{mode[1]}"


def _as_pool(pool, dtype, v_first):
    return (pool.transpose(-1, -2).contiguous() if v_first else pool).to(dtype)


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize(("pool_dtype", "v_first"), [(torch.float32, False), (torch.float32, True),
                                                      (torch.bfloat16, False), (torch.bfloat16, True)])
def test_serving_pools(mode, pool_dtype, v_first):
    """fp32 / bf16 and K-first / V-first pools, with the gate in kernel or a precomputed log decay and beta
    post-sigmoid or logits: one token per sequence as vLLM's row with cu_seqlens (N = 64) and T = 3 tokens per
    sequence (N = 5), padded slots, against the reference on the same pool (fp64 math, the pool's dtype and
    layout); T = 1 without padding (FLA indexes pool[-1] for a padded sequence) against FLA."""
    precomputed, activation = mode
    for T, N in ((1, 64), (3, 5)):
        kw, pool = make(N, T, varlen=T == 1, seed=100 + T, precomputed=precomputed, activation=activation)
        pool = _as_pool(pool, pool_dtype, v_first)
        idx = slots_for(N, pool.shape[0], padded=True, seed=T)
        before = pool.clone()
        o_ref, pool_ref = reference(kw, pool, idx, state_v_first=v_first)
        with backend():
            o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx,
                                                 state_v_first=v_first)
        tol = REL_TOL_BF16_STATE if pool_dtype == torch.bfloat16 else REL_TOL
        assert rel_err(o, o_ref) < REL_TOL, (T, rel_err(o, o_ref))
        assert rel_err(pool, pool_ref.to(pool_dtype)) < tol, (T, rel_err(pool, pool_ref.to(pool_dtype)))
        assert untouched(pool, before, idx)
    fla = fla_recurrent()
    kw, pool = make(64, seed=107, precomputed=precomputed, activation=activation)
    pool = _as_pool(pool, pool_dtype, v_first)
    live = slots_for(64, pool.shape[0], padded=False, seed=107)
    fla_pool = pool.clone()
    o_fla, _ = fla_call(fla.fused_recurrent_kda_fwd, kw, initial_state=fla_pool, inplace_final_state=True,
                        ssm_state_indices=live, state_v_first=v_first)
    with backend():
        o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=live, state_v_first=v_first)
    assert rel_err(o, o_fla) < REL_TOL_FLA
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


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_final_state_in_every_layout_gate_and_beta_activation(mode, v_first, dtype):
    """FLA's layer decode step (T = 1, output_final_state, V-first states, bf16 inputs, beta logits) and its
    K-first / fp32 / other gate and beta variants, from an fp32 initial state and from none, against the fp64
    reference and FLA."""
    precomputed, activation = mode
    try:
        import fla.ops.kda as fla_ops
    except ImportError:
        fla_ops = None
    for initial in (True, False):
        kw, _ = make(48, dtype=dtype, seed=120 + initial, precomputed=precomputed, activation=activation)
        h0 = torch.randn(48, 4, K, V, device="cuda") * 0.1 if initial else None
        h0 = h0.transpose(-1, -2).contiguous() if initial and v_first else h0
        before = h0.clone() if initial else None
        o_ref, ht_ref = reference(kw, h0, output_final_state=True, state_v_first=v_first)
        with backend():
            o, ht = cula_core.fused_recurrent_kda(**kw, initial_state=h0, output_final_state=True,
                                                  state_v_first=v_first)
        o_tol = REL_TOL if dtype == torch.float32 else REL_TOL_BF16_OUT
        assert ht.dtype == torch.float32 and ht.shape == ((48, 4, V, K) if v_first else (48, 4, K, V))
        assert rel_err(o, o_ref) < o_tol and rel_err(ht, ht_ref) < REL_TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))
        if initial:
            assert torch.equal(h0, before), "the initial state must not change"
        if fla_ops is not None:
            o_fla, ht_fla = fla_call(fla_ops.fused_recurrent_kda, kw, initial_state=h0, output_final_state=True,
                                     state_v_first=v_first)
            assert rel_err(o, o_fla) < (REL_TOL_FLA if dtype == torch.float32 else REL_TOL_BF16_OUT)
            assert rel_err(ht, ht_fla) < REL_TOL_FLA
    if fla_ops is None:
        pytest.skip("FLA 0.6.0 not importable: checked against the reference only")


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("N", [2, 40])
def test_outputs_only_match_the_reference_and_fla(mode, N, T):
    """Outputs only (N = 2: the recurrent kernel's KVBuffer mode; N = 40: the chunk-form verify, SIMT at T = 1, 4
    and tensor cores at T = 9), V-first states at N = 40, every gate and beta activation (lower_bound -5 at T = 4:
    the safe gate, or ignored by a precomputed one), against the fp64 reference and FLA."""
    precomputed, activation = mode
    v_first = N == 40
    kw, _ = make(N, T, HV=8, safe=T == 4, seed=140 + T, precomputed=precomputed, activation=activation)
    h0 = torch.randn(N, 8, K, V, device="cuda") * 0.1
    h0 = h0.transpose(-1, -2).contiguous() if v_first else h0
    o_ref, _ = reference(kw, h0, state_v_first=v_first)
    with backend():
        o, none = cula_core.fused_recurrent_kda(**kw, initial_state=h0, state_v_first=v_first)
    assert none is None and rel_err(o, o_ref) < REL_TOL, rel_err(o, o_ref)
    fla_ops = pytest.importorskip("fla.ops.kda", reason="FLA 0.6.0 not importable")
    o_fla, _ = fla_call(fla_ops.fused_recurrent_kda, kw, initial_state=h0, state_v_first=v_first)
    assert rel_err(o, o_fla) < REL_TOL_FLA


@pytest.mark.parametrize("mode", [m for m in MODES if m != (False, "none")], ids=_mode_id)
def test_fla_hands_these_calls_to_cula(mode):
    """With cula.fla registered, FLA's recurrent launch hands cula the calls with a precomputed log decay or beta
    logits: its verifier accepts FLA's layer decode step (a new V-first state after one token) and a pool decode
    with q [N, 1] (FLA passes no host copy of cu_seqlens, so a vLLM row stays on FLA)."""
    pytest.importorskip("fla.ops.kda", reason="FLA 0.6.0 not importable")
    import cula.fla

    precomputed, activation = mode
    kw, pool = make(8, precomputed=precomputed, activation=activation, seed=150)
    args = {n: kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "use_gate_in_kernel",
                               "use_qk_l2norm_in_kernel", "lower_bound", "use_beta_sigmoid_in_kernel",
                               "allow_neg_eigval") if n in kw}
    verify = cula.fla.RecurrentKDABackend().verify
    h0 = torch.randn(8, 4, V, K, device="cuda") * 0.1
    assert verify("fused_recurrent_kda_fwd", **args, initial_state=h0, output_final_state=True,
                  inplace_final_state=False, state_v_first=True) == (True, None)
    assert verify("fused_recurrent_kda_fwd", **args, initial_state=pool, inplace_final_state=True,
                  ssm_state_indices=slots_for(8, pool.shape[0], padded=False)) == (True, None)


# ------------------------------------------------------------------------------------------ a slot per token


def slot_table(N, T, P, *, seed, padded=True, accepted=True):
    """(ssm_state_indices [N, T] int32, num_accepted_tokens [N] int32 or None) on the GPU: distinct slots of a
    P-slot pool, counts in [1, T]. With `padded` (N >= 4): row 1 padded (its read slot -1), row 2 with a negative and
    an out-of-range (= P) write slot besides its read slot, row 3 naming one slot twice (columns 0 and T - 1: the
    later state stays; at T = 1 it is the read slot written)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(P, generator=gen)[:N * T].to(torch.int32).reshape(N, T)
    counts = torch.randint(1, T + 1, (N,), generator=gen, dtype=torch.int32) if accepted else None
    read = (counts.long() - 1) if accepted else torch.zeros(N, dtype=torch.long)
    if padded:
        table[1, read[1]] = -1
        others = [t for t in range(T) if t != read[2]]
        if others:
            table[2, others[0]] = -1
            table[2, others[-1]] = P if len(others) > 1 else -1
        table[3, T - 1] = table[3, 0]
    return table.cuda(), (counts.cuda() if accepted else None)


def written_slots(table, counts, P):
    """The slots the kernel may write: every valid slot of a row whose read slot is valid."""
    t = table.cpu().long()
    col = torch.zeros(t.shape[0], dtype=torch.long) if counts is None else counts.cpu().long() - 1
    read = t.gather(1, col[:, None])[:, 0]
    live = (read >= 0) & (read < P)
    return {int(s) for n in range(t.shape[0]) if live[n] for s in t[n] if 0 <= s < P}


def untouched_but(pool, before, slots):
    keep = torch.ones(pool.shape[0], dtype=torch.bool)
    keep[sorted(slots)] = False
    keep = keep.to(pool.device)
    return torch.equal(pool[keep], before[keep])


POOLS = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)]


@pytest.mark.parametrize(("pool_dtype", "v_first"), POOLS, ids=["fp32", "fp32-vfirst", "bf16", "bf16-vfirst"])
@pytest.mark.parametrize("layout", ["batch", "vllm row"])
@pytest.mark.parametrize("accepted", [True, False], ids=["accepted", "column0"])
def test_speculative_slots_match_the_reference(accepted, layout, pool_dtype, v_first):
    """ssm_state_indices [N, T] at T = 1 .. 4 (N = 6 and N = 33), with num_accepted_tokens (read slot
    idx[n, a - 1]) or without (column 0): outputs and pool against the fp64 reference on the same pool (padded row,
    negative and out-of-range write slots, a slot named twice); slots not written stay bitwise equal, read-only
    slots included."""
    for T in (1, 2, 3, 4):
        for N in (6, 33):
            kw, pool = make(N, T, varlen=layout == "vllm row", safe=T == 3, seed=200 + 10 * T + N, P=N * T + 5)
            pool = _as_pool(pool, pool_dtype, v_first)
            table, counts = slot_table(N, T, pool.shape[0], seed=T * N, accepted=accepted)
            before = pool.clone()
            o_ref, pool_ref = reference(kw, pool, table, state_v_first=v_first, num_accepted_tokens=counts)
            with backend():
                o, returned = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=table,
                                                            num_accepted_tokens=counts, state_v_first=v_first)
            assert returned is pool
            tol = REL_TOL_BF16_STATE if pool_dtype == torch.bfloat16 else REL_TOL
            assert rel_err(o, o_ref) < REL_TOL, (T, N, rel_err(o, o_ref))
            assert rel_err(pool, pool_ref.to(pool_dtype)) < tol, (T, N, rel_err(pool, pool_ref.to(pool_dtype)))
            assert (o.reshape(N, T, -1)[1] == 0).all(), "a padded row must get zero outputs"
            assert untouched_but(pool, before, written_slots(table, counts, pool.shape[0]))
            if T > 1:  # the slot named twice holds the state after the row's last token
                twice = int(table[3, 0])
                assert rel_err(pool[twice], pool_ref[twice]) < tol


def test_speculative_slots_clamp_the_accepted_counts(monkeypatch):
    """Counts outside [1, T_idx] (device values are not read on the host): the read column is clamped to the
    table, as the reference does; a table wider than T (T_idx = 5 at T = 3) reads beyond the written columns."""
    monkeypatch.delenv("CULA_CHECK_DEVICE_VALUES", raising=False)
    N, T, cols = 5, 3, 5
    kw, pool = make(N, T, seed=230, P=N * cols + 2)
    table = torch.arange(N * cols, dtype=torch.int32).reshape(N, cols).cuda()
    counts = torch.tensor([0, -3, 5, 9, 4], dtype=torch.int32).cuda()
    for acc in (counts, counts.long()):
        work = pool.clone()
        o_ref, pool_ref = reference(kw, pool, table, num_accepted_tokens=acc)
        with backend():
            o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=work, ssm_state_indices=table,
                                                 num_accepted_tokens=acc)
        assert rel_err(o, o_ref) < REL_TOL and rel_err(work, pool_ref) < REL_TOL
        assert untouched_but(work, pool, written_slots(table[:, :T], None, work.shape[0]))


@pytest.mark.parametrize(("dtype", "pool_dtype", "v_first"), [
    (torch.float32, torch.float32, False), (torch.float32, torch.float32, True), (torch.float32, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.float32, False)],
    ids=["fp32", "fp32-vfirst", "bf16pool", "bf16pool-vfirst", "bf16-inputs"])
def test_speculative_slots_match_fla(dtype, pool_dtype, v_first):
    """vLLM's speculative step as FLA 0.6.0's kernel runs it (fused_recurrent_kda_fwd in place, [N, T] slots,
    num_accepted_tokens, one row with cu_seqlens, precomputed g as vLLM's Kimi-Linear passes it, and the gate in
    kernel), T = 2 .. 4, without padding (FLA indexes pool[-1] for a negative slot), one slot named twice in a row:
    the same outputs and pool."""
    fla = fla_recurrent()
    for T in (2, 3, 4):
        for precomputed in (True, False):
            N = 24
            kw, pool = make(N, T, varlen=True, dtype=dtype, seed=250 + T, precomputed=precomputed, P=N * T + 3)
            pool = _as_pool(pool, pool_dtype, v_first)
            table, counts = slot_table(N, T, pool.shape[0], seed=T, padded=False)
            table[5, T - 1] = table[5, 0]
            fla_pool = pool.clone()
            o_fla, _ = fla_call(fla.fused_recurrent_kda_fwd, kw, initial_state=fla_pool, inplace_final_state=True,
                                ssm_state_indices=table, num_accepted_tokens=counts, state_v_first=v_first)
            with backend():
                o, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=table,
                                                     num_accepted_tokens=counts, state_v_first=v_first)
            o_tol = REL_TOL_FLA if dtype == torch.float32 else REL_TOL_BF16_OUT
            assert rel_err(o, o_fla) < o_tol, (T, precomputed, rel_err(o, o_fla))
            tol = REL_TOL_BF16_STATE if pool_dtype == torch.bfloat16 else REL_TOL_FLA
            assert rel_err(pool, fla_pool) < tol, (T, precomputed, rel_err(pool, fla_pool))


def test_cuda_graph_capture_of_the_speculative_step():
    """The speculative step under a CUDA graph (vLLM captures it): warm-up at N = 2, capture at N = 7, replay with
    new inputs and counts copied into the captured buffers: bitwise the eager result."""
    T = 3
    with backend():
        small, small_pool = make(2, T, varlen=True, seed=260, P=9)
        t2, c2 = slot_table(2, T, 9, seed=1, padded=False)
        cula_core.fused_recurrent_kda(**small, initial_state=small_pool, ssm_state_indices=t2, num_accepted_tokens=c2)
        torch.cuda.synchronize()
        kw, pool = make(7, T, varlen=True, seed=261, P=7 * T + 2)
        table, counts = slot_table(7, T, pool.shape[0], seed=2)
        pool0 = pool.clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            o_g, _ = cula_core.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=table,
                                                   num_accepted_tokens=counts)
        torch.cuda.current_stream().wait_stream(s)
        new, _ = make(7, T, varlen=True, seed=262)
        for name in ("q", "k", "v", "g", "beta"):
            kw[name].copy_(new[name])
        counts.copy_(torch.tensor([3, 1, 2, 2, 1, 3, 1], dtype=torch.int32))
        pool.copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        eager_pool = pool0.clone()
        o_e, _ = cula_core.fused_recurrent_kda(**kw, initial_state=eager_pool, ssm_state_indices=table,
                                               num_accepted_tokens=counts)
    assert torch.equal(o_g, o_e) and torch.equal(pool, eager_pool)
