"""CPU tests of `cula.fused_recurrent_kda` on cula-sm90's decode kernels, without a GPU:

* which calls the sm90 backend serves on an H100 and the reason of every one it declines, asked of
  `cula_core.dispatch.kernel_backend_for` with the configuration the public op itself builds (captured from a
  call on CPU tensors, moved to a synthetic compute capability 9.0 device);
* how a served call maps onto the recurrent kernel (the mode, the slots, the pool passed in place, the request
  shapes): the public op runs with the sm90 backend selected and `cula_sm90.decode.launch.run_recurrent` replaced by
  the reference decode math, and its results must match the reference backend's fused_recurrent_kda.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import cula_core
from cula_core import dispatch, reference_backend
from cula_core import reference as ref
from cula_core.backend import DeviceInfo
from cula_core.reference.kvbuffer import mtp_kvbuffer_reference
from cula_sm90.backend import backend as sm90
from cula_sm90.decode import configs, launch

H100 = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="NVIDIA H100")
K = V = 64
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _plain_dispatch(monkeypatch):
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.delenv("CULA_STRICT", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cula_core.CulaFallbackWarning)
        yield


def make(N=3, T=1, HQK=2, HV=4, *, P=None, varlen=False, dtype=torch.float32, seed=0):
    """Inputs of a call with the gate in kernel (raw g, A_log, dt_bias), post-sigmoid beta, unnormalised q / k; a
    state pool of P slots (default N + 2). varlen: the N sequences of T tokens in one row with cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    B, L = (1, N * T) if varlen else (N, T)
    x = dict(q=r(B, L, HQK, K).to(dtype), k=r(B, L, HQK, K).to(dtype), v=r(B, L, HV, V).to(dtype),
             g=r(B, L, HV, K).to(dtype), beta=torch.rand(B, L, HV, generator=gen).to(dtype),
             A_log=torch.log(torch.rand(HV, generator=gen) * 15 + 1), dt_bias=r(HV * K, scale=0.5),
             use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    if varlen:
        x["cu_seqlens"] = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    pool = r(N + 2 if P is None else P, HV, K, V, scale=0.1)
    return x, pool


def captured(**call_kwargs):
    """The CallConfig `cula_core.fused_recurrent_kda(**call_kwargs)` dispatches on, moved to an H100."""
    seen = []

    def record(call):
        seen.append(call)
        return reference_backend.REFERENCE_BACKEND

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "select", record)
        cula_core.fused_recurrent_kda(**call_kwargs)
    (call,) = seen
    return dataclasses.replace(call, device=H100)


def served(call) -> bool:
    """Whether the dispatch sends `call` to the sm90 kernels; the sm90 reason must agree."""
    found, reason = dispatch.kernel_backend_for(call)
    assert (found is not None) == (sm90.unsupported_reason(call) is None), (found, reason)
    if found is not None:
        assert found.name == "sm90"
    return found is not None


def reason_for(call) -> str:
    assert not served(call)
    return sm90.unsupported_reason(call)


# ------------------------------------------------------------------------------------------ served calls


@pytest.mark.parametrize("case", ["vllm row", "batch", "mtp T=16", "slot column", "int64 slots", "safe gate",
                                  "positive bound"])
def test_pool_calls_are_served(case):
    T = 16 if case == "mtp T=16" else 1
    x, pool = make(N=4, T=T, varlen=case == "vllm row")
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int64 if case == "int64 slots" else torch.int32)
    if case == "slot column":
        slots = torch.stack([slots, torch.tensor([1, 2, 4, -1], dtype=torch.int32)], dim=1)
    if case in ("safe gate", "positive bound"):
        x.update(lower_bound=-8.0 if case == "safe gate" else 0.5, A_log=None)
    call = captured(**x, initial_state=pool, ssm_state_indices=slots)
    assert served(call)


#: FLA's two beta flags and the calling convention's activation they give (cula_core.fla_args.beta_activation)
BETA_FLAGS = [({}, "none"), ({"use_beta_sigmoid_in_kernel": True}, "sigmoid"),
              ({"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, "2sigmoid")]


def precomputed(x: dict) -> dict:
    """The call `x` with a precomputed log decay (use_gate_in_kernel=False: A_log / dt_bias unused) of its raw g."""
    return {**x, "use_gate_in_kernel": False, "g": -torch.nn.functional.softplus(x["g"])}


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "safe"])
@pytest.mark.parametrize(("flags", "activation"), BETA_FLAGS, ids=[a for _, a in BETA_FLAGS])
@pytest.mark.parametrize("mapping", ["pool", "new state", "outputs only"])
def test_every_gate_and_beta_activation_is_served(gate, flags, activation, mapping):
    """FLA's use_gate_in_kernel=False (g is the log decay) and beta logits (use_beta_sigmoid_in_kernel, with
    allow_neg_eigval: 2 sigmoid) are served in each of the three mappings, as the gates computed in kernel are."""
    x, pool = make(N=3, T=1 if mapping == "new state" else 2)
    x = precomputed(x) if gate == "precomputed" else x
    if gate == "safe":
        x.update(lower_bound=-5.0)
    states = {"pool": dict(initial_state=pool, ssm_state_indices=torch.tensor([0, 4, -1], dtype=torch.int32)),
              "new state": dict(output_final_state=True), "outputs only": dict(initial_state=pool[:3])}[mapping]
    call = captured(**x, **flags, **states)
    assert call.gate == gate and call.options["beta_activation"] == activation
    assert served(call)


def test_outputs_only_with_a_precomputed_gate_ignore_lower_bound():
    # without the gate in kernel, lower_bound selects nothing (FLA ignores it there too): no decay > 1 is implied
    x, _ = make(N=2, T=3)
    call = captured(**precomputed(x), lower_bound=0.5)
    assert call.gate == "precomputed" and call.options["lower_bound"] == 0.5
    assert served(call)


@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize(("T", "final"), [(1, True), (1, False), (5, False)])
def test_new_state_calls_are_served(T, final, initial):
    x, _ = make(N=3, T=T)
    h0 = torch.randn(3, 4, K, V) if initial else None
    assert served(captured(**x, initial_state=h0, output_final_state=final))


# ------------------------------------------------------------------------------------------ declined calls


def test_unknown_beta_activation_is_declined():
    # core never builds one (fla_args.beta_activation); a configuration from elsewhere gets a reason, not a kernel
    x, _ = make()
    call = captured(**x, output_final_state=True)
    call = dataclasses.replace(call, options={**call.options, "beta_activation": "tanh"})
    assert reason_for(call) == "sm90 decode serves beta_activation none / sigmoid / 2sigmoid, got 'tanh'"


def test_beta_per_channel_is_declined():
    x, _ = make()
    x["beta"] = torch.rand(*x["v"].shape)
    assert reason_for(captured(**x, output_final_state=True)) == \
        "sm90 decode takes one beta per token and value head, got beta [B, T, HV, V]"


def test_varlen_needs_equal_lengths_known_on_the_host():
    x, pool = make(N=3, varlen=True)
    x["cu_seqlens"] = torch.tensor([0, 1, 1, 3], dtype=torch.int32)  # lengths 1, 0, 2
    want = ("sm90 decode serves cu_seqlens only when every sequence has the same length and the host knows it "
            "(pass cu_seqlens_cpu), got unequal or unknown lengths")
    assert reason_for(captured(**x, initial_state=pool, ssm_state_indices=torch.tensor([0, 1, 2],
                                                                                      dtype=torch.int32))) == want
    # lengths unknown on the host (device cu_seqlens without cu_seqlens_cpu): FLA's calls through cula.fla
    equal, _ = make(N=3, T=2, varlen=True)
    call = captured(**equal, output_final_state=False)
    assert call.options["seq_len"] == 2 and served(call)
    unknown = dataclasses.replace(call, options={**call.options, "seq_len": None})
    assert reason_for(unknown) == want
    assert reason_for(dataclasses.replace(call, options={n: v for n, v in call.options.items() if n != "seq_len"})) \
        == want


@pytest.mark.parametrize("T", [0, 17])
def test_tokens_per_sequence_out_of_range_are_declined(T):
    x, pool = make(N=2, T=T)
    call = captured(**x, initial_state=pool, ssm_state_indices=torch.tensor([0, 1], dtype=torch.int32))
    assert reason_for(call) == f"sm90 decode serves 1 <= T <= 16 tokens per sequence, got T={T}"


@pytest.mark.parametrize("accepted", [True, False])
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("case", ["batch", "vllm row", "bf16 V-first pool", "int64"])
def test_speculative_slots_are_served(case, T, accepted):
    """vLLM's speculative step: ssm_state_indices [N, T] (a slot per token) with or without num_accepted_tokens,
    in a batch or one row with cu_seqlens, any pool the kernels index, int32 or int64 indices and counts."""
    x, pool = make(N=2, T=T, P=2 * T + 1, varlen=case == "vllm row")
    dt = torch.int64 if case == "int64" else torch.int32
    slots = torch.arange(2 * T, dtype=dt).reshape(2, T)
    kw = {}
    if case == "bf16 V-first pool":
        pool = pool.transpose(-1, -2).contiguous().bfloat16()
        kw["state_v_first"] = True
    if accepted:
        kw["num_accepted_tokens"] = torch.tensor([1, T], dtype=dt)
    call = captured(**x, **kw, initial_state=pool, ssm_state_indices=slots)
    assert call.options["per_token_slots"] and call.options["num_accepted_tokens"] is accepted
    assert served(call)


@pytest.mark.parametrize(("per_token_slots", "accepted", "T", "mode"), [
    (False, False, 1, configs.MODE_FINAL), (False, False, 4, configs.MODE_FINAL),
    (True, False, 1, configs.MODE_FINAL), (True, False, 2, configs.MODE_SLOTS),
    (True, True, 1, configs.MODE_SLOTS), (True, True, 4, configs.MODE_SLOTS)])
def test_pool_mode_by_slot_shape(per_token_slots, accepted, T, mode):
    # [N] slots, or [N, T_idx] at T = 1 without counts (column 0 read and written): one slot per sequence
    assert configs.fused_recurrent_pool_mode(per_token_slots, accepted, T) == mode


def test_speculative_slots_keep_the_other_reasons():
    """A slot table does not lift the other limits: beyond 16 tokens, pools with wider slots, fp16 pools, unequal
    lengths are still declined, with the reasons of the one-slot pool mode."""
    x, pool = make(N=2, T=17, P=40)
    slots = torch.arange(34, dtype=torch.int32).reshape(2, 17)
    acc = torch.tensor([3, 1], dtype=torch.int32)
    assert reason_for(captured(**x, initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=acc)) == \
        "sm90 decode serves 1 <= T <= 16 tokens per sequence, got T=17"
    x, _ = make(N=2, T=2)
    slots = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    wide = torch.randn(4, 5, K, V)[:, :4]
    assert reason_for(captured(**x, initial_state=wide, ssm_state_indices=slots, num_accepted_tokens=acc)) == \
        "sm90 decode indexes contiguous state pools (slot stride HV * K * V), got a pool with wider slots"
    assert reason_for(captured(**x, initial_state=pool[:4].half(), ssm_state_indices=slots,
                               num_accepted_tokens=acc)) == "sm90 decode serves fp32 and bf16 state pools, got float16"
    row, _ = make(N=2, T=2, varlen=True)
    row["cu_seqlens"] = torch.tensor([0, 1, 4], dtype=torch.int32)  # lengths 1 and 3, 4 tokens
    assert reason_for(captured(**row, initial_state=pool, ssm_state_indices=torch.arange(6, dtype=torch.int32)
                               .reshape(2, 3), num_accepted_tokens=acc)).startswith(
        "sm90 decode serves cu_seqlens only when every sequence has the same length")


def test_pool_with_wider_slots_is_declined():
    x, _ = make(N=2)
    wide = torch.randn(4, 5, K, V)[:, :4]  # each slot contiguous, slots 5 states apart
    call = captured(**x, initial_state=wide, ssm_state_indices=torch.tensor([0, 3], dtype=torch.int32))
    assert reason_for(call) == \
        "sm90 decode indexes contiguous state pools (slot stride HV * K * V), got a pool with wider slots"
    assert reason_for(dataclasses.replace(call, options={n: v for n, v in call.options.items()
                                                        if n != "state_contiguous"})) == \
        "sm90 decode indexes contiguous state pools (slot stride HV * K * V), got a pool with wider slots"


def test_new_final_state_after_several_tokens_is_declined():
    x, _ = make(N=2, T=2)
    assert reason_for(captured(**x, output_final_state=True)) == (
        "sm90 decode writes a new final state only for T = 1 token per sequence, got T=2 (it would copy the "
        "initial state first: twice FLA's state traffic)")


def test_new_final_state_from_a_bf16_state_is_declined():
    x, _ = make(N=2)
    call = captured(**x, initial_state=torch.randn(2, 4, K, V).bfloat16(), output_final_state=True)
    assert reason_for(call) == ("sm90 decode writes the new final state in the initial state's dtype: it serves an "
                                "fp32 initial_state, got bfloat16")


def test_outputs_only_with_a_positive_bound_is_declined():
    x, _ = make(N=2, T=3)
    x.update(lower_bound=0.5)
    assert reason_for(captured(**x)) == (
        "sm90 decode serves outputs-only calls (output_final_state=False) with lower_bound <= 0, got 0.5")
    x.update(lower_bound=-5.0)
    assert served(captured(**x))


def test_pools_and_shapes_the_kernels_do_not_serve():
    x, pool = make(N=2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    assert reason_for(captured(**x, initial_state=pool.half(), ssm_state_indices=slots)) == \
        "sm90 decode serves fp32 and bf16 state pools, got float16"
    for pool_kw in ({"initial_state": pool.bfloat16()}, {"initial_state": pool, "state_v_first": True}):
        assert served(captured(**x, **pool_kw, ssm_state_indices=slots))
    small, small_pool = make(N=2)
    small = {n: (t[..., :32] if n in ("q", "k", "g") else t) for n, t in small.items()}
    small["dt_bias"] = small["dt_bias"][:4 * 32]
    assert reason_for(captured(**small, initial_state=small_pool[..., :32, :].contiguous(),
                               ssm_state_indices=slots)) == "sm90 decode serves K = V = 64 or 128, got K=32, V=64"
    wide, wide_pool = make(N=2, dtype=torch.float64)
    assert reason_for(captured(**wide, initial_state=wide_pool, ssm_state_indices=slots)) == \
        "sm90 decode serves bf16/fp16/fp32 q/k/v, got torch.float64"


# ------------------------------------------------------------------------------------------ the mapping


@pytest.fixture
def kernel_runs(monkeypatch):
    """Select the sm90 backend for every call it serves (the test fails on one it declines) and run its recurrent
    kernel as the reference decode math; returns the list of (mode, pool, cache_idx, T, flags) launched (flags
    with the accepted counts in MODE_SLOTS). MODE_SLOTS is run as recurrent.py states it: the state read from
    column clamp(a - 1, 0, T_idx - 1) of the request's row, the state after token t stored into column t's slot
    unless that slot is negative or >= P."""
    runs = []

    def select(call):
        reason = sm90.unsupported_reason(dataclasses.replace(call, device=H100))
        assert reason is None, reason
        return sm90

    def run_recurrent(mode, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                      use_qk_l2norm_in_kernel, state_v_first=False, null_slot=None, precomputed_gate=False,
                      beta_activation="none", num_accepted_tokens=None):
        N, T = q.shape[:2]
        P = state_pool.shape[0]
        assert cache_idx.dtype == torch.int32 and cache_idx.is_contiguous()
        assert all(t.shape[:2] == (N, T) for t in (k, v, g, beta)) and 1 <= T <= configs.MAX_T
        assert beta_activation in configs.BETA_SIGMOID
        flags = dict(state_v_first=state_v_first, null_slot=null_slot, precomputed_gate=precomputed_gate,
                     beta_activation=beta_activation)
        acc = num_accepted_tokens
        if mode == configs.MODE_SLOTS:
            assert cache_idx.dim() == 2 and cache_idx.shape[0] == N and cache_idx.shape[1] >= T
            assert acc is None or (acc.dtype == torch.int32 and acc.is_contiguous() and acc.shape == (N,))
            flags["num_accepted_tokens"] = None if acc is None else acc.clone()
            col = torch.zeros(N, dtype=torch.long) if acc is None else (acc.long() - 1).clamp(0, cache_idx.shape[1] - 1)
            read = cache_idx.long().gather(1, col[:, None])[:, 0]
        else:
            assert cache_idx.shape == (N,) and acc is None
            read = cache_idx
        runs.append((mode, state_pool, cache_idx.clone(), T, flags))
        idx = torch.where(read < P, read, -1)  # the kernel skips slots >= P
        # the decode math of the kernels (the reference decode ops', with the gate's source and beta activation)
        gate = "precomputed" if precomputed_gate else "safe" if lower_bound is not None else "softplus"
        qp, kp, gp, bp = reference_backend.prepare_inputs(
            q, k, g, beta, A_log, dt_bias, dtype=torch.float32, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            gate=gate, lower_bound=lower_bound, beta_activation=beta_activation)
        if mode == configs.MODE_KVBUFFER:
            o, buf = mtp_kvbuffer_reference(qp, kp, v, gp, bp, state_pool, idx, scale, state_v_first=state_v_first)
            return o.to(v.dtype), buf
        o, states = ref.decode_mtp_reference(qp, kp, v, gp, bp, state_pool, idx, scale, state_v_first=state_v_first)
        if mode == configs.MODE_FINAL:
            ref.commit_accepted_reference(state_pool, idx, states, T)
            states = None
        if mode == configs.MODE_SLOTS:
            for t in range(T):  # in token order: a slot named twice in a row keeps the later state
                slot = cache_idx[:, t].long()
                write = (idx >= 0) & (slot >= 0) & (slot < P)
                state_pool[slot[write]] = states[write, t]
            states = None
        return o.to(v.dtype), states

    monkeypatch.setattr(dispatch, "select", select)
    monkeypatch.setattr(launch, "run_recurrent", run_recurrent)
    return runs


def on_reference(**kw):
    """The reference backend's result of the same call (state tensors cloned: the call may write them)."""
    kw = {n: (t.clone() if n == "initial_state" and t is not None else t) for n, t in kw.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "select", lambda call: reference_backend.REFERENCE_BACKEND)
        o, state = cula_core.fused_recurrent_kda(**kw)
    return o, (kw["initial_state"] if "ssm_state_indices" in kw else state)


@pytest.mark.parametrize("layout", ["batch", "varlen row"])
@pytest.mark.parametrize("T", [1, 3])
def test_pool_calls_update_the_pool_in_place(kernel_runs, layout, T):
    x, pool = make(N=5, T=T, P=9, varlen=layout == "varlen row", seed=T)
    slots = torch.tensor([7, -1, 2, 4, 0], dtype=torch.int64)  # a padded sequence; int64 as vLLM may pass
    before = pool.clone()
    o_ref, pool_ref = on_reference(**x, initial_state=pool, ssm_state_indices=slots)
    o, returned = cula_core.fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=slots)
    ((mode, kernel_pool, cache_idx, kernel_T, flags),) = kernel_runs
    assert mode == configs.MODE_FINAL and kernel_pool is pool and kernel_T == T  # in place: no copy of the pool
    assert cache_idx.tolist() == slots.tolist() and flags == dict(state_v_first=False, null_slot=None,
                                                                  precomputed_gate=False, beta_activation="none")
    assert returned is pool
    torch.testing.assert_close(o, o_ref, **TOL)
    assert (o.view(5, T, 4, V)[1] == 0).all() if layout == "batch" else (o[0, T:2 * T] == 0).all()
    torch.testing.assert_close(pool, pool_ref, **TOL)
    untouched = [s for s in range(9) if s not in (7, 2, 4, 0)]
    assert torch.equal(pool[untouched], before[untouched])


def test_slot_column_at_one_token(kernel_runs):
    x, pool = make(N=3, T=1, P=6)
    slots = torch.tensor([[4, 1, 0], [-1, 2, 3], [1, -1, 5]], dtype=torch.int32)
    o_ref, pool_ref = on_reference(**x, initial_state=pool, ssm_state_indices=slots)
    o, _ = cula_core.fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=slots)
    assert kernel_runs[0][2].tolist() == [4, -1, 1]
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)


@pytest.mark.parametrize("initial", [True, False])
def test_new_final_state_reads_the_initial_state_as_a_pool(kernel_runs, initial):
    x, _ = make(N=3, T=1, seed=4)
    x.update(lower_bound=-5.0)  # the safe gate
    h0 = torch.randn(3, 4, K, V) * 0.1 if initial else None
    before = h0.clone() if initial else None
    o_ref, ht_ref = on_reference(**x, initial_state=h0, output_final_state=True)
    o, ht = cula_core.fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    ((mode, kernel_pool, cache_idx, _, _),) = kernel_runs
    assert mode == configs.MODE_STATES
    if initial:
        assert kernel_pool.data_ptr() == h0.data_ptr() and cache_idx.tolist() == [0, 1, 2]
        assert torch.equal(h0, before)
    else:  # one zero state, read by every sequence
        assert kernel_pool.shape == (1, 4, K, V) and not kernel_pool.any() and cache_idx.tolist() == [0, 0, 0]
    assert ht.shape == (3, 4, K, V) and ht.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


@pytest.mark.parametrize("layout", ["batch", "varlen row"])
def test_outputs_only_run_the_verify_mode(kernel_runs, layout):
    x, _ = make(N=3, T=4, varlen=layout == "varlen row", seed=9)
    h0 = torch.randn(3, 4, K, V) * 0.1
    o_ref, none = on_reference(**x, initial_state=h0)
    o, ht = cula_core.fused_recurrent_kda(**x, initial_state=h0)
    assert ht is None and none is None
    assert [run[0] for run in kernel_runs] == [configs.MODE_KVBUFFER] and kernel_runs[0][3] == 4
    torch.testing.assert_close(o, o_ref, **TOL)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_v_first_and_bf16_pools_reach_the_kernel_as_they_are(kernel_runs, pool_dtype):
    x, pool = make(N=3, T=2, P=5, seed=2)
    pool = pool.transpose(-1, -2).contiguous().to(pool_dtype)  # [P, HV, V, K]
    slots = torch.tensor([1, 4, -1], dtype=torch.int32)
    o_ref, pool_ref = on_reference(**x, initial_state=pool, ssm_state_indices=slots, state_v_first=True)
    o, _ = cula_core.fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=slots, state_v_first=True)
    ((mode, kernel_pool, _, _, flags),) = kernel_runs
    assert kernel_pool is pool and flags["state_v_first"] is True
    torch.testing.assert_close(o, o_ref, **TOL)
    tol = TOL if pool_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(pool.float(), pool_ref.float(), **tol)


@pytest.mark.parametrize(("flags", "activation"), BETA_FLAGS, ids=[a for _, a in BETA_FLAGS])
@pytest.mark.parametrize("gate", ["precomputed", "softplus"])
@pytest.mark.parametrize("mapping", ["pool", "new state", "outputs only"])
def test_gate_source_and_beta_activation_reach_the_kernel(kernel_runs, mapping, gate, flags, activation):
    """A precomputed log decay and beta logits go to the kernel as they are (precomputed_gate, beta_activation),
    with the inputs untouched: the kernel's decode math on them gives the reference's fused_recurrent_kda, in each
    mapping (V-first pools and states, bf16 beta logits)."""
    T = 1 if mapping == "new state" else 3
    x, pool = make(N=3, T=T, P=6, seed=13)
    x["beta"] = torch.randn(x["beta"].shape, generator=torch.Generator().manual_seed(5)).bfloat16() * 3
    x = precomputed(x) if gate == "precomputed" else x
    pool = pool.transpose(-1, -2).contiguous()  # V-first
    states = {"pool": dict(initial_state=pool, ssm_state_indices=torch.tensor([5, -1, 2], dtype=torch.int32)),
              "new state": dict(initial_state=pool[:3].clone(), output_final_state=True),
              "outputs only": dict(initial_state=pool[:3].clone())}[mapping]
    kw = dict(**x, **flags, **states, state_v_first=True)
    o_ref, state_ref = on_reference(**kw)
    o, state = cula_core.fused_recurrent_kda(**kw)
    ((mode, kernel_pool, _, _, run_flags),) = kernel_runs
    assert mode == {"pool": configs.MODE_FINAL, "new state": configs.MODE_STATES,
                    "outputs only": configs.MODE_KVBUFFER}[mapping]
    assert run_flags == dict(state_v_first=True, null_slot=None, precomputed_gate=gate == "precomputed",
                             beta_activation=activation)
    torch.testing.assert_close(o, o_ref, **TOL)
    if mapping == "pool":
        assert kernel_pool is pool
        torch.testing.assert_close(pool, state_ref, **TOL)
    elif mapping == "new state":
        torch.testing.assert_close(state, state_ref, **TOL)
    else:
        assert state is None and state_ref is None


#: slot tables of 3 sequences with T = 3 tokens in a pool of 10 slots, and their accepted counts: every row names
#: its own slots; the cases the kernel must keep apart
SLOT_TABLES = {
    "plain": ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [1, 3, 2]),
    "padded row": ([[0, 1, 2], [-1, 4, 5], [6, 7, 8]], [2, 1, 3]),       # row 1 reads -1: zero outputs, no write
    "negative write slot": ([[0, -1, 2], [3, 4, -1], [6, 7, 8]], [1, 2, 3]),
    "slot named twice": ([[0, 0, 2], [3, 4, 4], [9, 7, 9]], [1, 3, 2]),    # the later state stays
    "writes the read slot": ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [3, 3, 3]),  # reads column 2, writes it last
    "read beyond the written columns": ([[0, 1, 2, 9], [3, 4, 5, -1], [6, 7, 8, -1]], [4, 1, 2]),
}


@pytest.mark.parametrize("accepted", [True, False])
@pytest.mark.parametrize("case", list(SLOT_TABLES))
@pytest.mark.parametrize("layout", ["batch", "varlen row"])
def test_speculative_slots_run_the_slot_mode(kernel_runs, layout, case, accepted):
    """[N, T_idx] slots with or without num_accepted_tokens: MODE_SLOTS on the pool in place, the slot table and
    the counts as int32 (int64 given here), and the kernel's rule reproduces the reference's pool update."""
    table, counts = SLOT_TABLES[case]
    x, pool = make(N=3, T=3, P=10, varlen=layout == "varlen row", seed=21)
    slots = torch.tensor(table, dtype=torch.int64)
    kw = dict(initial_state=pool, ssm_state_indices=slots)
    if accepted:
        kw["num_accepted_tokens"] = torch.tensor(counts, dtype=torch.int64)
    before = pool.clone()
    o_ref, pool_ref = on_reference(**x, **kw)
    o, returned = cula_core.fused_recurrent_kda(**x, **kw)
    ((mode, kernel_pool, cache_idx, kernel_T, flags),) = kernel_runs
    assert mode == configs.MODE_SLOTS and kernel_pool is pool and returned is pool and kernel_T == 3
    assert cache_idx.tolist() == table
    acc = flags["num_accepted_tokens"]
    assert (acc.tolist() == counts) if accepted else acc is None
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)
    named = {s for row in table for s in row if s >= 0}
    untouched = [s for s in range(10) if s not in named]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_speculative_slots_at_one_token_and_v_first_pools(kernel_runs, pool_dtype):
    """num_accepted_tokens at T = 1 (the read column from the counts, token 0 written to column 0) on a V-first
    pool of either dtype, reaching the kernel as it is."""
    x, pool = make(N=3, T=1, P=8, seed=8)
    pool = pool.transpose(-1, -2).contiguous().to(pool_dtype)
    slots = torch.tensor([[5, 1], [2, 0], [3, 4]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 2], dtype=torch.int32)
    o_ref, pool_ref = on_reference(**x, initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=acc,
                                   state_v_first=True)
    o, _ = cula_core.fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=acc,
                                         state_v_first=True)
    ((mode, kernel_pool, cache_idx, _, flags),) = kernel_runs
    assert mode == configs.MODE_SLOTS and kernel_pool is pool and flags["state_v_first"] is True
    assert cache_idx.tolist() == slots.tolist() and flags["num_accepted_tokens"].tolist() == [2, 1, 2]
    torch.testing.assert_close(o, o_ref, **TOL)
    tol = TOL if pool_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(pool.float(), pool_ref.float(), **tol)
