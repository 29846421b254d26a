"""Plans (cula_core.plans) on a GPU: a repeated eager call runs its plan and gives bitwise the results of the full
path (forced here by a non-contiguous view, which never gets a signature), bumps the pool's version counter, keeps
rejecting bad scalars and bad host values, and follows CULA_BACKEND."""

import pytest
import torch

import cula
from cula_core import plans

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

K = 128


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a non-contiguous view (the last dim strided by 2): the call takes the full path."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _decode_inputs(N=3, H=4, P=8, T=1):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    x = dict(q=r(N, T, H, K).bfloat16(), k=r(N, T, H, K).bfloat16(), v=r(N, T, H, K).bfloat16(),
             g=r(N, T, H, K).bfloat16(), beta=torch.rand(N, T, H, device="cuda", generator=gen).bfloat16())
    pool = 0.1 * r(P, H, K, K)
    idx = torch.tensor([5, -1, 2][:N], dtype=torch.int32, device="cuda")
    return x, pool, idx, dict(A_log=r(H), dt_bias=r(H * K), lower_bound=-5.0, use_qk_l2norm_in_kernel=True)


def _decode(x, pool, idx, kw, q=None):
    return cula.kda_decode(x["q"] if q is None else q, x["k"], x["v"], x["g"], x["beta"], pool, idx, **kw)


def test_decode_plan_matches_the_full_path_bitwise():
    plans.forget()
    x, pool0, idx, kw = _decode_inputs()
    pool_a, pool_b, pool_c = pool0.clone(), pool0.clone(), pool0.clone()
    o_first = _decode(x, pool_a, idx, kw)  # makes the plan
    made = plans.count()
    assert made == 1
    o_full = _decode(x, pool_b, idx, kw, q=_strided(x["q"]))  # full path: no signature
    o_plan = _decode(x, pool_c, idx, kw)  # runs the plan
    assert plans.count() == made
    torch.cuda.synchronize()
    assert torch.equal(o_first, o_full) and torch.equal(o_plan, o_full)
    assert torch.equal(pool_a, pool_b) and torch.equal(pool_c, pool_b)


PROGRAM_OPS = ["kda_decode", "kda_decode_mtp", "kda_decode_mtp-per_token_states", "kda_decode_mtp_kvbuffer",
               "fused_recurrent_kda"]


@pytest.mark.parametrize("op", PROGRAM_OPS)
def test_decode_program_of_the_plan_table_matches_the_full_path_bitwise(op):
    """The repeated call served by the compiled plan table (its program registered by the first call): every result
    and the pool bitwise the full path's (the decode ops with T = 3 draft tokens for MTP and the KVBuffer;
    fused_recurrent_kda on a pool with int32 slots, vLLM's call)."""
    from cula_core.cute_runtime import plan_table

    plans.forget()
    x, pool0, idx, kw = _decode_inputs(T=1 if op in ("kda_decode", "fused_recurrent_kda") else 3)
    pools = [pool0.clone() for _ in range(3)]

    def call(pool, q=None):
        q = x["q"] if q is None else q
        args = (q, x["k"], x["v"], x["g"], x["beta"], pool, idx)
        if op == "kda_decode":
            return [cula.kda_decode(*args, **kw)]
        if op.startswith("kda_decode_mtp"):
            per_token = op.endswith("per_token_states")
            o, states = (cula.kda_decode_mtp_kvbuffer(*args, **kw) if op.endswith("kvbuffer")
                         else cula.kda_decode_mtp(*args, **kw, output_per_token_states=per_token))
            assert (states is None) == (op == "kda_decode_mtp")
            return [o] if states is None else [o, states]
        o, state = cula.fused_recurrent_kda(q, x["k"], x["v"], x["g"], x["beta"], kw["A_log"], kw["dt_bias"],
                                            initial_state=pool, use_gate_in_kernel=True,
                                            lower_bound=kw["lower_bound"], use_qk_l2norm_in_kernel=True,
                                            ssm_state_indices=idx)
        assert state is pool
        return [o]

    call(pools[0])  # makes the plan and registers its program
    assert plans.count() == 1 and plan_table.count() == 1
    version = pools[1]._version
    from_table = call(pools[1])
    if op != "kda_decode_mtp_kvbuffer":  # the KVBuffer op only reads the pool
        assert pools[1]._version > version
    full = call(pools[2], q=_strided(x["q"]))
    torch.cuda.synchronize()
    assert len(from_table) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(from_table, full))
    assert torch.equal(pools[1], pools[2])
    writes_pool = not op.endswith(("per_token_states", "kvbuffer"))  # those return the states, the pool is read
    assert torch.equal(pools[2], pool0) != writes_pool


def test_decode_plan_bumps_the_pool_version():
    x, pool, idx, kw = _decode_inputs()
    _decode(x, pool, idx, kw)
    before = pool._version
    _decode(x, pool, idx, kw)
    assert pool._version > before


def test_bad_scalars_raise_after_a_plan_exists():
    x, pool, idx, kw = _decode_inputs()
    _decode(x, pool, idx, dict(kw, scale=1.0))
    with pytest.raises(TypeError, match="scale must be a float"):
        _decode(x, pool, idx, dict(kw, scale=True))
    with pytest.raises(TypeError, match="lower_bound must be a float"):
        _decode(x, pool, idx, dict(kw, lower_bound="-5"))


def test_backend_environment_is_honoured_after_a_plan(monkeypatch):
    plans.forget()
    x, pool0, idx, kw = _decode_inputs()
    pool_a, pool_b = pool0.clone(), pool0.clone()
    o_default = _decode(x, pool_a, idx, kw)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_ref = _decode(x, pool_b, idx, kw)
    assert plans.count() == 2  # a second plan, for the forced backend
    assert (o_default.float() - o_ref.float()).abs().max().item() <= 2e-2
    assert (pool_a - pool_b).abs().max().item() <= 1e-4 * max(1.0, pool_b.abs().max().item())


def _prefill_inputs(lengths=(100, 37, 200), H=4):
    gen = torch.Generator(device="cuda").manual_seed(1)
    T = sum(lengths)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = dict(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, K).bfloat16(),
             g=r(1, T, H, K).bfloat16(), beta=r(1, T, H).bfloat16())
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen)), dt_bias=0.1 * r(H * K),
              safe_gate=True, lower_bound=-5.0, output_final_state=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu,
              initial_state=0.1 * r(len(lengths), H, K, K), state_v_first=True)
    return x, kw


def _prefill(x, kw, q=None):
    return cula.kda_prefill(x["q"] if q is None else q, x["k"], x["v"], x["g"], x["beta"], **kw)


def test_prefill_plan_matches_the_full_path_bitwise():
    plans.forget()
    x, kw = _prefill_inputs()
    o_first, s_first = _prefill(x, kw)
    assert plans.count() == 1
    o_full, s_full = _prefill(x, kw, q=_strided(x["q"]))
    o_plan, s_plan = _prefill(x, kw)
    assert plans.count() == 1
    assert torch.equal(o_plan, o_full) and torch.equal(s_plan, s_full)
    assert torch.equal(o_first, o_full) and torch.equal(s_first, s_full)
    assert s_plan.data_ptr() != kw["initial_state"].data_ptr()  # a new state, never the caller's


def test_prefill_plan_checks_host_lengths_every_call():
    x, kw = _prefill_inputs()
    _prefill(x, kw)
    bad = kw["cu_seqlens_cpu"].clone()
    bad[1] = bad[2] + 1  # not monotone; the device copy is not read (no synchronisation)
    with pytest.raises(ValueError, match="non-decreasing"):
        _prefill(x, dict(kw, cu_seqlens_cpu=bad))
    short = kw["cu_seqlens_cpu"].clone()
    short[-1] -= 1
    with pytest.raises(ValueError, match="must end at T"):
        _prefill(x, dict(kw, cu_seqlens_cpu=short))


def test_prefill_plan_makes_no_graph_and_matches_without_grad():
    """An input that requires grad (grad mode on): the plan's outputs require none and equal a call whose inputs
    require none, bitwise, on the first call (which makes the plan) and the next (which runs it)."""
    plans.forget()
    x, kw = _prefill_inputs()
    o_ref, s_ref = _prefill(x, kw)
    grad_q = x["q"].clone().requires_grad_(True)
    for _ in range(2):
        o, s = _prefill(x, kw, q=grad_q)
        assert o.grad_fn is None and not o.requires_grad and s.grad_fn is None and not s.requires_grad
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert plans.count() == 1  # requires_grad is not part of the signature: one plan serves both


@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunk_kda_inference_plan_matches_the_full_path_bitwise(state_v_first):
    """chunk_kda with nothing to record (no input requiring grad): a repeated call runs its plan, bitwise the full
    path's results, in the caller's state layout."""
    plans.forget()
    x, kw = _prefill_inputs()
    kw = dict(kw, state_v_first=state_v_first)

    def call(q=None):
        return cula.chunk_kda(x["q"] if q is None else q, x["k"], x["v"], x["g"], x["beta"], **kw)

    o_first, s_first = call()
    assert plans.count() == 1
    o_full, s_full = call(q=_strided(x["q"]))
    o_plan, s_plan = call()
    assert plans.count() == 1
    assert torch.equal(o_plan, o_full) and torch.equal(s_plan, s_full)
    assert torch.equal(o_first, o_full) and torch.equal(s_first, s_full)
