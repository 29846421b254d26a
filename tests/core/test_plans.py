"""cula_core.plans on the CPU: which calls get a signature (none of these do: plans are for eager CUDA calls),
how keys tell scalar types apart, and that reloading the backends or resetting the fallback warnings forgets
every plan. The plans' use by the ops is checked on a GPU (test_plans_gpu.py)."""

import os

import pytest
import torch

from cula_core import dispatch, plans, registry


def _tensors():
    return (torch.zeros(2, 3), None, torch.ones(4, dtype=torch.int32))


def test_no_signature_for_host_tensors():
    assert plans.signature("kda_decode", _tensors(), (None, 1.0)) is None


def test_no_signature_for_subclasses_and_unhashable_scalars(monkeypatch):
    class Sub(torch.Tensor):
        pass

    sub = torch.zeros(2).as_subclass(Sub)
    assert plans.signature("op", (sub,), ()) is None
    # a list (or any other type) among the scalars is not keyed: the call takes the full path and its checks
    assert plans.signature("op", (), ([1, 2],)) is None
    assert plans.signature("op", (), (torch.tensor(1.0),)) is None


def test_host_tensors_keyed_through_the_profiling_seam_keep_every_other_rule(monkeypatch):
    """plans.MIN_DEVICE = -1 (tools/bench/host_stub.py) keys host tensors; a non-contiguous view, a subclass and an
    unkeyable scalar still get no key, and a tensor in another position (the key is flat) gets another key."""
    monkeypatch.setattr(plans, "MIN_DEVICE", -1)
    t = torch.zeros(2, 3)
    key = plans.signature("op", (t, None), (1.0,))
    assert key is not None and key == plans.signature("op", (torch.ones(2, 3), None), (1.0,))
    assert plans.signature("op", (None, t), (1.0,)) != key
    assert plans.signature("op", (t, t), (1.0,)) != key
    assert plans.signature("op", (t.half(), None), (1.0,)) != key
    assert plans.signature("op", (torch.zeros(3, 2), None), (1.0,)) != key
    assert plans.signature("op", (torch.zeros(3, 2).t(), None), (1.0,)) is None
    assert plans.signature("op", (t.as_subclass(type("Sub", (torch.Tensor,), {})), None), (1.0,)) is None
    assert plans.signature("op", (t, None), ([1.0],)) is None


def test_a_rejected_scalar_type_stays_rejected():
    """The accepted tuples of scalar types are remembered (a set lookup per call): a tuple with another type is still
    checked and rejected, however often accepted ones were seen."""
    class Flag(int):
        pass

    for _ in range(3):
        assert plans.signature("op", (), (True, 1.0, None, "auto")) is not None
        assert plans.signature("op", (), (Flag(1), 1.0, None, "auto")) is None
        assert plans.signature("op", (), (True, 1.0, None, b"auto")) is None


def test_value_checks_on_the_device_disable_plans(monkeypatch):
    monkeypatch.setenv("CULA_CHECK_DEVICE_VALUES", "1")
    assert plans.signature("op", (), (1.0,)) is None
    monkeypatch.setenv("CULA_CHECK_DEVICE_VALUES", "0")
    assert plans.signature("op", (), (1.0,)) is not None


def test_keys_tell_types_and_environment_apart(monkeypatch):
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.delenv("CULA_STRICT", raising=False)
    one_int, one_float, true = (plans.signature("op", (), (s,)) for s in (1, 1.0, True))
    assert len({one_int, one_float, true}) == 3  # 1 == 1.0 == True, but a bool scale must still be rejected
    monkeypatch.setenv("CULA_BACKEND", "reference")
    assert plans.signature("op", (), (1,)) != one_int
    monkeypatch.delenv("CULA_BACKEND")
    monkeypatch.setenv("CULA_STRICT", "1")
    assert plans.signature("op", (), (1,)) != one_int
    monkeypatch.delenv("CULA_STRICT")
    assert plans.signature("op", (), (1,)) == one_int


def test_keys_follow_os_environ_between_calls(monkeypatch):
    """Assignments, updates and deletions through os.environ between two calls reach the next key (the reader
    reads os.environ's own storage): no stale plan runs."""
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    unset = plans.signature("op", (), (1,))
    monkeypatch.setenv("CULA_BACKEND", "sm90")  # restores the variable after the test
    sm90 = plans.signature("op", (), (1,))
    os.environ["CULA_BACKEND"] = "reference"
    reference = plans.signature("op", (), (1,))
    assert len({unset, sm90, reference}) == 3
    os.environ.update(CULA_BACKEND="sm90")
    assert plans.signature("op", (), (1,)) == sm90
    del os.environ["CULA_BACKEND"]
    assert plans.signature("op", (), (1,)) == unset
    os.environ["CULA_CHECK_DEVICE_VALUES"] = "1"
    try:
        assert plans.signature("op", (), (1,)) is None
    finally:
        del os.environ["CULA_CHECK_DEVICE_VALUES"]
    assert plans.signature("op", (), (1,)) == unset


def test_reload_and_warning_reset_forget_plans():
    plans.remember(("test", 1), lambda: None)
    assert plans.lookup(("test", 1)) is not None
    registry.reload()
    assert plans.lookup(("test", 1)) is None and plans.count() == 0
    plans.remember(("test", 2), lambda: None)
    dispatch.reset_fallback_warnings()
    assert plans.lookup(("test", 2)) is None


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 8)
    plans.forget()
    for i in range(20):
        plans.remember(("bounded", i), lambda: None)
    assert plans.count() <= 8
    assert plans.lookup(("bounded", 19)) is not None  # the newest survive
    plans.forget()


@pytest.mark.parametrize("op", ["kda_decode", "kda_prefill"])
def test_cpu_calls_make_no_plan(op):
    import cula

    plans.forget()
    q = torch.randn(1, 1, 2, 8)
    if op == "kda_decode":
        pool = torch.zeros(2, 2, 8, 8)
        cula.kda_decode(q, q.clone(), q.clone(), q.clone(), torch.rand(1, 1, 2), pool,
                        torch.zeros(1, dtype=torch.int32), A_log=torch.zeros(2))
    else:
        cula.kda_prefill(q, q.clone(), q.clone(), -torch.rand(1, 1, 2, 8), torch.rand(1, 1, 2))
    assert plans.count() == 0
