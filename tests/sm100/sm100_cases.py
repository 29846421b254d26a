"""Helpers of the cula-sm100 tests: inputs, the fp32 reference with its intermediates, error measures, skips."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from cula_core.reference import chunk_kda_reference, l2norm

K = V = 128
BT = 64

# ||ours - ref|| / ||ref|| bounds against the fp32 reference fed the same bf16 inputs. Every kernel rounds its
# MMA operands to bf16 (2^-8 relative) as FLA 0.6.0 does; errors of a few roundings are ~5e-3.
TOL = {
    "g_cumsum": 1e-5,  # fp32 throughout, same summation order
    "Aqk": 1e-2, "Akk": 1e-2, "w": 1e-2, "u": 1e-2, "kg": 1e-2,
    "h": 2e-2, "v_new": 2e-2, "ht": 2e-2, "o": 2e-2,
}


def gpu_problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0) and cap[0] != 10:
        return f"cula-sm100 runs on compute capability 9.0 and 10.x, got {cap}"
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl not installed"
    return None


def require_gpu():
    problem = gpu_problem()
    if problem:
        pytest.skip(problem)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in fp64 (inf when ours holds a NaN or inf)."""
    a, b = ours.detach().double(), ref.detach().double().to(ours.device)
    assert a.shape == b.shape, (a.shape, b.shape)
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def seqlens_to_cu(lengths, device="cuda"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device), torch.tensor(cu, dtype=torch.int32)


def make_inputs(B, T, HQK, HV, *, seed=0, device="cuda", decay="mild", h0=False, N=None):
    """bf16 q, k (L2-normalised), v; fp32 log decay g; bf16 beta in (0, 1); optional fp32 initial state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32)

    q = l2norm(r(B, T, HQK, K)).to(torch.bfloat16)
    k = l2norm(r(B, T, HQK, K)).to(torch.bfloat16)
    v = r(B, T, HV, V).to(torch.bfloat16)
    if decay == "mild":
        g = F.logsigmoid(r(B, T, HV, K)) / 8
    elif decay == "strong":
        g = -5.0 * torch.sigmoid(r(B, T, HV, K) + 1.0)
    elif decay == "extreme":  # down to -30 per token: every diagonal block takes chunk_intra's exact fp32 path
        g = -30.0 * torch.rand(B, T, HV, K, generator=gen, device=device)
    else:
        raise ValueError(decay)
    beta = torch.sigmoid(r(B, T, HV)).to(torch.bfloat16)
    state = 0.1 * r(N if N is not None else B, HV, K, V) if h0 else None
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """(o, final state, ChunkIntermediates) of the fp32 reference on the same (bf16-valued) inputs."""
    f = [t.float() for t in (q, k, v, g, beta)]
    return chunk_kda_reference(*f, scale=scale, initial_state=initial_state, output_final_state=True,
                               cu_seqlens=cu_seqlens, return_intermediates=True)


def flat(x):
    """[B, T, H, D] -> [B T, H, D]; [B, NT, HV, K, V] -> [B NT, HV, K, V]."""
    return x.reshape(-1, *x.shape[2:])
