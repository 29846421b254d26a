"""The sm90 backend as core sees it: the two kernel families composed into one backend, and the int32
indexing limit applied to the prefill kernels only (the decode kernels use 64-bit offsets, so a state pool
of 2**31 elements or more stays legal there)."""

from __future__ import annotations

import pytest
import torch

import cula_core
from cula_core.backend import CallConfig, DeviceInfo
from cula_sm90.backend import backend

H100 = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="H100")


def test_ops_are_the_union_of_the_families():
    assert set(backend.ops) == {"kda_prefill", "chunk_kda", "kda_decode", "kda_decode_mtp",
                                "kda_decode_mtp_kvbuffer", "kda_flush_kvbuffer", "kda_flush_kvbuffer_all_layers",
                                "fused_recurrent_kda"}
    call = CallConfig(op="chunk_kda_backward", device=H100, dtype=torch.bfloat16, K=128, V=128, HQK=4, HV=4)
    assert backend.unsupported_reason(call) == "sm90 does not implement chunk_kda_backward"


def test_int32_limit_applies_to_prefill_only():
    assert backend.indexes_in_int32("kda_prefill") and backend.indexes_in_int32("chunk_kda")
    assert not any(backend.indexes_in_int32(op) for op in backend.ops if op.startswith(("kda_decode", "kda_flush")))


def test_core_rejects_an_oversized_prefill_before_the_kernel(monkeypatch):
    monkeypatch.setattr("cula_core.validation.INT32_MAX", 1000)
    monkeypatch.setattr("cula_core.dispatch.select", lambda call: backend)
    monkeypatch.setattr(backend, "kernel", lambda op: pytest.fail("the kernel must not run"))
    T, K = 10, 128
    q, k, v, g = (torch.zeros(1, T, 1, K) for _ in range(4))  # q: 1280 elements > 1000
    with pytest.raises(ValueError, match="q has 1280 elements, more than the sm90 kernels can index"):
        cula_core.kda_prefill(q, k, v, g, torch.zeros(1, T, 1))
    # the same sizes are fine for a decode op (64-bit offsets): the kernel is reached
    pool = torch.zeros(1, 1, K, K)  # 16384 elements
    reached = []
    monkeypatch.setattr(backend, "kernel", lambda op: lambda *a, **kw: reached.append(op) or torch.zeros(1, 1, 1, K))
    cula_core.kda_decode(q[:, :1], k[:, :1], v[:, :1], g[:, :1], torch.zeros(1, 1, 1), pool,
                         torch.zeros(1, dtype=torch.int32), torch.zeros(1), torch.zeros(K))
    assert reached == ["kda_decode"]


def test_composition_routes_each_op_to_its_family(monkeypatch):
    from cula_sm90 import decode, prefill

    monkeypatch.setattr(decode, "kernel", lambda op: f"decode:{op}")
    monkeypatch.setattr(prefill, "kernel", lambda op: f"prefill:{op}")
    assert backend.kernel("kda_flush_kvbuffer") == "decode:kda_flush_kvbuffer"
    assert backend.kernel("kda_prefill") == "prefill:kda_prefill"
    with pytest.raises(NotImplementedError, match="backend 'sm90' has no kernel for chunk_kda_backward"):
        backend.kernel("chunk_kda_backward")
