"""CPU tests of the sm90 decode ops' plans (cula_sm90.decode.ops.planned, launch.recurrent_launcher): with host
tensors described as an sm_90 device and the kernels replaced by a recorder (nothing compiles or runs), a repeated
call launches what the full path launches, a call that differs in shape, dtype or contiguity misses the plan (a bad
one is refused every time), and a pool view at an odd address runs the reference instead of a kernel. The repeated
calls run the plan's program in the compiled plan table (cula_core.cute_runtime.plan_table), which calls the
recorder through TVM-FFI."""

from __future__ import annotations

import pytest
import torch

import cula
from cula_core import plans, reference_backend
from cula_core.backend import DeviceInfo
from cula_core.cute_runtime import plan_table

# shapes no other test of this session launches (launch.py keeps the launch of each batch shape it has seen)
N, T, HQK, HV, K, P = 5, 3, 3, 9, 64, 7
HOPPER = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="host tensors as sm_90")


@pytest.fixture
def launches(monkeypatch):
    """The launches made, as (kernel name, configuration, arguments); host tensors are an sm_90 device to the
    dispatch and get plan signatures (plans.MIN_DEVICE)."""
    from cula_core import cute_runtime as rt
    from cula_sm90.decode import launch

    made = []

    def function(*config):
        return lambda *args: made.append((config, args))

    of = DeviceInfo.of
    monkeypatch.setattr(DeviceInfo, "of", staticmethod(lambda d: HOPPER if d.type == "cpu" else of(d)))
    monkeypatch.setattr(launch, "recurrent_function", function)
    monkeypatch.setattr(rt, "current_stream", lambda device=None: 0)
    monkeypatch.setattr(rt, "sm_count", lambda index: 132)
    monkeypatch.setattr(plans, "MIN_DEVICE", -1)
    plans.forget()
    yield made
    plans.forget()


def _inputs(T=T, g_dtype=torch.bfloat16, N=N):
    """N requests of T tokens (N up to 7: launch.py keys its launches by shape, so a test that must see its own
    launches picks a batch no other test uses)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(N, T, HQK, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(N, T, HV, K, generator=gen).bfloat16()
    g = torch.randn(N, T, HV, K, generator=gen).to(g_dtype)
    beta = torch.rand(N, T, HV, generator=gen).bfloat16()
    pool = 0.1 * torch.randn(P, HV, K, K, generator=gen)
    idx = torch.tensor([4, -1, 0, 6, 2, 1, 3][:N], dtype=torch.int32)
    return [q, k, v, g, beta, pool, idx], dict(A_log=torch.rand(HV), dt_bias=torch.rand(HV * K),
                                               use_qk_l2norm_in_kernel=True)


def _strided(t):
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


OPS = [("kda_decode", {}), ("kda_decode_mtp", {}), ("kda_decode_mtp", {"output_per_token_states": True}),
       ("kda_decode_mtp_kvbuffer", {})]


@pytest.mark.parametrize(("op", "extra"), OPS, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_a_plan_launches_what_the_full_path_launches(launches, op, extra):
    x, kw = _inputs(T=1 if op == "kda_decode" else T)
    run = getattr(cula, op)
    results = [run(*x, **kw, **extra) for _ in range(2)]  # makes the plan, then runs its program (the plan table)
    assert plans.count() == 1 and plan_table.count() == 1
    full = run(_strided(x[0]), *x[1:], **kw, **extra)  # a non-contiguous q: no signature, the full path
    assert plans.count() == 1 and len(launches) == 3
    (config, args), (config_plan, args_plan), (config_full, args_full) = launches
    assert config == config_plan == config_full
    # the same arguments but q's address (the full path's contiguous copy) and the outputs' (new each call)
    for a in (args_plan, args_full):
        assert a[1:9] + a[11:] == args[1:9] + args[11:] and len(a) == len(args)
    assert args_plan[0] == args[0] == x[0].data_ptr() and args_full[0] != args[0]
    if op == "kda_decode":
        assert all(isinstance(r, torch.Tensor) and r.shape == x[2].shape for r in (*results, full))
    else:
        for o, out in (*results, full):
            assert o.shape == x[2].shape
            assert (out is None) == (op == "kda_decode_mtp" and not extra)


def test_a_changed_input_misses_the_plan_and_a_bad_one_is_refused_every_time(launches):
    x, kw = _inputs()
    cula.kda_decode_mtp(*x, **kw)
    cula.kda_decode_mtp(*x, **kw)
    assert plans.count() == 1 and len(launches) == 2
    # another g dtype: another plan, whose kernel reads fp32 g
    y, _ = _inputs(g_dtype=torch.float32)
    cula.kda_decode_mtp(*y, **kw)
    assert plans.count() == 2 and launches[-1][0] != launches[0][0]
    for _ in range(2):
        with pytest.raises(TypeError, match="cache_idx"):  # int64 slots: validated, refused
            cula.kda_decode_mtp(*x[:6], x[6].long(), **kw)
        with pytest.raises(ValueError, match="state_pool must be contiguous"):
            cula.kda_decode_mtp(*x[:5], x[5].transpose(-1, -2), x[6], **kw)
        with pytest.raises(ValueError):  # k of another head count than q
            cula.kda_decode_mtp(x[0], x[1][:, :, :1].contiguous(), *x[2:], **kw)
        with pytest.raises(ValueError, match="dt_bias"):
            cula.kda_decode_mtp(*x, **dict(kw, dt_bias=torch.rand(HV * K + 1)))
    assert plans.count() == 2 and len(launches) == 3


@pytest.mark.parametrize("op", ["kda_decode", "kda_decode_mtp_kvbuffer"])
def test_a_pool_at_an_odd_address_runs_the_reference(launches, op):
    x, kw = _inputs(T=1 if op == "kda_decode" else T)
    pool = x[5]
    storage = torch.empty(pool.numel() + 1)
    odd = storage[1:].view(pool.shape)  # contiguous, 4 bytes past a 16-byte boundary
    odd.copy_(pool)
    assert odd.data_ptr() % 16 == 4
    expected_pool = pool.clone()
    expected = getattr(reference_backend, op)(*x[:5], expected_pool, x[6], kw["A_log"], kw["dt_bias"], scale=K ** -0.5,
                                              lower_bound=None, use_qk_l2norm_in_kernel=True)
    for _ in range(2):  # the plan is made on the first call and runs on the second
        odd.copy_(pool)
        got = getattr(cula, op)(*x[:5], odd, x[6], **kw)
        assert plans.count() == 1 and not launches
        for a, b in zip((got,) if op == "kda_decode" else got, (expected,) if op == "kda_decode" else expected,
                        strict=True):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(odd, expected_pool)


def _fused(x, kw, pool=None, idx=None, q=None, **extra):
    """fused_recurrent_kda as a serving engine calls it: the pool in place through ssm_state_indices."""
    q_, k, v, g, beta, pool_, idx_ = x
    return cula.fused_recurrent_kda(q_ if q is None else q, k, v, g, beta, kw["A_log"], kw["dt_bias"],
                                    initial_state=pool_ if pool is None else pool, use_gate_in_kernel=True,
                                    use_qk_l2norm_in_kernel=True, ssm_state_indices=idx_ if idx is None else idx,
                                    **extra)


def test_fused_recurrent_pool_plan_launches_what_the_full_path_launches(launches):
    """A repeated pool call of fused_recurrent_kda (int32 slots, one per sequence) runs its plan's program: the
    same kernel and arguments as the full path, the pool returned and its version bumped."""
    x, kw = _inputs(N=6)
    pool = x[5]
    results = [_fused(x, kw) for _ in range(2)]  # makes the plan, then runs its program (the plan table)
    assert plans.count() == 1 and plan_table.count() == 1
    version = pool._version
    results.append(_fused(x, kw))
    assert pool._version > version
    full = _fused(x, kw, q=_strided(x[0]))  # a non-contiguous q: no signature, the full path
    assert plans.count() == 1 and len(launches) == 4
    (config, args), *rest = launches
    for c, a in rest:
        assert c == config and len(a) == len(args) and a[1:9] + a[11:] == args[1:9] + args[11:]
    assert [a[0] for _, a in launches[:3]] == [x[0].data_ptr()] * 3 and launches[3][1][0] != x[0].data_ptr()
    for o, state in (*results, full):
        assert o.shape == x[2].shape and state is pool


@pytest.mark.parametrize("variant", ["int64_slots", "accepted_counts"])
def test_fused_recurrent_pool_calls_without_a_program_run_their_python_plan(launches, variant):
    """int64 slots (converted each call) and num_accepted_tokens (the slot-table mode) have a plan but no program:
    the repeats launch what the full path launches."""
    n = 7 if variant == "int64_slots" else 4
    x, kw = _inputs(N=n)
    if variant == "int64_slots":
        extra, idx = {}, x[6].long()
    else:
        idx = torch.stack([x[6]] * T, dim=1).contiguous()  # a slot per token ([N, T]), read column from the counts
        idx[:, 1:] = -1
        extra = {"num_accepted_tokens": torch.ones(n, dtype=torch.int32)}
    for _ in range(2):
        _fused(x, kw, idx=idx, **extra)
    assert plans.count() == 1 and plan_table.count() == 0
    _fused(x, kw, idx=idx, q=_strided(x[0]), **extra)
    assert len(launches) == 3
    # the same arguments but q's, the outputs' and (int64 slots: an int32 copy each call) the slots' addresses
    same = [i for i in range(1, len(launches[0][1])) if i not in (9, 10) and (i != 8 or variant != "int64_slots")]
    (config, args), *rest = launches
    for c, a in rest:
        assert c == config and [a[i] for i in same] == [args[i] for i in same]


def test_fused_recurrent_pool_at_an_odd_address_runs_the_reference(launches):
    x, kw = _inputs()
    pool = x[5]
    storage = torch.empty(pool.numel() + 1)
    odd = storage[1:].view(pool.shape)
    expected_pool = pool.clone()
    expected, _ = reference_backend.fused_recurrent_kda(
        *x[:5], kw["A_log"], kw["dt_bias"], expected_pool, None, x[6], None, scale=K ** -0.5, output_final_state=False,
        use_qk_l2norm_in_kernel=True, gate="softplus", lower_bound=None, beta_activation="none")
    for _ in range(2):  # the plan is made on the first call and runs on the second
        odd.copy_(pool)
        o, state = _fused(x, kw, pool=odd)
        assert state is odd and plans.count() == 1 and not launches
        torch.testing.assert_close(o, expected)
        torch.testing.assert_close(odd, expected_pool)
