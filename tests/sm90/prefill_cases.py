"""Helpers of the cula-sm90 prefill tests: inputs in FLA's layout, the fp64 reference, FLA, error measures,
the skip conditions, and the stated bounds."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# ||ours - ref|| / ||ref|| against cula_core.reference in fp64. The kernels accumulate in fp32 but hand
# w, u, qg, kg and Aqk from stage 1 to stage 2 in bf16 (as FLA does), and o is bf16: ~3e-3 is typical.
REL_TOL = 1e-2
# against FLA 0.6.0 on the same inputs (both carry bf16 roundings of their own)
FLA_TOL = 2e-2
# CP on vs off: the same kernels with a different order of operations on the state (maps, scan). The state's
# products carry ~16 bits (split bf16 hi + lo operands, fp32 accumulation), so the fp32 final states may differ
# by a few 1e-5 relative; o is bf16, where such a difference flips the rounding of a few elements by 1 ulp.
CP_TOL_STATE = 5e-4
CP_TOL_O = 2e-3


def require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"cula-sm90 runs on compute capability 9.0, got {torch.cuda.get_device_capability()}")
    try:
        import cutlass  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"CuTe DSL missing: {exc}")


@functools.cache
def fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in fp64 (inf when ours holds a NaN or inf)."""
    a, b = ours.detach().double(), ref.detach().double().to(ours.device)
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def make_raw(B, T, HQK, HV, *, gate, seed=0, K=128, device="cuda", dtype=torch.bfloat16):
    """Raw inputs as a model feeds kda_prefill: un-normalised q/k (the kernel normalises), v, g (raw for the
    softplus/safe gates; a log decay for `precomputed`), beta pre-sigmoid, and the gate parameters."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32)

    q, k, v = r(B, T, HQK, K).to(dtype), r(B, T, HQK, K).to(dtype), r(B, T, HV, K).to(dtype)
    if gate == "precomputed":
        g = (F.logsigmoid(r(B, T, HV, K)) / 4).to(dtype)
    else:
        g = r(B, T, HV, K).to(dtype)
    beta = r(B, T, HV).to(dtype)
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * r(HV * K)
    return q, k, v, g, beta, A_log, dt_bias


def gate_kwargs(gate, A_log, dt_bias):
    if gate == "precomputed":
        return {}
    kw = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
    if gate == "safe":
        kw.update(safe_gate=True, lower_bound=-5.0)
    return kw


def reference(q, k, v, g, beta, *, gate_kw, initial_state=None, cu_seqlens=None):
    """cula_core's reference backend in fp64 (sigmoid beta, in-kernel L2 norm, the gate)."""
    from cula_core import reference_backend as R

    gate = "precomputed" if not gate_kw else ("safe" if "lower_bound" in gate_kw else "softplus")
    d = torch.float64
    f = (lambda t: None if t is None else t.to(d))
    o, ht = R.chunk_kda(f(q), f(k), f(v), f(g), torch.sigmoid(beta.to(d)), f(gate_kw.get("A_log")),
                        f(gate_kw.get("dt_bias")), f(initial_state), cu_seqlens, None, scale=q.shape[-1] ** -0.5,
                        output_final_state=True, use_qk_l2norm_in_kernel=True, gate=gate,
                        lower_bound=gate_kw.get("lower_bound"), beta_activation="none")
    return o, ht


def run_memcheck(script: Path) -> subprocess.CompletedProcess:
    """`script` (a case file beside these helpers) under compute-sanitizer memcheck. Failing driver-API calls are
    not reported: CuTe DSL probes device attributes with calls that may fail by design (the first run reported 34
    such errors, all at the first call's host frames). Every memory access of every kernel launch is still checked."""
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", "--leak-check", "no",
                           "--report-api-errors", "no", sys.executable, str(script)],
                          capture_output=True, text=True, env=env, timeout=900)
