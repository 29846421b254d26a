"""The public ops on tensors of a device that is not the current one (two GPUs in one process, as a model spread
over GPUs runs): the results equal the same call made with that device current, and the current device is left as
it was. Needs two CUDA devices."""

from __future__ import annotations

import pytest
import torch

import cula

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

H, K = 4, 128


def _inputs(device, T=64, N=2, P=4):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=gen).to(device)

    return dict(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, K).bfloat16(),
                g=r(1, T, H, K).bfloat16(), beta=torch.rand(1, T, H, generator=gen).to(device).bfloat16(),
                A_log=r(H), dt_bias=r(H * K), pool=0.1 * r(P, H, K, K), idx=torch.tensor([3, 1], dtype=torch.int32,
                                                                                            device=device),
                dq=r(N, 1, H, K).bfloat16(), dk=r(N, 1, H, K).bfloat16(), dv=r(N, 1, H, K).bfloat16(),
                dg=r(N, 1, H, K).bfloat16(), dbeta=torch.rand(N, 1, H, generator=gen).to(device).bfloat16())


def _run(x):
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True)
    o_prefill, final = cula.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True,
                                        output_final_state=True, **gate)
    o_decode = cula.kda_decode(x["dq"], x["dk"], x["dv"], x["dg"], x["dbeta"], x["pool"], x["idx"], **gate)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o_train, _ = cula.chunk_kda(*leaves, use_gate_in_kernel=True, **gate)
    o_train.float().square().sum().backward()
    return [o_prefill, final, o_decode, x["pool"], o_train, *(t.grad for t in leaves)]


def test_ops_on_a_device_that_is_not_current_match_the_same_call_with_it_current():
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        expected = _run(_inputs("cuda:1"))
    got = _run(_inputs("cuda:1"))  # device 0 current
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert all(t.device == torch.device("cuda:1") for t in got)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
