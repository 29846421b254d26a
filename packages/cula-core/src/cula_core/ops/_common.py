"""What the op modules share: building a call's configuration, choosing and running its backend, and
the conventions of the torch custom ops (an absent optional output travels as an empty tensor)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from cula_core import dispatch
from cula_core.backend import CallConfig, DeviceInfo
from cula_core.reference_backend import work_dtype
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


def select(call: CallConfig, tensors: dict[str, torch.Tensor | int | None]):
    """The backend for `call` (`dispatch.select`), once `tensors` (tensors, or element counts of tensors the
    kernel will create, such as a final state) have passed its indexing limit."""
    backend = dispatch.select(call)
    if backend.indexes_in_int32(call.op):
        sizes = {n: t if isinstance(t, int) else t.numel() for n, t in tensors.items() if t is not None}
        check_int32_indexing(sizes, f"the {backend.name} kernels")
    return backend


def run(call: CallConfig, tensors: dict[str, torch.Tensor | int | None], *args, **kwargs):
    """Select the backend for `call`, apply its indexing limit to `tensors`, and run its kernel."""
    return select(call, tensors).kernel(call.op)(*args, **kwargs)


def _plain_tensors(args) -> bool:
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
                return False
    return True


def eager(args) -> bool:
    """Whether a call on `args` is plainly eager: nothing traces (torch.compile, make_fx, functionalization, a
    dispatch mode) and every tensor is a plain torch.Tensor or Parameter. Such a call may run an op's implementation
    directly (`call_op`); anything else goes through the torch custom op, which tracers see as one node."""
    return not (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or not _plain_tensors(args))


def call_op(op, impl, *args, mutated: tuple = ()):
    """Run the custom op `op` (`torch.ops.cula.*`) on `args`, or, in plain eager mode, its implementation
    `impl` directly.

    The dispatcher round trip of a custom op costs tens of microseconds of host time per call (argument
    binding, the autograd and ADInplaceOrView layers), as much as a whole small decode step on the GPU.
    Serving loops call the decode ops eagerly and often, so there the implementation is called directly, and
    the mutated tensors' version counters are bumped as the op would. Whenever anything may be tracing
    (torch.compile, make_fx, functionalization, fake or other tensor subclasses, a dispatch mode), the call
    goes through the op, so graphs see one opaque node with its fake implementation."""
    if not eager(args):
        return op(*args)
    out = impl(*args)
    for arg in mutated:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            torch.autograd.graph.increment_version(t)
    return out


def state_shape(N: int, HV: int, K: int, V: int, state_v_first: bool) -> tuple[int, int, int, int]:
    """A state's shape in FLA's layout: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with state_v_first."""
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def fake_forward_outputs(q: torch.Tensor, v: torch.Tensor, cu_seqlens, output_final_state: bool,
                         state_v_first: bool = False):
    """Shapes of a forward's (o, final_state) for the fake ops of chunk_kda and kda_prefill: o like v; the
    state [N, HV, K, V] ([N, HV, V, K] V-first) in the reference's state dtype (fp64 only for fp64 inputs), or
    the absent marker."""
    o = torch.empty_like(v)
    if not output_final_state:
        return o, absent_like(q, torch.float32)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty(state_shape(N, v.shape[2], q.shape[3], v.shape[3], state_v_first),
                          dtype=work_dtype(q.dtype))


# --- state layout: V-first states reach a kernel as they are only where its backend indexes them (see
# Backend.serves_state_v_first); elsewhere core hands the kernel [..., K, V] copies and transposes back.


def native_v_first(backend, call: CallConfig) -> bool:
    """Whether `backend`'s kernel takes `call`'s V-first states as they are."""
    return bool(call.options.get("state_v_first")) and backend.serves_state_v_first(call)


def layout_kwargs(native: bool) -> dict:
    """The keyword a kernel gets when it indexes V-first states itself (none otherwise: K-first convention)."""
    return {"state_v_first": True} if native else {}


def swap_state_layout(state: torch.Tensor | None) -> torch.Tensor | None:
    """``[..., K, V]`` <-> ``[..., V, K]`` as a new contiguous tensor (None stays None)."""
    return None if state is None else state.transpose(-1, -2).contiguous()


def unaliased(out: torch.Tensor | None, *inputs: torch.Tensor | None) -> torch.Tensor | None:
    """`out`, or a copy of it where it shares memory with one of `inputs`: a custom op may not return
    (a view of) an input, and a caller must be able to change an output without changing its input."""
    if out is None or out.numel() == 0:
        return out
    ptr = out.untyped_storage().data_ptr()
    for t in inputs:
        if t is not None and t.numel() and t.untyped_storage().data_ptr() == ptr:
            return out.clone()
    return out
