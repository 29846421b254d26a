"""Helpers of the cula-sm89 tests: inputs, the fp64 reference, error measures, and the skip conditions."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.nn.functional as F

from cula_core.reference import chunk_kda_reference, l2norm

# The bound every output must meet against the fp64 reference: ||ours - ref|| / ||ref||. The kernels multiply
# in 3xTF32 (fp32-accurate, ~1e-6 observed); plain tf32 would be ~3e-4 and fail it.
REL_TOL = 1e-4
CONFIGS = [(64, 32), (64, 64), (128, 32), (128, 64)]  # every instantiated (K = V, chunk size)


def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def extension_problem() -> str | None:
    from cula_sm89.backend import extension_error

    return extension_error()


def require_gpu():
    """Skip (with the reason) unless a CUDA device of compute capability >= 8.9 and the built extension exist."""
    if not cuda_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"cula-sm89 needs compute capability >= 8.9, got {torch.cuda.get_device_capability()}")
    problem = extension_problem()
    if problem:
        pytest.skip(problem)


def has_tool(name: str) -> bool:
    return shutil.which(name) is not None


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in fp64 (inf when ours holds a NaN or inf)."""
    a, b = ours.detach().double(), ref.detach().double().to(ours.device)
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def make_inputs(B, T, HQK, HV, K, *, seed=0, device="cuda", decay="mild"):
    """Prepared fp32 inputs in FLA layout: L2-normalised q, k; g a log decay; beta in (0, 1).

    decay: "mild" (logsigmoid / 8, long memory), "safe" (in (-5, 0): FLA's safe-gate range, where every
    16-token block stays under the kernel's decay-span limit) or "extreme" (down to -30 per token: the kernel's
    pairwise diagonal path)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32)

    q, k, v = l2norm(r(B, T, HQK, K)), l2norm(r(B, T, HQK, K)), r(B, T, HV, K)
    if decay == "mild":
        g = F.logsigmoid(r(B, T, HV, K)) / 8
    elif decay == "safe":
        g = -5.0 * torch.sigmoid(r(B, T, HV, K) + 1.0)
    elif decay == "extreme":
        g = -30.0 * torch.rand(B, T, HV, K, generator=gen, device=device)
    else:
        raise ValueError(decay)
    beta = torch.sigmoid(r(B, T, HV))
    return q, k, v, g, beta


def reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
              intermediates=False):
    """cula_core.reference in fp64 (on the inputs' device)."""
    d = torch.float64
    return chunk_kda_reference(q.to(d), k.to(d), v.to(d), g.to(d), beta.to(d), scale=scale,
                               initial_state=None if initial_state is None else initial_state.to(d),
                               output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                               return_intermediates=intermediates)


def chunk_rows(buf: torch.Tensor, T: int) -> torch.Tensor:
    """A [B, HV, NC, C, D] intra-chunk buffer of the fixed-length layout as [B, T, HV, D] token rows."""
    B, HV, NC, C, D = buf.shape
    return buf.permute(0, 2, 3, 1, 4).reshape(B, NC * C, HV, D)[:, :T]
