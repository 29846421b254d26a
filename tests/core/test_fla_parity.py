"""The reference path of `chunk_kda` against FLA 0.6.0's `fla.ops.kda.chunk_kda` on the same inputs
(GPU machine, where FLA is installed). Run: `pytest -m gpu tests/core/test_fla_parity.py`."""

from __future__ import annotations

import pytest
import torch

import cula_core

pytestmark = pytest.mark.gpu

fla_kda = pytest.importorskip("fla.ops.kda", reason="FLA 0.6.0 is installed on the GPU machine only")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def inputs(T, HQK, HV, K, seed, varlen):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q, k, v = (r(1, T, HQK, K).bfloat16(), r(1, T, HQK, K).bfloat16(), r(1, T, HV, K).bfloat16())
    g = r(1, T, HV, K)
    beta = torch.rand(1, T, HV, generator=gen, device="cuda").bfloat16()
    A_log, dt_bias = r(HV) * 0.3, r(HV * K) * 0.1
    N = 3 if varlen else 1
    h0 = r(N, HV, K, K) * 0.1
    cu = torch.tensor([0, T // 3, T // 3, T], dtype=torch.int32, device="cuda") if varlen else None
    return q, k, v, g, beta, A_log, dt_bias, h0, cu


@pytest.mark.parametrize("T,HQK,HV,varlen,lower_bound", [
    (100, 2, 2, False, None), (300, 2, 4, False, -5.0), (257, 1, 2, True, -5.0), (64, 4, 4, True, None),
])
def test_reference_matches_fla(T, HQK, HV, varlen, lower_bound):
    K = 64
    q, k, v, g, beta, A_log, dt_bias, h0, cu = inputs(T, HQK, HV, K, seed=T, varlen=varlen)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, safe_gate=lower_bound is not None, lower_bound=lower_bound,
              cu_seqlens=cu)
    o_fla, ht_fla = fla_kda.chunk_kda(q, k, v, g, beta, cu_seqlens_cpu=None if cu is None else cu.cpu(), **kw)
    o, ht = cula_core.chunk_kda(q, k, v, g, beta, **kw, cu_seqlens_cpu=None if cu is None else cu.cpu(),
                                )
    # The reference runs in fp32 from the same bf16 inputs; FLA's kernels keep bf16 intermediates:
    # agreement to bf16 rounding of the outputs, relative to their scale.
    o_err = (o.float() - o_fla.float()).abs().max() / o_fla.float().abs().max()
    ht_err = (ht - ht_fla).abs().max() / ht_fla.abs().max()
    assert o_err < 2e-2, o_err
    assert ht_err < 2e-2, ht_err
