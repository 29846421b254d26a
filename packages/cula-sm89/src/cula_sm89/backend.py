"""The sm89 backend object that cula_core discovers through the `cula.backends` entry point.

It serves `kda_prefill`, and the forward of `chunk_kda` when no gradient is needed (the kernels save nothing for
a backward; a call with `requires_grad` goes to a backend or the reference that has one), for float32 q/k/v
with K == V in (64, 128), on compute capability 8.9 and newer: the extension is built as sm_89 and sm_90 SASS
plus compute_89 PTX, which later GPUs JIT-compile. Every gate mode, GVA (HV a multiple of HQK), varlen
(`cu_seqlens`), initial and final states, q/k L2 normalisation and the beta activations are served; the
element-wise preprocessing runs in `cula_sm89.ops` (see there).

Importing this module loads neither the extension nor CUDA: `kernel()` imports `cula_sm89.ops` (and through it
the compiled `cula_sm89._C`) once the backend has been chosen, and `unsupported_reason` only looks for the
compiled module (and loads it, once) when asked about a call, which dispatch does only for CUDA tensors on a
device this backend runs on. A source checkout without a build declines every call with the reason, so
dispatch falls back to the reference instead of failing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from cula_core.backend import Backend, CallConfig

HEAD_DIMS = (64, 128)


@functools.lru_cache(maxsize=1)
def extension_error() -> str | None:
    """None when the compiled module cula_sm89._C is present and loads, else why not (one short clause)."""
    try:
        spec = importlib.util.find_spec("cula_sm89._C")
    except (ImportError, ValueError) as exc:  # pragma: no cover - broken installation
        return f"cula-sm89 extension not built: {exc}"
    if spec is None:
        return ("cula-sm89 extension not built: no compiled cula_sm89._C (install the wheel, or build a source "
                "checkout with `pip install --no-build-isolation -e packages/cula-sm89`, which needs nvcc)")
    try:
        importlib.import_module("cula_sm89._C")
    except ImportError as exc:
        return f"cula-sm89 extension failed to load: {exc}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Sm89Backend(Backend):
    name = "sm89"
    package = "cula-sm89"
    arch = (8, 9)
    # Built as sm_89 and sm_90 SASS plus compute_89 PTX, so it runs on Ada, Hopper and later chips.
    capabilities = ((8, 9), (9, 0), (10, 0), (10, 3), (12, 0))
    ops = ("kda_prefill", "chunk_kda")
    int32_indexing = False  # element offsets are 64-bit

    def unsupported_reason(self, call: CallConfig) -> str | None:
        if call.op not in self.ops:
            return f"sm89 does not implement {call.op}"
        if call.op == "chunk_kda" and call.requires_grad:
            return "sm89 serves chunk_kda without autograd only (an input requires grad)"
        if call.dtype != torch.float32:
            return f"sm89 serves fp32 only, got {_dtype_name(call.dtype)}"
        if call.K != call.V or call.K not in HEAD_DIMS:
            return f"sm89 serves K=V in (64, 128), got K={call.K}, V={call.V}"
        return extension_error()

    def kernel(self, op: str):
        if op not in self.ops:
            raise NotImplementedError(f"backend {self.name!r} has no kernel for {op}")
        from cula_sm89 import ops

        return getattr(ops, op)

    def describe(self) -> str:
        caps = ", ".join(f"sm_{a}{b}" for a, b in self.capabilities)
        return f"runs on {caps}; serves kda_prefill and chunk_kda (no autograd): fp32, K=V in (64, 128)"


backend = Sm89Backend()
