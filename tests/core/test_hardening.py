"""Inputs that fuzzing the public ops found mishandled (issue 21, "Hardening"): each now gives the right result or
a ValueError / TypeError that names the argument, before any kernel runs and with every state pool unchanged."""

from __future__ import annotations

import pytest
import torch

import cula_core
from cula_core import registry, validation
from cula_core.backend import Backend, CallConfig, DeviceInfo
from cula_core.reference import kda_gate

HQK, HV, K, V = 1, 2, 8, 8
NREQ, P, TD = 4, 6, 3
CACHE_IDX = (0, 4, -1, 2)


def decode_args(seed=0, T=TD):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(NREQ, T, HQK, K, generator=gen), k=torch.randn(NREQ, T, HQK, K, generator=gen),
        v=torch.randn(NREQ, T, HV, V, generator=gen), g=torch.randn(NREQ, T, HV, K, generator=gen),
        beta=torch.rand(NREQ, T, HV, generator=gen), state_pool=torch.randn(P, HV, K, V, generator=gen),
        cache_idx=torch.tensor(CACHE_IDX, dtype=torch.int32), A_log=torch.randn(HV, generator=gen) * 0.5,
        use_qk_l2norm_in_kernel=True,
    )


def chunk_args(T=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(1, T, HQK, K, generator=gen), k=torch.randn(1, T, HQK, K, generator=gen),
        v=torch.randn(1, T, HV, V, generator=gen), g=-torch.rand(1, T, HV, K, generator=gen),
        beta=torch.rand(1, T, HV, generator=gen),
    )


# ------------------------------------------------------------------- flush: rejected tokens never leak in


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("all_layers", [False, True], ids=["one_layer", "all_layers"])
def test_flush_ignores_non_finite_rows_of_rejected_tokens(poison, all_layers):
    args = decode_args()
    pool = args.pop("state_pool")
    accept = torch.tensor([1, 3, 2, 0], dtype=torch.int32)
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args, state_pool=pool)
    _, states = cula_core.kda_decode_mtp(**args, state_pool=pool.clone(), output_per_token_states=True)
    poisoned = buf.clone()
    for i, m in enumerate(accept.tolist()):
        poisoned[i, m:] = poison  # every column (k_t, G_t, delta_t) of every rejected token
    clean_pool, dirty_pool = pool.clone(), pool.clone()

    def flush(p, b):
        if all_layers:
            cula_core.kda_flush_kvbuffer_all_layers([p], args["cache_idx"], [b], accept)
        else:
            cula_core.kda_flush_kvbuffer(p, args["cache_idx"], b, accept)

    flush(clean_pool, buf)
    flush(dirty_pool, poisoned)
    assert torch.isfinite(dirty_pool).all()
    assert torch.equal(dirty_pool, clean_pool)
    for i, (slot, m) in enumerate(zip(CACHE_IDX, accept.tolist(), strict=True)):
        if slot >= 0 and m > 0:  # the state after the m accepted tokens, as the recurrence gives it
            torch.testing.assert_close(dirty_pool[slot], states[i, m - 1], rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(P) if s not in (0, 4)]  # slot 2's request accepted nothing
    assert torch.equal(dirty_pool[untouched], pool[untouched])


# ------------------------------------------------------------------- int32 offsets: the states count too


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_states_count_toward_the_int32_limit():
    # 4096 sequences of 32 tokens at HV = 64, K = V = 128: every token tensor is far below 2**31 elements, the
    # states hold 2**32 (no 16 GiB allocation: meta tensors carry the shapes)
    seqs, length, hqk, hv, d = 4096, 32, 16, 64, 128
    T = seqs * length
    q, k, v, g = meta(1, T, hqk, d), meta(1, T, hqk, d), meta(1, T, hv, d), meta(1, T, hv, d)
    beta = meta(1, T, hv)
    cu = torch.empty(seqs + 1, dtype=torch.int32, device="meta")
    sizes = validation.forward_indexed_sizes(q, k, v, g, beta, None, cu, True)
    assert sizes["final_state"] == 2**32
    assert max(n for name, n in sizes.items() if name != "final_state") < 2**31
    with pytest.raises(ValueError, match=r"^final_state has 4294967296 elements, more than the sm90 kernels can "
                                         r"index with int32 offsets \(at most 2147483647\); split the batch$"):
        validation.check_int32_indexing(sizes, "the sm90 kernels")
    h0 = meta(seqs, hv, d, d, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^initial_state has 4294967296 elements"):
        validation.check_int32_indexing(validation.forward_indexed_sizes(q, k, v, g, beta, h0, cu, False), "x")


class Int32Backend(Backend):
    """A backend on the CPU whose kernels index in int32: the guard must stop a call before its kernel runs."""

    name = "int32_test"
    package = "tests"
    ops = ("chunk_kda", "kda_prefill")
    int32_indexing = True

    def runs_on(self, device: DeviceInfo) -> bool:
        return device.type == "cpu"

    def kernel(self, op):
        raise AssertionError(f"the int32 guard let {op} reach a kernel")


@pytest.mark.parametrize("op", ["chunk_kda", "kda_prefill"])
@pytest.mark.parametrize("state", ["initial_state", "final_state"])
def test_ops_guard_their_states_for_int32_backends(monkeypatch, op, state):
    # Scaled down: the limit lowered below the states' size (N * HV * K * V = 4 * 2 * 64 = 512 elements) and
    # above every token tensor's (at most 8 * 2 * 8 = 128), the ops must name the state.
    monkeypatch.setattr(registry, "backends", lambda: [Int32Backend()])
    monkeypatch.setattr(validation, "INT32_MAX", 300)
    args = chunk_args(T=8)
    cu = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)
    kwargs = dict(initial_state=torch.zeros(4, HV, K, V)) if state == "initial_state" else dict(
        output_final_state=True)
    with pytest.raises(ValueError, match=rf"^{state} has 512 elements, more than the int32_test kernels"):
        getattr(cula_core, op)(**args, cu_seqlens=cu, **kwargs)


# ------------------------------------------------------------------- lower_bound: one rule for every op


def _gate_params(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(HV, generator=gen) * 0.5, torch.randn(HV * K, generator=gen)


def test_a_model_prefilled_with_lower_bound_minus_8_decodes():
    A_log, dt_bias = _gate_params()
    gate = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-8.0, use_qk_l2norm_in_kernel=True)
    T = 7
    a = chunk_args(T=T)
    a["g"] = torch.randn(1, T, HV, K)  # raw: the gate is computed in kernel
    o_all, s_all = cula_core.kda_prefill(**a, use_gate_in_kernel=True, output_final_state=True, **gate)
    head = {n: t[:, :T - 1] for n, t in a.items()}
    _, s_head = cula_core.kda_prefill(**head, use_gate_in_kernel=True, output_final_state=True, **gate)
    pool = torch.zeros(3, HV, K, V)
    pool[1] = s_head[0]
    last = {n: t[:, T - 1:] for n, t in a.items()}
    o = cula_core.kda_decode(**last, state_pool=pool, cache_idx=torch.tensor([1], dtype=torch.int32), **gate)
    torch.testing.assert_close(o, o_all[:, T - 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[1], s_all[0], rtol=1e-5, atol=1e-5)


def _lower_bound_calls():
    """Every public op that takes lower_bound, called with the given bound (and the gate in kernel)."""
    A_log, dt_bias = _gate_params()

    def chunk(op):
        def run(lb, **kw):
            a = chunk_args()
            return getattr(cula_core, op)(**a, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                          lower_bound=lb, **kw)
        return run

    def decode(op, T):
        def run(lb, **kw):
            args = decode_args(T=T)
            return getattr(cula_core, op)(**args, lower_bound=lb, **kw)
        return run

    return {
        "chunk_kda": chunk("chunk_kda"),
        "kda_prefill": chunk("kda_prefill"),
        "kda_decode": decode("kda_decode", 1),
        "kda_decode_mtp": decode("kda_decode_mtp", TD),
        "kda_decode_mtp_kvbuffer": decode("kda_decode_mtp_kvbuffer", TD),
        "reference.kda_gate": lambda lb, **kw: kda_gate(torch.randn(2, HV, K), A_log, dt_bias, lower_bound=lb, **kw),
    }


@pytest.mark.parametrize("op", list(_lower_bound_calls()))
@pytest.mark.parametrize("bad,exc,message", [
    ("-5", TypeError, r"^lower_bound must be a float or None, got str$"),
    (True, TypeError, r"^lower_bound must be a float or None, got bool$"),
    (float("nan"), ValueError, r"^lower_bound must be a finite float or None, got nan$"),
    (-float("inf"), ValueError, r"^lower_bound must be a finite float or None, got -inf$"),
])
def test_every_op_rejects_a_bad_lower_bound_with_one_message(op, bad, exc, message):
    with pytest.raises(exc, match=message):
        _lower_bound_calls()[op](bad)


@pytest.mark.parametrize("op", list(_lower_bound_calls()))
def test_every_op_accepts_what_prefill_accepts(op):
    out = _lower_bound_calls()[op](-8.0)
    first = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(first).all()


@pytest.mark.parametrize("op", ["chunk_kda", "kda_prefill", "reference.kda_gate"])
def test_safe_gate_narrows_the_range_with_one_message(op):
    with pytest.raises(ValueError, match=r"^lower_bound must be in the safe range \[-5, 0\) with safe_gate=True, "
                                         r"got -8.0$"):
        _lower_bound_calls()[op](-8.0, safe_gate=True)


@pytest.mark.parametrize("op", ["kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer"])
def test_decode_messages_name_only_arguments_the_op_takes(op):
    args = decode_args(T=1 if op == "kda_decode" else TD)
    args["A_log"] = None
    with pytest.raises(ValueError) as err:
        getattr(cula_core, op)(**args)
    message = str(err.value)
    assert "A_log" in message and "lower_bound" in message
    assert "safe_gate" not in message and "use_gate_in_kernel" not in message


def test_sm90_decode_serves_every_non_positive_lower_bound():
    decode = pytest.importorskip("cula_sm90.decode")
    h100 = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="fake H100")

    def reason(lb):
        call = CallConfig(op="kda_decode_mtp", device=h100, dtype=torch.bfloat16, K=128, V=128, HQK=4, HV=8, T=2,
                          gate="safe", options=dict(lower_bound=lb, state_dtype=torch.float32))
        return decode.unsupported_reason(call)

    for lb in (-0.5, -5.0, -8.0, -30.0, 0.0):
        assert reason(lb) is None
    assert reason(2.0) == "sm90 decode serves the safe gate with lower_bound <= 0, got 2.0"


# ------------------------------------------------------------------- arguments of the wrong kind


@pytest.mark.parametrize("op", ["chunk_kda", "kda_prefill"])
def test_a_list_for_cu_seqlens_is_a_type_error(op):
    with pytest.raises(TypeError, match=r"^cu_seqlens must be a torch.Tensor, got list$"):
        getattr(cula_core, op)(**chunk_args(), cu_seqlens=[0, 8, 16])


@pytest.mark.parametrize("op", ["kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer", "kda_flush_kvbuffer",
                                "kda_flush_kvbuffer_all_layers"])
def test_a_list_for_cache_idx_is_a_type_error(op):
    args = decode_args(T=1 if op == "kda_decode" else TD)
    pool = args["state_pool"]
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    before = pool.clone()
    args["cache_idx"] = list(CACHE_IDX)
    with pytest.raises(TypeError, match=r"^cache_idx must be a torch.Tensor, got list$"):
        if op == "kda_flush_kvbuffer":
            cula_core.kda_flush_kvbuffer(pool, args["cache_idx"], buf, 1)
        elif op == "kda_flush_kvbuffer_all_layers":
            cula_core.kda_flush_kvbuffer_all_layers([pool], args["cache_idx"], [buf], 1)
        else:
            getattr(cula_core, op)(**args)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("accept_len,message", [
    (1.0, r"got float$"),
    ([1, 1, 1, 1], r"got list$"),
    (torch.ones(NREQ, dtype=torch.int64), r"got a tensor of dtype int64$"),
])
def test_accept_len_errors_name_the_accepted_types(accept_len, message):
    args = decode_args()
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    with pytest.raises(TypeError, match=r"^accept_len must be an int or an \[N\] int32 tensor, " + message):
        cula_core.kda_flush_kvbuffer(args["state_pool"], args["cache_idx"], buf, accept_len)


def test_a_kvbuffer_of_another_batch_is_blamed():
    args = decode_args()
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    pool = args["state_pool"]
    before = pool.clone()
    short = buf[:2].contiguous()
    want = r"\(N = len\(cache_idx\)\) = \[4, 3, 2, 24\], got \[2, 3, 2, 24\]$"
    with pytest.raises(ValueError, match=r"^kvbuffer must have shape \[N, T, HV, 2K\+V\] " + want):
        cula_core.kda_flush_kvbuffer(pool, args["cache_idx"], short, 1)
    with pytest.raises(ValueError, match=r"^kvbuffers\[1\] must have shape \[N, T, HV, 2K\+V\] " + want):
        cula_core.kda_flush_kvbuffer_all_layers([pool, pool.clone()], args["cache_idx"], [buf, short], 1)
    assert torch.equal(pool, before)


# ------------------------------------------------------------------- cu_seqlens_cpu: one source of truth


@pytest.mark.parametrize("op", ["chunk_kda", "kda_prefill"])
def test_cu_seqlens_cpu_must_hold_the_values_of_cu_seqlens(op):
    fn = getattr(cula_core, op)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_cpu must hold the values of cu_seqlens, got "
                                         r"cu_seqlens_cpu\[1\] = 6 but cu_seqlens\[1\] = 8$"):
        fn(**chunk_args(), cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 6, 16], dtype=torch.int32))
    # the same values in another integer dtype agree
    o_ref, _ = fn(**chunk_args(), cu_seqlens=cu)
    o, _ = fn(**chunk_args(), cu_seqlens=cu, cu_seqlens_cpu=cu.long())
    assert torch.equal(o, o_ref)


# ------------------------------------------------------------------- all-layers flush: no aliased pools


def test_all_layers_flush_rejects_aliased_pools():
    args = decode_args()
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    pool = args["state_pool"]
    before = pool.clone()
    with pytest.raises(ValueError, match=r"^state_pools\[1\] shares memory with state_pools\[0\]: each layer needs "
                                         r"its own pool \(an aliased pool would be flushed twice\)$"):
        cula_core.kda_flush_kvbuffer_all_layers([pool, pool], args["cache_idx"], [buf, buf], 2)
    # overlapping slot ranges of one allocation alias as well
    big = torch.randn(3 * P, HV, K, V)
    big_before = big.clone()
    with pytest.raises(ValueError, match=r"^state_pools\[2\] shares memory with state_pools\[0\]"):
        cula_core.kda_flush_kvbuffer_all_layers([big[:P], big[2 * P:], big[P - 1:2 * P - 1]], args["cache_idx"],
                                                [buf, buf, buf], 2)
    assert torch.equal(pool, before) and torch.equal(big, big_before)


def test_all_layers_flush_takes_disjoint_pools_of_one_allocation():
    args = decode_args()
    _, buf = cula_core.kda_decode_mtp_kvbuffer(**args)
    big = torch.randn(2 * P, HV, K, V)
    expected = [big[:P].clone(), big[P:].clone()]
    for p in expected:
        cula_core.kda_flush_kvbuffer(p, args["cache_idx"], buf, 2)
    cula_core.kda_flush_kvbuffer_all_layers([big[:P], big[P:]], args["cache_idx"], [buf, buf], 2)
    assert torch.equal(big[:P], expected[0]) and torch.equal(big[P:], expected[1])
