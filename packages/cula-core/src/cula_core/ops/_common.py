"""What the op modules share: building a call's configuration, choosing and running its backend, and
the conventions of the torch custom ops (an absent optional output travels as an empty tensor)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from cula_core import dispatch
from cula_core.backend import CallConfig, DeviceInfo
from cula_core.validation import check_int32_indexing

# torch custom ops cannot return None: an output the caller did not ask for is a 0-element tensor.
ABSENT = (0,)


def absent_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.new_empty(ABSENT, dtype=dtype or t.dtype)


def present(t: torch.Tensor | None) -> torch.Tensor | None:
    """Inverse of `absent_like`: None for the placeholder, the tensor otherwise."""
    return None if t is None or (t.numel() == 0 and t.dim() == 1) else t


def make_call(op: str, device: torch.device, *, dtype, K, V, HQK, HV, T, gate, varlen=False,
              requires_grad=False, **options) -> CallConfig:
    return CallConfig(op=op, device=DeviceInfo.of(device), dtype=dtype, K=K, V=V, HQK=HQK, HV=HV, T=T,
                      gate=gate, varlen=varlen, requires_grad=requires_grad, options=options)


def select(call: CallConfig, tensors: dict[str, torch.Tensor | None]):
    """The backend for `call` (`dispatch.select`), once `tensors` have passed its indexing limit."""
    backend = dispatch.select(call)
    if backend.indexes_in_int32(call.op):
        check_int32_indexing({n: t.numel() for n, t in tensors.items() if t is not None}, f"the {backend.name} kernels")
    return backend


def run(call: CallConfig, tensors: dict[str, torch.Tensor | None], *args, **kwargs):
    """Select the backend for `call`, apply its indexing limit to `tensors`, and run its kernel."""
    return select(call, tensors).kernel(call.op)(*args, **kwargs)


def _plain_tensors(args) -> bool:
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
                return False
    return True


def call_op(op, impl, *args, mutated: tuple = ()):
    """Run the custom op `op` (`torch.ops.cula.*`) on `args`, or, in plain eager mode, its implementation
    `impl` directly.

    The dispatcher round trip of a custom op costs tens of microseconds of host time per call (argument
    binding, the autograd and ADInplaceOrView layers), as much as a whole small decode step on the GPU.
    Serving loops call the decode ops eagerly and often, so there the implementation is called directly, and
    the mutated tensors' version counters are bumped as the op would. Whenever anything may be tracing
    (torch.compile, make_fx, functionalization, fake or other tensor subclasses, a dispatch mode), the call
    goes through the op, so graphs see one opaque node with its fake implementation."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or not _plain_tensors(args):
        return op(*args)
    out = impl(*args)
    for arg in mutated:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            torch.autograd.graph.increment_version(t)
    return out


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference computes in fp64 for fp64 inputs (gradcheck) and in fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fake_forward_outputs(q: torch.Tensor, v: torch.Tensor, cu_seqlens, output_final_state: bool):
    """Shapes of a forward's (o, final_state) for the fake ops of chunk_kda and kda_prefill: o like v; the
    state [N, HV, K, V] in the reference's state dtype (fp64 only for fp64 inputs), or the absent marker."""
    o = torch.empty_like(v)
    if not output_final_state:
        return o, absent_like(q, torch.float32)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=work_dtype(q.dtype))
