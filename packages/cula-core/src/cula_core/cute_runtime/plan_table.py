"""The compiled plan table: repeated public-op calls checked, allocated and launched in C++ (plan_table.cc).

A plan (cula_core.plans) keeps what core decided for one call signature; running it from Python still costs the
signature (five torch attribute reads per tensor), the allocations and the launches' argument conversion
(docs/benchmarks/host_overhead.md). Where a backend can state its plan as a `Program` (allocations, then kernel
launches whose arguments are literals, addresses of the call's tensors or of the allocations, and the stream), the
op registers it here (`plans.register_compiled`), and a later call with the same signature is served by one TVM-FFI
call: the key built from the tensors' DLPack metadata, the outputs allocated through torch's caching allocator, the
kernels called on torch's current stream. The op asks the table first (`plans.run_compiled`, which calls `call`)
and takes its Python path when the answer is None (no program for the key, or a call the table never serves: see
plan_table.cc).

    o = plan_table.call(op, len(scalars), *scalars, *tensors)      # None: take the Python path
    final = plan_table.next_result(o)                              # a program's second result, if it has one

The library is built from plan_table.cc with the C++ compiler ($CXX, else c++ / g++ / clang++) into the cula cache
(`cache_dir()/plan_table/`, keyed by a hash of the source and the apache-tvm-ffi version) the first time a program
is registered, or loaded from there; an arch wheel may ship it prebuilt (`<package>/_aot/plan_table-<hash>.so`, see
cula_core.cute_runtime.aot). Without a compiler nothing is registered (one warning) and every call takes the Python
path: same results, more host time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from cula_core.cute_runtime import registry

SOURCE = Path(__file__).with_name("plan_table.cc")

# op ids of the key (any distinct ints; fixed here so that every op uses its own)
KDA_PREFILL = 1
CHUNK_KDA_INFERENCE = 2
KDA_DECODE = 3
KDA_DECODE_MTP = 4
KDA_DECODE_MTP_KVBUFFER = 5
FUSED_RECURRENT_POOL = 6

# argument kinds of a launch (plan_table.cc's ArgKind)
_LITERAL_INT, _LITERAL_FLOAT, _ADDRESS, _STREAM = range(4)

# DLPack (type code, bits) of the dtypes a program allocates
_DL_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.float64: (2, 64), torch.bfloat16: (4, 16),
              torch.uint8: (1, 8), torch.int32: (0, 32), torch.int64: (0, 64)}


class Address(NamedTuple):
    """A launch argument: the data address of `slot` (an input of the call, or an allocation) plus `offset` bytes.
    The slot must hold a tensor on every call the program serves."""

    slot: int
    offset: int = 0


class _Stream:
    def __repr__(self) -> str:
        return "STREAM"


#: a launch argument: the raw handle of torch's current stream on the first input's device
STREAM = _Stream()


class Program:
    """What one plan does per call, for the compiled table: allocations, then launches, then its results.

    Slots 0 .. n_inputs - 1 are the call's tensor arguments in the order the op passes them (None for an absent
    one); `alloc` adds a slot per allocation. Literal ints and floats in a launch are fixed for every call of the
    plan; `keep` holds objects the literals point into (device tables whose addresses are baked in) for as long as
    the program is registered."""

    def __init__(self, n_inputs: int):
        self.n_inputs = n_inputs
        self._allocs: list[list[int]] = []
        self._kernels: list = []
        self._args: list[list[int]] = []
        self._floats: list[float] = []
        self._aligned: list[int] = []
        self._results: list[int] = []
        self.keep: list = []

    @property
    def n_slots(self) -> int:
        return self.n_inputs + len(self._allocs)

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, device_of: int = 0) -> int:
        """A new tensor of `shape` and `dtype` per call, on the device of input `device_of`; returns its slot."""
        if dtype not in _DL_DTYPES:
            raise TypeError(f"Program.alloc: unsupported dtype {dtype}")
        if not 0 <= device_of < self.n_inputs:
            raise ValueError(f"Program.alloc: device_of must name an input slot, got {device_of}")
        code, bits = _DL_DTYPES[dtype]
        shape = [int(s) for s in shape]
        self._allocs.append([code, bits, 1, device_of, len(shape), *shape])
        return self.n_slots - 1

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"Program: slot {slot} out of range (0 .. {self.n_slots - 1})")
        return slot

    def launch(self, kernel, *args) -> None:
        """Launch `kernel` (a TVM-FFI function) with `args`: ints (bools count as ints), floats, Address or STREAM.
        An optional input's presence is part of the call's key, so a program addresses an absent one's stand-in
        (an allocation) directly."""
        triples: list[int] = []
        for a in args:
            if isinstance(a, Address):
                triples += [_ADDRESS, self._slot(a.slot), int(a.offset)]
            elif a is STREAM:
                triples += [_STREAM, 0, 0]
            elif isinstance(a, (bool, int)):
                triples += [_LITERAL_INT, int(a), 0]
            elif isinstance(a, float):
                self._floats.append(a)
                triples += [_LITERAL_FLOAT, len(self._floats) - 1, 0]
            else:
                raise TypeError(f"Program.launch: unsupported argument {a!r}")
        self._kernels.append(kernel)
        self._args.append(triples)

    def require_aligned(self, *slots: int) -> None:
        """Inputs the kernels read with 16-byte vectors: a call where one is not 16-byte aligned is not served."""
        for s in slots:
            if not 0 <= s < self.n_inputs:
                raise ValueError(f"Program.require_aligned: {s} is not an input slot")
        self._aligned += slots

    def returns(self, *slots: int) -> None:
        """The results, in order: allocation slots. `call` returns the first, `next_result` the others."""
        for s in slots:
            if not self.n_inputs <= s < self.n_slots:
                raise ValueError(f"Program.returns: {s} is not an allocation slot")
        self._results = list(slots)

    def reordered(self, slots: Sequence[int], n_inputs: int) -> Program:
        """This program for a call whose tensor arguments come in another order: input i here is input `slots[i]`
        of the new program, which has `n_inputs` inputs (the others unused); allocations follow the inputs."""
        if len(slots) != self.n_inputs or len(set(slots)) != len(slots) or not all(0 <= s < n_inputs for s in slots):
            raise ValueError(f"Program.reordered: {self.n_inputs} distinct input slots below {n_inputs} expected, "
                             f"got {tuple(slots)}")
        shift = n_inputs - self.n_inputs

        def slot(s: int) -> int:
            return slots[s] if s < self.n_inputs else s + shift

        out = Program(n_inputs)
        out._allocs = [[*a[:3], slots[a[3]], *a[4:]] for a in self._allocs]
        out._kernels = list(self._kernels)
        for triples in self._args:
            moved = list(triples)
            for j in range(0, len(moved), 3):
                if moved[j] == _ADDRESS:
                    moved[j + 1] = slot(moved[j + 1])
            out._args.append(moved)
        out._floats = list(self._floats)
        out._aligned = [slots[s] for s in self._aligned]
        out._results = [slot(s) for s in self._results]
        out.keep = list(self.keep)
        return out

    def spec(self) -> list:
        """The program as plan_table.cc's cula_plan_register reads it."""
        return [self._allocs, self._kernels, self._args, self._floats, self._aligned, self._results, self.keep]


def _no_library(*args):
    return None


#: call(op, n_scalars, *scalars, *tensors): the first result of the registered program for this call, or None
#: (take the Python path). A plain function answering None until the library is loaded.
call = _no_library
#: next_result(like): the next result of the last program `call` ran on this thread, as a torch tensor (`like`: any
#: torch tensor, which tells TVM-FFI to return torch tensors)
next_result = _no_library

_lock = threading.Lock()
_functions: dict = {}
_unavailable = False
#: the op ids that have had a program registered since the last `clear`: an op outside it skips the table (a call
#: that can only miss would pay the table's key for nothing)
ops_registered: set[int] = set()


def source_hash() -> str:
    """Hash of plan_table.cc and the apache-tvm-ffi version it compiles against (the library's file name)."""
    import tvm_ffi

    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(tvm_ffi.__version__.encode())
    return h.hexdigest()[:16]


def library_name() -> str:
    return f"plan_table-{source_hash()}.so"


def build(out: Path | str) -> Path:
    """Compile plan_table.cc into the shared library `out` (written atomically). RuntimeError without a compiler
    or when the compile fails."""
    import tvm_ffi.libinfo

    cxx = registry.find_compiler("CXX", ("c++", "g++", "clang++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler found to build cula's plan table (set CXX, or install c++ / g++)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lib_dir = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    return registry.build_file(out, lambda tmp: [
        *shlex.split(cxx), "-std=c++17", "-O2", "-fPIC", "-shared", "-o", str(tmp), str(SOURCE),
        *(f"-I{p}" for p in tvm_ffi.libinfo.include_paths()), f"-L{lib_dir}", "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}"],
        "building")


def _shipped() -> Path | None:
    name = library_name()
    for package in registry.arch_packages():
        folder = registry.package_dir(package)
        if folder is not None and (folder / registry.AOT_FOLDER / name).is_file():
            return folder / registry.AOT_FOLDER / name
    return None


@functools.cache
def library_path() -> Path | None:
    """The plan-table library for this process: shipped in an arch wheel, else in the cache (built there now if
    missing). None (with one warning) when it cannot be built."""
    path = _shipped()
    if path is not None:
        return path
    path = registry.cache_dir() / "plan_table" / library_name()
    if path.is_file():
        return path
    try:
        return build(path)
    except (RuntimeError, OSError) as e:
        warnings.warn(f"cula: the compiled plan table is unavailable ({e}); repeated calls take the Python path",
                      RuntimeWarning, stacklevel=3)
        return None


def load() -> bool:
    """Load the library (building it if needed) and route `call` / `next_result` to it. False (with one warning)
    if it is unavailable or does not load."""
    global call, next_result, _unavailable
    with _lock:
        if _functions:
            return True
        if _unavailable:
            return False
        path = library_path()
        if path is None:
            _unavailable = True
            return False
        try:
            import tvm_ffi

            module = tvm_ffi.load_module(str(path))
            functions = {name: module[f"cula_plan_{name}"] for name in ("call", "next_result", "register", "clear",
                                                                         "count", "stats", "take_failure")}
        except Exception as e:  # a damaged cached build, an incompatible apache-tvm-ffi
            warnings.warn(f"cula: the compiled plan table {path} does not load ({type(e).__name__}: {e}); repeated "
                          f"calls take the Python path", RuntimeWarning, stacklevel=3)
            _unavailable = True
            return False
        _functions.update(functions)
        call, next_result = _functions["call"], _functions["next_result"]
        return True


def register(op: int, scalars: tuple, tensors: tuple, program: Program) -> bool:
    """Store `program` for calls of `op` with these scalars and tensors' signature; False when the library is
    unavailable or the call is one the table never serves."""
    if not load():
        return False
    stored = bool(_functions["register"](program.spec(), op, len(scalars), *scalars, *tensors))
    if stored:
        ops_registered.add(op)
    return stored


def clear() -> None:
    """Drop every registered program."""
    ops_registered.clear()
    if _functions:
        _functions["clear"]()


def count() -> int:
    """Programs registered now."""
    return int(_functions["count"]()) if _functions else 0


def stats() -> tuple[int, int]:
    """(served, declined): calls that reached the table since the library loaded and ran a program, and those that
    came back without running one (no program for the signature, or declined: non-contiguous, misaligned, ...).
    Calls an op keeps from the table (no program registered for the op, tracing, tensor subclasses) are in neither.
    Benchmarks read it to tell whether their calls were served; (0, 0) while the library is not loaded."""
    if not _functions:
        return 0, 0
    served, declined = _functions["stats"]()
    return int(served), int(declined)


def take_failure() -> bool:
    """Whether this thread's last `call` raised while running its program (a kernel launch or an allocation
    failed), as opposed to before reaching one (a tensor TVM-FFI cannot take, such as a meta or sparse tensor,
    fails in the argument conversion); reading it clears it. An op retries a failed table call on its Python
    path only in the second case: after a program started, a retry would launch its kernels again."""
    return bool(_functions["take_failure"]()) if _functions else False
