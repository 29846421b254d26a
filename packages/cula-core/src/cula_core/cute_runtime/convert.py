"""Argument conversion between torch and cula's CuTe DSL kernels, in one place.

At compile time a kernel's pointer arguments are DSL pointers (`fake_ptr`: element type and assumed alignment,
any address) and its stream a placeholder (`fake_stream`). At launch the TVM-FFI function takes a pointer as its
integer address (`data_ptr`), Int32 / Int64 / Float32 scalars as Python ints and floats, and the stream as its raw
handle (`current_stream`). Nothing here reads a device tensor (no host synchronisation).
"""

from __future__ import annotations

import functools

import torch

#: the address passed for an absent optional tensor: never dereferenced by a kernel (its compile-time flag says the
#: tensor is absent), but 16-byte aligned like every real argument
DUMMY_ADDRESS = 16

_DSL_DTYPES: dict = {}
# the current stream's raw handle without building a torch.cuda.Stream object (CUDA builds of torch have it)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# the current device's index without torch.cuda.current_device's Python-level lazy-init check (the C function
# initialises CUDA itself where needed)
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def dsl_dtype(dtype: torch.dtype):
    """The CuTe DSL numeric type of a torch dtype (imports the DSL)."""
    if not _DSL_DTYPES:
        import cutlass

        _DSL_DTYPES.update({torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16,
                            torch.float16: cutlass.Float16, torch.float64: cutlass.Float64,
                            torch.int32: cutlass.Int32, torch.int64: cutlass.Int64})
    try:
        return _DSL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"no CuTe DSL type for torch dtype {dtype}") from None


def fake_ptr(dtype: torch.dtype, align: int | None = 16):
    """A compile-time stand-in for a pointer argument: element type `dtype`, `align` bytes assumed (None: the
    element size). Its address is irrelevant."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dsl_dtype(dtype), 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def fake_stream():
    """A compile-time stand-in for the stream argument (only its type matters; no GPU needed)."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)


def current_device() -> int:
    """The index of the current CUDA device (-1 in a torch without CUDA)."""
    return -1 if _CURRENT_DEVICE is None else _CURRENT_DEVICE()


def current_stream(device: torch.device | int | None = None) -> int:
    """The raw handle of torch's current CUDA stream on `device` (None: the current device)."""
    if _RAW_STREAM is not None and _CURRENT_DEVICE is not None:
        if device is None:
            index = _CURRENT_DEVICE()
        else:
            index = device if isinstance(device, int) else (device.index if device.index is not None
                                                            else _CURRENT_DEVICE())
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(device).cuda_stream


def device_int32(values, device) -> torch.Tensor:
    """`values` (a list of ints or a host tensor) as an int32 tensor on `device`, copied from pinned memory where
    the device is a GPU: a copy from pageable memory first waits for the stream (CUDA's rule for pageable
    host-to-device copies), leaving the GPU idle while the host queues the next kernels."""
    host = torch.as_tensor(values, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def data_ptr(t: torch.Tensor | None) -> int:
    """The address a kernel takes for `t`; DUMMY_ADDRESS for an absent optional tensor."""
    return DUMMY_ADDRESS if t is None else t.data_ptr()


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (read once per device): what persistent grids and the CP
    planner size themselves by."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def aligned16(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`, or a copy of it when its data is not 16-byte aligned (a view at an odd offset into a larger buffer):
    the kernels load 16-byte vectors from pointers declared 16-byte aligned. None passes."""
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()
