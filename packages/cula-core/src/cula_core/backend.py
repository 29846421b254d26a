"""The contract between cula_core and an architecture package (cula-sm89, cula-sm90, cula-sm100).

An arch package exposes one `Backend` object under the entry-point group ``cula.backends``:

    [project.entry-points."cula.backends"]
    sm90 = "cula_sm90.backend:backend"

The module the entry point names must import fast and without touching CUDA: core loads it on the
first dispatch (never on `import cula`) and whenever `python -m cula info` runs on a machine with no GPU.
Kernels are imported lazily, from `Backend.kernel(op)`, once the backend has been chosen for a call.

Selection (see `cula_core.dispatch`) asks each loaded backend two questions:
  `runs_on(device)`            does it run on this device at all (compute capability),
  `unsupported_reason(call)`   does it serve this call's configuration; None when it does, else a
                               short human sentence ("sm90 serves K=V=128 only, got K=64") that the
                               fallback warning quotes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

import torch

# Public ops a backend may serve. The name is the op a call dispatches on; a backend lists the
# subset it implements in `Backend.ops`.
OPS: tuple[str, ...] = (
    "chunk_kda",  # training forward (saves what its backward needs)
    "chunk_kda_backward",
    "kda_prefill",  # inference forward, optional intra-card context parallel
    "kda_decode",
    "kda_decode_mtp",
    "kda_decode_mtp_kvbuffer",
    "kda_flush_kvbuffer",
    "kda_flush_kvbuffer_all_layers",
    "kda_prefill_chunk_states",  # inference forward that also returns the state at every chunk start
    "fused_recurrent_kda",  # token-by-token forward; with slot indices, over a state pool updated in place
)


# What a training forward may hand to a backward instead of having it recomputed (docs/backends.md, "Residuals"):
# the intra-chunk matrices of the chunked form, each [B, T, HV, RESIDUAL_CHUNK] in q's dtype, in FLA 0.6.0's layout
# (its `Aqk`, `Akk`: what FLA's forward saves by default). What they hold is named by a format tag: the forward's
# backend says which format it produces (`Backend.residual_format`), a backward's backend which formats it reads
# (`Backend.accepts_residuals`); core stores them and hands them over, never reads them.
CHUNK_KDA_RESIDUALS: tuple[str, ...] = ("Aqk", "Akk")
RESIDUAL_CHUNK = 64
# FLA 0.6.0's chunk-64 residuals, in token layout [B, T, HV, 64] (a chunk's rows are its tokens, column j its j-th
# token; every chunk starts at a sequence start or 64 tokens after the previous one), for the rows of each chunk up
# to its sequence's end:
#   Aqk[t, j] = scale q_t . k_j e^(G_t - G_j) for j <= t, 0 above (q, k L2-normalised if asked; G the natural-log
#               chunk-local cumulative gate)
#   Akk       = (I + L)^-1, unit lower triangular, 0 above, L[t, j] = beta_t k_t . k_j e^(G_t - G_j) for j < t
#               (no beta on the right: FLA's solve_tril output, whose w / u recompute multiplies by beta itself)
FLA_CHUNK64_RESIDUALS = "fla-0.6-chunk64"


@dataclass(frozen=True)
class DeviceInfo:
    """Where a call's tensors live: ``type`` is torch's device type ("cuda", "cpu", ...);
    ``capability`` is the CUDA compute capability (major, minor), None off CUDA."""

    type: str
    index: int | None = None
    capability: tuple[int, int] | None = None
    name: str = ""

    @staticmethod
    def of(device: torch.device) -> DeviceInfo:
        if device.type != "cuda":
            return DeviceInfo(type=device.type, index=device.index)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_device_info(index)

    def __str__(self) -> str:
        if self.capability is None:
            return self.type
        return f"{self.type}:{self.index} (sm_{self.capability[0]}{self.capability[1]}, {self.name})"


@functools.cache
def _cuda_device_info(index: int) -> DeviceInfo:
    # Cached: the properties of a device do not change in a process, and dispatch asks on every call.
    return DeviceInfo(
        type="cuda",
        index=index,
        capability=tuple(torch.cuda.get_device_capability(index)),
        name=torch.cuda.get_device_name(index),
    )


@dataclass(frozen=True)
class CallConfig:
    """The configuration of one op call that decides which code can serve it.

    Sizes follow FLA's layout: q/k `[B, T, HQK, K]`, v `[B, T, HV, V]`. ``T`` is the padded length per
    batch row (total tokens when varlen); for decode ops it is the number of tokens per step.
    ``gate`` is "precomputed" (g is the log decay), "softplus" or "safe" (computed in kernel from raw g).
    ``options`` holds op-specific switches (``intracard_cp``, ``use_qk_l2norm_in_kernel`` ...)."""

    op: str
    device: DeviceInfo
    dtype: torch.dtype
    K: int
    V: int
    HQK: int
    HV: int
    T: int = 0
    gate: str = "precomputed"
    varlen: bool = False
    requires_grad: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gva_ratio(self) -> int:
        return self.HV // self.HQK if self.HQK else 0


class Backend:
    """Base class of an architecture package's backend. Subclasses set the class attributes and
    override `unsupported_reason` and `kernel`; the defaults serve nothing."""

    name: str = ""  # "sm90": what CULA_BACKEND names and the warnings print
    package: str = ""  # distribution that ships it: "cula-sm90"
    arch: tuple[int, int] = (0, 0)  # the architecture it is built for: an exact match is preferred
    capabilities: tuple[tuple[int, int], ...] = ()  # every compute capability it runs on
    ops: tuple[str, ...] = ()  # the public ops it implements (for some configurations)
    # Kernels that compute element offsets in int32 set this: core then rejects tensors of 2**31 or more
    # elements with a ValueError before the kernel runs, instead of letting offsets wrap. A backend whose
    # kernel families differ overrides `indexes_in_int32` instead.
    int32_indexing: bool = False

    def indexes_in_int32(self, op: str) -> bool:
        """Whether the kernel of `op` computes element offsets in int32 (default: `int32_indexing`)."""
        return self.int32_indexing

    def runs_on(self, device: DeviceInfo) -> bool:
        return device.type == "cuda" and device.capability in self.capabilities

    def unsupported_reason(self, call: CallConfig) -> str | None:
        """None if this backend serves `call`, else why not (one short sentence)."""
        if call.op not in self.ops:
            return f"{self.name} does not implement {call.op}"
        return None

    def kernel(self, op: str) -> Callable[..., Any]:
        """The implementation of `op`, called with the validated arguments of the public op."""
        raise NotImplementedError(f"backend {self.name!r} has no kernel for {op}")

    def planned_kernel(self, op: str, args: tuple, **flags) -> Callable[..., Any]:
        """`kernel(op)` with the keyword arguments `flags` fixed, for the calls of one plan (cula_core.plans): each
        passes positional arguments with the types, shapes, dtypes and devices of `args` (contiguous tensors, the
        same ones None); only their values and addresses change. The default binds the flags; a backend may
        instead resolve here, once, what those decide (compiled kernels, launch tables, sizes), leaving each call
        only its per-call work. The returned callable may carry a `program` attribute (a
        cula_core.cute_runtime.plan_table.Program, or None): the same calls stated as allocations and launches,
        which the compiled plan table then runs without Python (docs/runtime.md)."""
        return functools.partial(self.kernel(op), **flags)

    def residual_format(self, call: CallConfig) -> str:
        """The format of the CHUNK_KDA_RESIDUALS this backend's `chunk_kda` kernel can return for `call` (a
        `chunk_kda` call with `requires_grad`), when asked with ``save_residuals=True``; "" when it returns none
        (the default). Core asks only if the backend of the matching backward accepts that format
        (docs/backends.md, "Residuals")."""
        return ""

    def accepts_residuals(self, call: CallConfig, fmt: str) -> bool:
        """Whether this backend's `chunk_kda_backward` kernel, for `call`, reads residuals of format `fmt` (given
        as ``residuals=(Aqk, Akk)``). Default: no, it recomputes what it needs from the inputs."""
        return False

    def serves_state_v_first(self, call: CallConfig) -> bool:
        """Whether this backend's kernel for `call` (whose ``options["state_v_first"]`` is True) indexes
        states laid out ``[..., V, K]`` itself. If so, core hands it the caller's V-first states and pools as
        they are, with the keyword ``state_v_first=True``; if not (the default), core hands it ``[..., K, V]``
        copies and transposes what it returns (docs/backends.md, "State layout")."""
        return False

    def describe(self) -> str:
        """One line for `python -m cula info`."""
        caps = ", ".join(f"sm_{a}{b}" for a, b in self.capabilities) or "no device"
        served = ", ".join(self.ops) or "no op yet"
        return f"runs on {caps}; serves {served}"

    def __repr__(self) -> str:
        return f"<cula backend {self.name} from {self.package}>"


class ComposedBackend(Backend):
    """A backend made of kernel families, each a module that owns some ops.

    A family module exports ``OPS`` (the ops it serves), ``unsupported_reason(call)`` and ``kernel(op)``,
    and optionally ``INT32_INDEXING`` (default: the backend's ``int32_indexing``), ``residual_format(call)``
    (default ""), ``accepts_residuals(call, fmt)`` and ``serves_state_v_first(call)`` (default: False). Subclasses set
    ``families``; the backend's ops are their union and each question goes to the family that owns the op.
    """

    families: tuple = ()

    def __init__(self) -> None:
        self.ops = tuple(op for fam in self.families for op in fam.OPS)

    def family(self, op: str):
        """The family module that owns `op`, or None."""
        for fam in self.families:
            if op in fam.OPS:
                return fam
        return None

    def indexes_in_int32(self, op: str) -> bool:
        fam = self.family(op)
        return fam is not None and getattr(fam, "INT32_INDEXING", self.int32_indexing)

    def unsupported_reason(self, call: CallConfig) -> str | None:
        fam = self.family(call.op)
        if fam is None:
            return f"{self.name} does not implement {call.op}"
        return fam.unsupported_reason(call)

    def kernel(self, op: str) -> Callable[..., Any]:
        fam = self.family(op)
        if fam is None:
            raise NotImplementedError(f"backend {self.name!r} has no kernel for {op}")
        return fam.kernel(op)

    def planned_kernel(self, op: str, args: tuple, **flags) -> Callable[..., Any]:
        fam = self.family(op)
        if fam is not None and hasattr(fam, "planned_kernel"):
            return fam.planned_kernel(op, args, **flags)
        return super().planned_kernel(op, args, **flags)

    def residual_format(self, call: CallConfig) -> str:
        fam = self.family(call.op)
        return (fam.residual_format(call) or "") if fam is not None and hasattr(fam, "residual_format") else ""

    def accepts_residuals(self, call: CallConfig, fmt: str) -> bool:
        fam = self.family(call.op)
        return fam is not None and hasattr(fam, "accepts_residuals") and bool(fam.accepts_residuals(call, fmt))

    def serves_state_v_first(self, call: CallConfig) -> bool:
        fam = self.family(call.op)
        return fam is not None and hasattr(fam, "serves_state_v_first") and bool(fam.serves_state_v_first(call))
