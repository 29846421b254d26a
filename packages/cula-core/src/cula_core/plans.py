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

import os
import threading
from collections.abc import Callable

import torch

from cula_core.cute_runtime import plan_table

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_SCALAR_TYPES = frozenset((int, float, bool, str, type(None)))
_is_compiling = torch.compiler.is_compiling
# how many dispatch modes are active (fake or functional tensors, make_fx): the count torch's own
# _get_current_dispatch_mode reads before it fetches the innermost mode, which a signature does not need
_dispatch_modes = torch._C._len_torch_dispatch_stack
#: environment variables whose values change what a call runs (cula_core.dispatch)
DISPATCH_ENVIRONMENT = ("CULA_BACKEND", "CULA_STRICT")


def _environment() -> tuple[Callable, tuple, object]:
    """(read, names, zero): `read(name)` is the value of an environment variable as os.environ stores it, None when
    unset; `names` are CULA_CHECK_DEVICE_VALUES and DISPATCH_ENVIRONMENT as `read` takes them; `zero` is "0" as it
    returns it.

    os.environ keeps its variables in a dict of encoded names and values (CPython's `os.environ._data`, on every
    version since 3.2); `read` is that dict's own get: what os.environ.get returns, without the KeyError that
    os.environ.get raises and catches for an unset variable (the usual case: three per call). Every assignment or
    deletion through os.environ updates that dict, so a change made between two calls reaches the next key; the
    dispatch reads the same values (os.environ.get). Where os.environ has no such dict: os.environ.get itself."""
    names = ("CULA_CHECK_DEVICE_VALUES", *DISPATCH_ENVIRONMENT)
    data = getattr(os.environ, "_data", None)
    encode, encode_value = getattr(os.environ, "encodekey", None), getattr(os.environ, "encodevalue", None)
    if isinstance(data, dict) and callable(encode) and callable(encode_value):
        return data.get, tuple(map(encode, names)), encode_value("0")
    return os.environ.get, names, "0"


_read_environment, (_CHECK_DEVICE_VALUES, _BACKEND, _STRICT), _ZERO = _environment()

#: the lowest device index a signature accepts: 0, CUDA devices only (a host tensor's index is -1). The CPU profile of
#: the host path (tools/bench/host_stub.py) lowers it to -1 so that host tensors get signatures; nothing else does.
MIN_DEVICE = 0

#: plans kept at most; past it the oldest half is dropped (a process that never repeats a signature)
MAX_PLANS = 4096

_plans: dict[tuple, Callable] = {}
#: the tuples of scalar types `signature` has accepted (a few per op: each a tuple of _SCALAR_TYPES members)
_scalar_types_seen: set[tuple] = set()
_lock = threading.Lock()


def signature(op: str, tensors: tuple, scalars: tuple) -> tuple | None:
    """The plan key of a call of `op`, or None when the call must take the full path (see the module docstring).

    `tensors`: every tensor argument (None for an absent optional one); `scalars`: every other argument that
    changes what the call does. Scalars enter the key with their types (``1``, ``1.0`` and ``True`` differ).
    The key is flat: op, the dispatch environment, scalars, their types, then per tensor its shape, dtype and device
    index (None for an absent one: a shape never equals None, so the sequence reads back one way only)."""
    if _is_compiling() or _dispatch_modes():
        return None
    read = _read_environment
    check_values = read(_CHECK_DEVICE_VALUES)
    if check_values and check_values != _ZERO:
        return None
    types = tuple(map(type, scalars))
    if types not in _scalar_types_seen:  # a set lookup, where issuperset would build a set of the types each call
        if not _SCALAR_TYPES.issuperset(types):
            return None
        if len(_scalar_types_seen) >= MAX_PLANS:
            _scalar_types_seen.clear()
        _scalar_types_seen.add(types)
    key = [op, read(_BACKEND), read(_STRICT), scalars, types]
    append = key.append  # three appends: cheaper than extending by a tuple built for the purpose
    min_device = MIN_DEVICE
    for t in tensors:
        if t is None:
            append(None)
            continue
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter:
            return None
        device = t.get_device()  # -1 on the host
        if device < min_device or not t.is_contiguous():
            return None
        append(t.shape)
        append(t.dtype)
        append(device)
    return tuple(key)


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
    """Drop every plan (and every program of the compiled plan table): the next call of each signature takes the
    full path again."""
    with _lock:
        _plans.clear()
    plan_table.clear()


_PLAIN_TYPES = frozenset((_Tensor, _Parameter, type(None)))


def plain_eager(tensors: tuple) -> bool:
    """Whether a call with these tensor arguments may be served by the compiled plan table
    (cula_core.cute_runtime.plan_table): not traced by torch.compile, no dispatch mode active, every tensor a plain
    `torch.Tensor` or `Parameter` (or None). The table checks the rest (contiguity, devices, the environment)."""
    return not (_is_compiling() or _dispatch_modes()) and _PLAIN_TYPES.issuperset(map(type, tensors))


def run_compiled(op: int, scalars: tuple, tensors: tuple):
    """The compiled plan table's answer for this call of `op` (cula_core.cute_runtime.plan_table): the first result
    of the program registered for its signature, or None, where the op takes its Python path: no program, a call
    `plain_eager` or the table does not serve, or a tensor TVM-FFI cannot take (meta, sparse), whose error the full
    path gives. An error raised while the program runs (a kernel launch, an allocation) propagates: the Python
    path would launch again. The program's further results: `plan_table.next_result`. An op with no program
    registered skips the table."""
    if op not in plan_table.ops_registered or not plain_eager(tensors):
        return None
    try:
        return plan_table.call(op, len(scalars), *scalars, *tensors)
    except Exception:
        if plan_table.take_failure():
            raise
        return None


def register_compiled(op: int, scalars: tuple, tensors: tuple, plan: Callable) -> None:
    """Register `plan`'s program (its `program` attribute, a plan_table.Program, where the backend states one) in
    the compiled plan table for this call's signature; plans without one stay Python-only."""
    program = getattr(plan, "program", None)
    if program is not None:
        plan_table.register(op, scalars, tensors, program)


def count() -> int:
    """Plans held now."""
    return len(_plans)
