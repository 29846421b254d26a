"""Choosing the code that runs a call: an installed arch backend, or the reference.

Rule (DESIGN.md, "Dispatch"):
  1. ``CULA_BACKEND=<name>`` forces that backend ("reference" forces the reference); if it cannot serve
     the call, the call raises `BackendUnavailableError` naming why.
  2. Otherwise, among loaded backends that run on the tensors' device and serve the configuration, the
     one built for exactly this architecture wins; then the newest architecture not above the device's;
     then any other.
  3. Otherwise the reference runs, with a `CulaFallbackWarning` issued once per (op, reason) that says
     why ("cula-sm90 not installed", "sm90 serves K=V=128 only, got K=64"). ``CULA_STRICT=1`` turns
     this fallback into a `BackendUnavailableError`.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from cula_core import plans, registry
from cula_core.backend import Backend, CallConfig, DeviceInfo
from cula_core.cute_runtime.convert import current_device  # the decorator's device read (tests patch it here)
from cula_core.reference_backend import REFERENCE, REFERENCE_BACKEND


class CulaFallbackWarning(UserWarning):
    """A call ran on the reference implementation because no kernel serves it."""


class BackendUnavailableError(RuntimeError):
    """A forced backend (CULA_BACKEND) cannot serve a call, or CULA_STRICT=1 forbids the fallback."""


@dataclass(frozen=True)
class Selection:
    backend: Backend
    fallback_reason: str | None  # why the reference runs; None when a kernel was chosen (or forced)


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _rank(backend: Backend, device: DeviceInfo) -> tuple[int, tuple[int, int], str]:
    cap = device.capability or (0, 0)
    if backend.arch == cap:
        tier = 0
    elif backend.arch <= cap:
        tier = 1
    else:
        tier = 2
    # Lower sorts first: exact match, then the newest arch below the device, then the rest.
    return (tier, (-backend.arch[0], -backend.arch[1]), backend.name)


def _missing_reason(device: DeviceInfo) -> str:
    """Why no installed backend runs on `device` at all."""
    if device.type != "cuda":
        return f"inputs are on {device.type}; cula kernels run on CUDA devices"
    cap = device.capability
    wanted = registry.ARCH_PACKAGES.get(cap)
    if wanted is None:
        return f"no cula kernel package targets sm_{cap[0]}{cap[1]}"
    for entry in registry.failed():
        if entry.distribution and entry.distribution.lower() == wanted:
            return f"{wanted} failed to load ({entry.error})"
    return f"{wanted} not installed"


def _forced(name: str, call: CallConfig) -> Backend:
    if name == REFERENCE:
        return REFERENCE_BACKEND
    for backend in registry.backends():
        if backend.name == name:
            if not backend.runs_on(call.device):
                raise BackendUnavailableError(
                    f"CULA_BACKEND={name}: backend {name} does not run on {call.device} (it runs on "
                    + (", ".join(f"sm_{a}{b}" for a, b in backend.capabilities) or "no device")
                    + ")"
                )
            reason = backend.unsupported_reason(call)
            if reason is not None:
                raise BackendUnavailableError(f"CULA_BACKEND={name}: {call.op}: {reason}")
            return backend
    for entry in registry.failed():
        if entry.entry_name == name:
            raise BackendUnavailableError(f"CULA_BACKEND={name}: the backend failed to load ({entry.error})")
    known = sorted([b.name for b in registry.backends()] + [REFERENCE])
    raise BackendUnavailableError(f"CULA_BACKEND={name}: no such backend is installed (available: {', '.join(known)})")


def choose(call: CallConfig) -> Selection:
    """The backend that runs `call`, without warning or raising for a fallback (used by `select`
    and by the info command to show what each op would use)."""
    forced = os.environ.get("CULA_BACKEND", "").strip()
    if forced:
        return Selection(_forced(forced, call), None)

    on_device = [b for b in registry.backends() if b.runs_on(call.device)]
    if not on_device:
        return Selection(REFERENCE_BACKEND, _missing_reason(call.device))
    reasons = []
    serving = []
    for backend in on_device:
        reason = backend.unsupported_reason(call)
        if reason is None:
            serving.append(backend)
        else:
            reasons.append(reason)
    if serving:
        return Selection(min(serving, key=lambda b: _rank(b, call.device)), None)
    return Selection(REFERENCE_BACKEND, "; ".join(reasons))


def select(call: CallConfig) -> Backend:
    """`choose`, then apply CULA_STRICT and the once-per-(op, reason) fallback warning."""
    selection = choose(call)
    reason = selection.fallback_reason
    if reason is None:
        return selection.backend
    if _env_flag("CULA_STRICT"):
        raise BackendUnavailableError(
            f"{call.op}: no cula kernel serves this call ({reason}) and CULA_STRICT=1 forbids the reference fallback"
        )
    key = (call.op, reason)
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        warnings.warn(f"cula: {call.op} runs on the reference implementation: {reason}", CulaFallbackWarning,
                      stacklevel=3)
    return selection.backend


def reset_fallback_warnings() -> None:
    """Forget which fallback warnings were issued, so each is issued again once (and the plans of the calls that
    issued them: cula_core.plans)."""
    with _warned_lock:
        _warned.clear()
    plans.forget()


def kernel_backend_for(call: CallConfig) -> tuple[Backend | None, str | None]:
    """Which arch backend's kernel would run `call`, asked without running it: ``(backend, None)``, or
    ``(None, reason)`` when no kernel would (the call would run on the reference, or be refused because
    ``CULA_BACKEND`` names a backend that cannot serve it). The rule is `choose`'s, ``CULA_BACKEND`` included;
    nothing is warned or raised. For integrations that must hand a call elsewhere rather than let it fall back
    to the reference (`cula.fla`)."""
    try:
        selection = choose(call)
    except BackendUnavailableError as exc:
        return None, str(exc)
    if selection.backend is REFERENCE_BACKEND:
        return None, selection.fallback_reason or "CULA_BACKEND=reference forces the reference"
    return selection.backend, None


# ------------------------------------------------------------------------------------------- the call's device

def on_input_device(op):
    """Decorator of the public ops: run `op` with the CUDA device of its first positional argument current (a tensor,
    or the first of a list of tensors, as `kda_flush_kvbuffer_all_layers` takes its pools; a call passing every
    tensor by keyword runs on the current device).

    The kernels launch on the current device, into the stream torch keeps for the inputs' device, and CUDA refuses a
    launch into a stream of another device; a model spread over several GPUs in one process calls its layers with
    another device current (FLA's ops switch devices for such calls too). A call whose device is current pays two
    reads of the device index; under torch.compile the compiled code owns the device."""

    @functools.wraps(op)
    def call(*args, **kwargs):
        try:
            index = args[0].get_device()  # -1 on the CPU
        except (IndexError, AttributeError):  # no positional argument, or a list: its first tensor
            first = args[0][0] if args and isinstance(args[0], (list, tuple)) and args[0] else None
            index = first.get_device() if isinstance(first, torch.Tensor) else -1
        if index >= 0 and not torch.compiler.is_compiling() and index != current_device():
            with torch.cuda.device(index):
                return op(*args, **kwargs)
        return op(*args, **kwargs)

    return call
