"""The response products of context parallelism across ranks (`cula_core.context_parallel`): `add_response`
(o += R S_in, the entering state's share of a first sequence's outputs) and `response_transpose` (R^T do, that
sequence's gradient with respect to the entering state), against fp64 products, over several token blocks
(RESPONSE_BLOCK made small). On the CPU the operands are converted to fp32 and multiplied in it; on a GPU, with
bf16 R and do, the products run as bf16 GEMMs with fp32 results (S split into bf16 high and low parts)."""

from __future__ import annotations

import pytest
import torch

from cula_core import context_parallel as cp

HV, K, V = 3, 16, 8


def _operands(T, dtype, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    R = torch.randn(T, HV, K, generator=gen).to(device, dtype)
    do = torch.randn(T, HV, V, generator=gen).to(device, dtype)
    S = torch.randn(HV, K, V, generator=gen).to(device)
    o = torch.randn(T, HV, V, generator=gen).to(device, dtype)
    return R, do, S, o


def _rel(x, ref) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37])
def test_add_response_adds_R_S_per_head_in_every_block(monkeypatch, dtype, T):
    monkeypatch.setattr(cp, "RESPONSE_BLOCK", 16)  # 37 tokens: blocks of 16, 16 and 5
    R, _, S, o = _operands(T, dtype)
    expect = o.double() + torch.einsum("thk,hkv->thv", R.double(), S.double())
    out = o.clone()
    cp.add_response(out, R, S)
    assert out.dtype == dtype and out.shape == o.shape
    # fp32: the product's rounding; bf16: one rounding of the sum to bf16 (half an ulp, 2^-9 relative)
    assert _rel(out, expect) <= (1e-6 if dtype == torch.float32 else 2 ** -8)


def test_add_response_leaves_other_rows_alone():
    R, _, S, o = _operands(10, torch.float32)
    whole = o.clone()
    cp.add_response(whole[3:7], R[3:7], S)
    assert torch.equal(whole[:3], o[:3]) and torch.equal(whole[7:], o[7:])
    assert not torch.equal(whole[3:7], o[3:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37])
def test_response_transpose_sums_R_t_do_over_every_block(monkeypatch, dtype, T):
    monkeypatch.setattr(cp, "RESPONSE_BLOCK", 16)
    R, do, _, _ = _operands(T, dtype)
    expect = torch.einsum("thk,thv->hkv", R.double(), do.double())
    e = cp.response_transpose(R, do)
    assert e.dtype == torch.float32 and e.shape == (HV, K, V)
    assert _rel(e, expect) <= 1e-6


def test_fp64_operands_stay_fp64():
    R, do, S, o = (t.double() for t in _operands(20, torch.float32))
    assert cp.response_transpose(R, do).dtype == torch.float64
    expect = o + torch.einsum("thk,hkv->thv", R, S)
    cp.add_response(o, R, S)
    assert _rel(o, expect) <= 1e-14


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_products_on_the_gpu_match_fp64(monkeypatch):
    """Tensor-core GEMMs: o + R S_in within two bf16 roundings (add_response's contract; 4.0e-3 measured against
    2.0e-3 for one rounding, H200), R^T do within fp32 accumulation (4.7e-6 measured)."""
    monkeypatch.setattr(cp, "RESPONSE_BLOCK", 4096)
    T, shape = 10000, (4, 128, 128)  # three blocks of tokens, K = V = 128
    gen = torch.Generator(device="cpu").manual_seed(1)
    R = torch.randn(T, shape[0], shape[1], generator=gen).cuda().bfloat16()
    do = torch.randn(T, shape[0], shape[2], generator=gen).cuda().bfloat16()
    S = torch.randn(*shape, generator=gen).cuda()
    o = torch.randn(T, shape[0], shape[2], generator=gen).cuda().bfloat16()
    expect = o.double() + torch.einsum("thk,hkv->thv", R.double(), S.double())
    out = o.clone()
    cp.add_response(out, R, S)
    assert _rel(out, expect) <= 2 ** -7
    e = cp.response_transpose(R, do)
    assert e.dtype == torch.float32
    assert _rel(e, torch.einsum("thk,thv->hkv", R.double(), do.double())) <= 1e-5
