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


def _inputs(T=T, g_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(N, T, HQK, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(N, T, HV, K, generator=gen).bfloat16()
    g = torch.randn(N, T, HV, K, generator=gen).to(g_dtype)
    beta = torch.rand(N, T, HV, generator=gen).bfloat16()
    pool = 0.1 * torch.randn(P, HV, K, K, generator=gen)
    idx = torch.tensor([4, -1, 0, 6, 2], dtype=torch.int32)
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
