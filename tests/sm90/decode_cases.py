"""Helpers of the cula-sm90 decode tests: inputs, the fp64 reference (cula_core's reference kernels run on fp64
copies), error measures and the skip conditions."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from cula_core import reference_backend

# ||ours - ref|| / ||ref|| against the fp64 reference. The kernels compute in fp32 (fp32 rounding: ~1e-7 per
# operation, a few 1e-7 observed over 8 tokens); an fp32 output of a bf16 computation would be ~1e-3.
REL_TOL = 2e-5
# outputs stored in bf16 carry bf16 rounding (2^-8 relative per element)
REL_TOL_BF16_OUT = 8e-3
LOWER_BOUND = -5.0


def require_sm90():
    """Skip (with the reason) unless a Hopper GPU and the CuTe DSL are here."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"cula-sm90 decode needs compute capability 9.0, got {torch.cuda.get_device_capability()}")
    try:
        import cutlass  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"nvidia-cutlass-dsl not importable: {exc}")


@contextlib.contextmanager
def backend(name: str = "sm90"):
    """Force a backend (CULA_BACKEND) for the calls inside: a test must not pass on the reference."""
    old = os.environ.get("CULA_BACKEND")
    os.environ["CULA_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["CULA_BACKEND"]
        else:
            os.environ["CULA_BACKEND"] = old


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in fp64 (inf when ours holds a NaN or inf; the absolute error if ref is 0)."""
    a, b = ours.detach().double(), ref.detach().double().to(ours.device)
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def make_case(N, T, HQK, HV, K=128, V=128, *, dtype=torch.float32, safe=False, padded=True, out_of_range=False,
              A_log=True, dt_bias=True, seed=0, device="cuda", extra_slots=3):
    """Inputs of a decode call as a dict of keyword arguments of the public ops (raw g, post-sigmoid beta,
    unnormalised q/k for the in-kernel L2 norm), with a pool of N + extra_slots slots. With `padded`, every
    third request (from the second on) is a padded slot (-1); with `out_of_range`, the last request's slot
    is P (must be skipped as well: kernels must not trust validation)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device)

    P = N + extra_slots
    cache_idx = torch.randperm(P, generator=gen)[:N].to(torch.int32)
    if padded:
        cache_idx[1::3] = -1
    if out_of_range and N > 1:
        cache_idx[-1] = P
    kw = dict(q=r(N, T, HQK, K).to(dtype), k=r(N, T, HQK, K).to(dtype), v=r(N, T, HV, V).to(dtype),
              g=r(N, T, HV, K).to(dtype), beta=torch.sigmoid(r(N, T, HV)).to(dtype),
              state_pool=r(P, HV, K, V, scale=0.1).contiguous(), cache_idx=cache_idx.to(device),
              A_log=torch.log(torch.rand(HV, generator=gen) * 15 + 1).to(device) if A_log else None,
              dt_bias=r(HV * K, scale=0.5) if dt_bias else None,
              lower_bound=LOWER_BOUND if safe else None, use_qk_l2norm_in_kernel=True)
    return kw


def reference_args(kw):
    """The reference kernels' positional arguments and flags, on fp64 copies (pool copied: never aliased)."""
    d = lambda t: None if t is None else t.double()
    idx = kw["cache_idx"].clone()
    P = kw["state_pool"].shape[0]
    idx[idx >= P] = -1  # the reference rejects out-of-range slots; the kernels skip them like padded ones
    args = (d(kw["q"]), d(kw["k"]), d(kw["v"]), d(kw["g"]), d(kw["beta"]), kw["state_pool"].double().clone(), idx,
            d(kw["A_log"]), d(kw["dt_bias"]))
    flags = dict(scale=kw["q"].shape[-1] ** -0.5, lower_bound=kw["lower_bound"],
                 use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"])
    return args, flags


def reference_mtp(kw):
    """(o, per-token states) of the fp64 reference; padded and out-of-range slots give zeros."""
    args, flags = reference_args(kw)
    return reference_backend.kda_decode_mtp(*args, **flags, output_per_token_states=True)


def reference_kvbuffer(kw):
    args, flags = reference_args(kw)
    return reference_backend.kda_decode_mtp_kvbuffer(*args, **flags)


def live_rows(kw) -> torch.Tensor:
    idx = kw["cache_idx"]
    return ((idx >= 0) & (idx < kw["state_pool"].shape[0])).nonzero().squeeze(1)


def kernel_call(op: str, kw, **flags):
    """Run the sm90 kernel of `op` directly (the calling convention of docs/backends.md, no validation, no backend
    selection): for configurations the backend does not serve yet (K = V = 64), and to name the kernel that runs
    (`flags` tiling= / verify_variant=, the keywords of cula_sm90.decode.ops; otherwise the dispatch table picks).
    The pool keywords of `kw` (state_v_first, null_slot) go with the call."""
    from cula_sm90.decode.ops import KERNELS

    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["state_pool"], kw["cache_idx"], kw["A_log"],
            kw["dt_bias"])
    pool_kw = {name: kw[name] for name in ("state_v_first", "null_slot") if name in kw}
    return KERNELS[op](*args, scale=kw["q"].shape[-1] ** -0.5, lower_bound=kw["lower_bound"],
                       use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"], **pool_kw, **flags)


def serving_pool(kw, dtype=torch.float32, v_first=False, null_slot=None):
    """`kw` with its pool in a serving engine's form: `dtype` (fp32 or bf16), V-first ([P, HV, V, K]) or not, and,
    with a null slot, every padded request pointed at it (the keyword added to `kw`)."""
    kw = dict(kw)
    pool = kw["state_pool"].to(dtype)
    kw["state_pool"] = pool.transpose(-1, -2).contiguous() if v_first else pool
    if v_first:
        kw["state_v_first"] = True
    if null_slot is not None:
        idx = kw["cache_idx"].clone()
        live = (idx >= 0) & (idx < pool.shape[0])
        assert not (live & (idx == null_slot)).any(), "make_case left the null slot to a live request"
        idx[~live] = null_slot
        kw["cache_idx"], kw["null_slot"] = idx, null_slot
    return kw
