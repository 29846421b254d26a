"""cula-sm100's side of cula_core.cute_runtime: its kernels registered once per arch, launched for the current
device's arch.

The kernels multiply with warp-level mma.sync only, so the same source compiles for Hopper and Blackwell. A
compiled kernel holds code for one arch (the DSL's arch-specific targets, sm_XYa, do not run on another), and the
runtime keys a kernel definition by one arch, so each kernel is registered under one name per arch in ARCHS:
`kernel_name(name, arch)` = "<name>@<arch>" (e.g. "sm100.forward.l2norm@sm_90a"). Its cache folder, its shipped
artifact and its compile target then follow the arch, and a wheel may ship several arches side by side.

A kernel of the launch code is identified by `(name, config)` (`Kernel`): the arch-free name and the
compile-time configuration. `launch` resolves it for the current CUDA device's arch (`device_arch`: compute
capability (major, minor) -> "sm_<major><minor>a", the target the DSL picks for a device itself) and calls the
TVM-FFI function with integer addresses, the Int32 / Float32 scalars as Python ints / floats and the raw handle of
torch's current stream. Nothing here reads a device tensor; importing this module imports no CuTe DSL.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

from cula_core import cute_runtime as rt

DISTRIBUTION, PACKAGE = "cula-sm100", "cula_sm100"
#: the compile targets: Hopper (training), Blackwell B200 / GB200 and B300 / GB300; the backend's capabilities
ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a", "sm_103a")

Kernel = tuple[str, tuple]


def arch_of(capability: tuple[int, int]) -> str:
    """The arch a device of compute capability (major, minor) runs: "sm_<major><minor>a"."""
    major, minor = capability
    return f"sm_{major}{minor}a"


def kernel_name(name: str, arch: str) -> str:
    """The registered name of kernel `name` compiled for `arch`."""
    return f"{name}@{arch}"


def register(name: str, build: Callable[[tuple], tuple], sources: Sequence[str]) -> None:
    """Register kernel `name` for every arch of ARCHS. `build(config)` returns the @cute.jit callable and its
    compile-time arguments (`fake_args`); `sources`: the modules whose text defines it (they key the cache)."""
    for arch in ARCHS:
        rt.register(rt.KernelDef(kernel_name(name, arch), DISTRIBUTION, PACKAGE, arch, build, tuple(sources)))


def fake_args(dtypes: Sequence[torch.dtype], *scalars) -> tuple:
    """A kernel's compile-time arguments: one 16-byte aligned pointer per dtype, the scalars (ints for Int32,
    floats for Float32; any value), the stream."""
    return (*(rt.fake_ptr(d) for d in dtypes), *scalars, rt.fake_stream())


def compile_kernel(kernel: Kernel, arch: str):
    """The DSL's compiled function of `kernel` for `arch` (no GPU needed; the compile tests and tools use it)."""
    name, config = kernel
    return rt.compile_kernel(kernel_name(name, arch), config)


def loaded_function(kernel: Kernel, arch: str):
    """The runtime's function of `kernel` for `arch` (shipped, cached or compiled now; loading needs no GPU)."""
    name, config = kernel
    return rt.get(kernel_name(name, arch), config)


_ARCH_BY_DEVICE: dict[int, str] = {}


def device_arch(index: int | None = None) -> str:
    """The arch of CUDA device `index` (None: the current device)."""
    if index is None:
        index = torch.cuda.current_device()
    arch = _ARCH_BY_DEVICE.get(index)
    if arch is None:
        arch = _ARCH_BY_DEVICE[index] = arch_of(torch.cuda.get_device_capability(index))
    return arch


def addresses(name: str, dtypes: Sequence[torch.dtype], tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """The integer addresses kernel `name` takes for `tensors` (one per entry of `dtypes`, the pointer dtypes it was
    compiled for; None for an absent optional tensor: `cute_runtime.data_ptr(None)`'s address, never read).
    Raises TypeError for a wrong count or a tensor of another dtype and ValueError for an address that is not
    16-byte aligned (every pointer is compiled as 16-byte aligned)."""
    out = list(map(rt.data_ptr, tensors))
    if len(out) != len(dtypes):
        raise TypeError(f"{name}: {len(out)} tensors, the kernel takes {len(dtypes)}")
    if functools.reduce(operator.or_, out, 0) & 15:
        i = next(i for i, a in enumerate(out) if a & 15)
        raise ValueError(f"{name}: argument {i} at address {out[i]:#x} is not 16-byte aligned")
    for t, dtype in zip(tensors, dtypes):
        if t is not None and t.dtype is not dtype:  # (torch dtypes are singletons)
            i = next(i for i, t in enumerate(tensors) if t is not None and t.dtype != dtypes[i])
            raise TypeError(f"{name}: argument {i} is {tensors[i].dtype}, the kernel was compiled for {dtypes[i]}")
    return out


def launch(kernel: Kernel, dtypes: Sequence[torch.dtype], tensors: Sequence[torch.Tensor | None],
           scalars: Sequence[int | float]) -> None:
    """Launch `kernel` for the current device's arch on its current stream: `tensors` (checked by `addresses`,
    before anything runs), then `scalars` (int: Int32, float: Float32)."""
    index = torch.cuda.current_device()
    fn = loaded_function(kernel, device_arch(index))
    fn(*addresses(kernel[0], dtypes, tensors), *scalars, rt.current_stream(index))
