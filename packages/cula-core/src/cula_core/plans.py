"""Plans: what core decided for one call signature, kept for the eager calls that repeat it.

A public op's host path validates its arguments, builds a `CallConfig`, asks the dispatch for a backend and binds
the backend's kernel to the call's flags. For tensors on a CUDA device all of that is a function of the arguments'
metadata (types, shapes, dtypes, devices, contiguity), of the scalar arguments and of the environment variables the
dispatch reads, and of nothing else: tensor *values* are read only from host data or with
``CULA_CHECK_DEVICE_VALUES=1`` (cula_core.validation), and such calls never use a plan. So an op does that work once
per signature and keeps the result, a *plan* (a callable that takes the call's tensors and runs the kernel); a later
call with the same signature runs the plan directly. Serving loops (decode steps at a fixed batch size, prefill
chunks of a fixed token budget) and benchmarks repeat signatures; a new signature costs one full path.

A call has a signature only when it is plainly eager: no torch.compile tracing, no dispatch mode (fake or
functional tensors, make_fx), every tensor a plain `torch.Tensor` (or `Parameter`), contiguous, on a CUDA device,
every scalar an int, float, bool, str or None. Anything else takes the op's full path every time, with its errors.
A call whose validation raises leaves no plan behind, so a bad call raises every time it is made.

What a plan depends on besides the signature is forgotten with it: `forget()` runs when the backends are reloaded
(`cula_core.registry.reload`) and when the fallback warnings are reset (`cula_core.dispatch.reset_fallback_warnings`:
a plan that runs the reference was made by a call that warned).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_SCALAR_TYPES = frozenset((int, float, bool, str, type(None)))
_is_compiling = torch.compiler.is_compiling
#: environment variables whose values change what a call runs (cula_core.dispatch)
DISPATCH_ENVIRONMENT = ("CULA_BACKEND", "CULA_STRICT")


def _environment_reader() -> Callable[[bytes], bytes | None]:
    """A function from a variable's name (bytes) to its value in the process environment (bytes, None when unset).

    It reads the C library's environment (getenv), which holds what os.environ holds: every assignment or deletion
    through os.environ writes through to it (putenv / unsetenv), so a change made between two calls is seen by the
    next one. Not os.environ.get: for an unset variable, the usual case, it raises and catches a KeyError, on every
    call and for each of the three variables. Called through ctypes.PyDLL, which keeps the GIL, so no Python thread
    changes the environment during the read. Where the C library cannot be loaded: os.environ."""
    try:
        getenv = ctypes.PyDLL(None).getenv
    except (OSError, AttributeError, TypeError):
        def read(name: bytes) -> bytes | None:
            value = os.environ.get(name.decode())
            return None if value is None else value.encode()

        return read
    getenv.restype, getenv.argtypes = ctypes.c_char_p, (ctypes.c_char_p,)
    return getenv


_getenv = _environment_reader()

#: the lowest device index a signature accepts: 0, CUDA devices only (a host tensor's index is -1). The CPU profile of
#: the host path (tools/bench/host_stub.py) lowers it to -1 so that host tensors get signatures; nothing else does.
MIN_DEVICE = 0

#: plans kept at most; past it the oldest half is dropped (a process that never repeats a signature)
MAX_PLANS = 4096

_plans: dict[tuple, Callable] = {}
_lock = threading.Lock()


def signature(op: str, tensors: tuple, scalars: tuple) -> tuple | None:
    """The plan key of a call of `op`, or None when the call must take the full path (see the module docstring).

    `tensors`: every tensor argument (None for an absent optional one); `scalars`: every other argument that
    changes what the call does. Scalars enter the key with their types (``1``, ``1.0`` and ``True`` differ)."""
    if _is_compiling() or _get_current_dispatch_mode() is not None:
        return None
    check_values = _getenv(b"CULA_CHECK_DEVICE_VALUES")
    if check_values and check_values != b"0":
        return None
    types = tuple(map(type, scalars))
    if not _SCALAR_TYPES.issuperset(types):
        return None
    parts = [op, _getenv(b"CULA_BACKEND"), _getenv(b"CULA_STRICT"), scalars, types]
    min_device = MIN_DEVICE
    for t in tensors:
        if t is None:
            parts.append(None)
            continue
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter:
            return None
        device = t.get_device()  # -1 on the host
        if device < min_device or not t.is_contiguous():
            return None
        parts.append((t.shape, t.dtype, device))
    return tuple(parts)


#: lookup(key): the plan made for `key`, or None (the dict's own get: no Python frame on the hot path)
lookup: Callable[[tuple], Callable | None] = _plans.get


def remember(key: tuple, plan: Callable) -> Callable:
    """Keep `plan` for `key` and return it."""
    with _lock:
        if len(_plans) >= MAX_PLANS:
            for old in list(_plans)[: MAX_PLANS // 2]:
                del _plans[old]
        _plans[key] = plan
    return plan


def forget() -> None:
    """Drop every plan: the next call of each signature takes the full path again."""
    with _lock:
        _plans.clear()


def count() -> int:
    """Plans held now."""
    return len(_plans)
