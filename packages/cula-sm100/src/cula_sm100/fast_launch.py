"""Pre-packed launches of cula-sm100's compiled CuTe DSL kernels (forward and backward).

Why. Calling a compiled kernel through the DSL (`compiled(*args)`) converts every argument on every call: a fresh
`make_ptr` pointer object per tensor, then the per-argument adapters and the packing of the C argument array. With
5-20 arguments a launch costs tens of microseconds of host time, more than the kernel itself takes on small
problems, so small training steps are host-bound without this (docs/benchmarks/sm100_launch.md).

How. Every sm100 kernel here has the same signature shape: pointers (one per tensor, dtype fixed by the compile
key), then 32-bit scalars (Int32 sizes, Float32 scale), then the CUstream. A `Launcher` owns the C arguments'
storage (the pointers' addresses in one ctypes array of 8-byte slots, one cell per scalar and one for the stream)
and the packed argument array of the compiled host function, built once over their addresses (plus the executor's
trailing entries: its error cell and kernel handles). A call only writes the addresses (one slice assignment), the
scalars and the stream handle, and calls the host function. Nothing is read from the device; no synchronisation.

Safety. A launcher checks each tensor's dtype against the compiled one and the 16-byte alignment every kernel
assumes (the pointers are declared `assumed_align=16`); an absent optional tensor gets the dummy address 16 that
`forward.launch.kernel_pointer(None, ...)` gives (never dereferenced). The first call of each compiled kernel goes
through the DSL's own call path, after checking that the DSL would hand the host function exactly the bytes of the
cells (`generate_execution_args`); if not (another DSL version, a kernel whose arguments the cells do not
describe), that kernel keeps the DSL path for good. The cells are shared, so a call holds the launcher's lock from
the first write to the return of the host function.

Switch. `ENABLED = False` routes every launch through the DSL's call path with fresh pointers (debugging, and the
GPU test that compares both paths bitwise). tests/sm100/test_fast_launch_cpu.py checks the cells' bytes against
`generate_execution_args` for every kernel on the CPU; tests/sm100/test_fast_launch_gpu.py checks every forward and
backward kernel bitwise against the DSL path, launches on the current stream and memcheck. Host time per call with
and without it: docs/benchmarks/sm100_launch.md.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading

# False: every launch through the compiled function's own __call__ with fresh make_ptr pointers
ENABLED = True

DUMMY_ADDRESS = 16  # forward.launch.kernel_pointer(None, ...)'s address for an absent optional tensor (never read)


class Launcher:
    """One compiled kernel's pre-packed call: `dtypes` are its pointer arguments' torch dtypes in order,
    `scalar_kinds` its 32-bit scalars after them ("i" Int32, "f" Float32), then the stream."""

    def __init__(self, compiled, dtypes, scalar_kinds: str):
        self.compiled = compiled
        self.dtypes = tuple(dtypes)
        self.scalar_kinds = scalar_kinds
        n = len(self.dtypes)
        # the pointer arguments in one array (8 bytes each, as a c_void_p cell holds them): one slice assignment
        # writes them all
        self.addresses = (ctypes.c_uint64 * n)(*[DUMMY_ADDRESS] * n)
        self.scalar_cells = [ctypes.c_int32() if k == "i" else ctypes.c_float() for k in scalar_kinds]
        self.stream_cell = ctypes.c_void_p()
        base = ctypes.addressof(self.addresses)
        self.exe_args = [base + 8 * i for i in range(n)] + [ctypes.addressof(c) for c in self.scalar_cells] \
            + [ctypes.addressof(self.stream_cell)]
        self.sizes = [8] * n + [4] * len(self.scalar_cells) + [8]
        # None: not decided (before the first call); False: the DSL path (checked and refused, or not a DSL object)
        self.fast = None if hasattr(compiled, "generate_execution_args") else False
        self.host = None  # (host function, its packed argument array, the executor's error cell or None)
        self.lock = threading.Lock()
        self._checked = None  # the last checked call's dtypes (None: absent tensor): repeated patterns skip the check

    # -------------------------------------------------------------- the cells

    def cell_bytes(self) -> list[bytes]:
        """The bytes of every C argument as the cells hold them (what the host function is handed)."""
        return [ctypes.string_at(a, n) for a, n in zip(self.exe_args, self.sizes, strict=True)]

    def _check_dtypes(self, tensors) -> None:
        for i, (dt, t) in enumerate(zip(self.dtypes, tensors, strict=True)):
            if t is not None and t.dtype != dt:
                raise TypeError(f"argument {i}: {t.dtype}, the kernel was compiled for {dt}")

    def fill(self, tensors, scalars, stream) -> None:
        """Write the call's arguments into the cells (checked: dtype, alignment, count). Hold `lock`."""
        if len(tensors) != len(self.dtypes) or len(scalars) != len(self.scalar_cells):
            raise TypeError(f"{len(tensors)} tensors and {len(scalars)} scalars, the kernel takes "
                            f"{len(self.dtypes)} and {len(self.scalar_cells)}")
        seen = tuple([None if t is None else t.dtype for t in tensors])
        if seen != self._checked:
            self._check_dtypes(tensors)
            self._checked = seen
        addrs = [DUMMY_ADDRESS if t is None else t.data_ptr() for t in tensors]
        if functools.reduce(operator.or_, addrs, 0) & 15:  # (one C loop over the addresses)
            i = next(i for i, a in enumerate(addrs) if a & 15)
            raise ValueError(f"argument {i}: address {addrs[i]:#x} is not 16-byte aligned")
        self.addresses[:] = addrs
        for cell, x in zip(self.scalar_cells, scalars, strict=True):
            cell.value = x
        self.stream_cell.value = int(stream)

    def dsl_args(self, tensors, scalars, stream) -> tuple:
        """The same call's arguments as the DSL takes them: fresh make_ptr pointers (forward.launch.kernel_pointer), the
        scalars as given, the CUstream."""
        from cula_sm100.forward import launch as fwd

        self._check_dtypes(tensors)
        return (*(fwd.kernel_pointer(t, dt) for dt, t in zip(self.dtypes, tensors, strict=True)), *scalars, stream)

    def matches_dsl(self, dsl_args) -> bool:
        """Whether the DSL's own conversion of `dsl_args` hands the host function exactly the cells' bytes (the
        cells filled from the same call)."""
        try:
            converted = self.compiled.generate_execution_args(*dsl_args)[0]
        except Exception:  # not convertible: the DSL path will say why when it is called
            return False
        return len(converted) == len(self.sizes) and all(
            _bytes_at(a, n) == mine for a, n, mine in zip(converted, self.sizes, self.cell_bytes(), strict=True))

    def _bind_host(self) -> None:
        """The default executor's host function and a packed array of our own over the cells (the executor made
        by the first DSL call; its trailing entries, the error cell and kernel handles, copied once). On a DSL
        without these internals `host` stays None and launches go through `run_compiled_program`."""
        ex = getattr(self.compiled, "_default_executor", None)
        try:
            entries = list(ex._get_invoke_packed_args(self.exe_args))
            func, result = ex.capi_func, (ex.cuda_result if ex._has_cuda_result else None)
        except Exception:
            return
        self.host = (func, (ctypes.c_void_p * len(entries))(*entries), result)

    # -------------------------------------------------------------- a launch

    def __call__(self, tensors, scalars, stream) -> None:
        if not ENABLED or self.fast is False:
            self.compiled(*self.dsl_args(tensors, scalars, stream))
            return
        with self.lock:
            self.fill(tensors, scalars, stream)
            if self.fast is None:  # the first call: check the cells, launch through the DSL
                args = self.dsl_args(tensors, scalars, stream)
                self.fast = self.matches_dsl(args)
                self.compiled(*args)
                if self.fast:
                    self._bind_host()
                return
            host = self.host
            if host is None:  # the cells, through the executor's packing
                self.compiled.run_compiled_program(self.exe_args)
            else:
                host[0](host[1])
                err = host[2].value if host[2] is not None else 0
                if err:
                    raise RuntimeError(f"CUDA error {err} launching a cula-sm100 kernel (fast_launch)")


def _bytes_at(address, n: int) -> bytes | None:
    """n bytes at a C argument the DSL produced (an int address or a c_void_p), None for anything else."""
    if isinstance(address, ctypes.c_void_p):
        address = address.value
    return ctypes.string_at(address, n) if isinstance(address, int) and address else None


_launchers: dict[int, tuple[object, Launcher]] = {}
_launchers_lock = threading.Lock()


def cached_launchers() -> list[Launcher]:
    """The launchers made so far in this process, one per compiled kernel launched."""
    return [entry[1] for entry in list(_launchers.values())]


def launcher(compiled, dtypes, scalar_kinds: str) -> Launcher:
    """The Launcher of `compiled` (made on its first use; the compiled kernels are cached for the process, so
    their launchers are too)."""
    hit = _launchers.get(id(compiled))
    if hit is not None and hit[0] is compiled:
        return hit[1]
    with _launchers_lock:
        hit = _launchers.get(id(compiled))
        if hit is None or hit[0] is not compiled:
            hit = _launchers[id(compiled)] = (compiled, Launcher(compiled, dtypes, scalar_kinds))
    return hit[1]


def launch(compiled, dtypes, tensors, scalars, stream) -> None:
    """Launch `compiled` on `tensors` (one per entry of `dtypes`; None: absent), 32-bit `scalars` (Python int:
    Int32, float: Float32) and `stream` (a CUstream)."""
    hit = _launchers.get(id(compiled))
    if hit is not None and hit[0] is compiled:
        hit[1](tensors, scalars, stream)
        return
    launcher(compiled, dtypes, "".join("f" if type(x) is float else "i" for x in scalars))(tensors, scalars, stream)
