"""Discovery of installed arch backends through the ``cula.backends`` entry-point group.

Discovery happens on first use (the first dispatch, or `python -m cula info`), never at `import cula`,
so that importing stays fast and works on machines with no GPU and no CUDA. A package whose entry point
fails to load (import error, wrong object) is recorded with its error, reported by the info command and
skipped by dispatch: a broken arch wheel never breaks `import cula` or the reference path.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from importlib import metadata

from cula_core import plans
from cula_core.backend import Backend

ENTRY_POINT_GROUP = "cula.backends"

# Which arch package serves which compute capability natively: used to name what to install when a
# call falls back ("cula-sm90 not installed").
ARCH_PACKAGES: dict[tuple[int, int], str] = {
    (8, 9): "cula-sm89",
    (9, 0): "cula-sm90",
    (10, 0): "cula-sm100",
    (10, 3): "cula-sm100",
}


@dataclass(frozen=True)
class BackendEntry:
    """One entry point of the group: the loaded backend, or the error that stopped it loading."""

    entry_name: str
    value: str  # "module:attr"
    distribution: str | None
    version: str | None
    backend: Backend | None
    error: str | None  # "ImportError: ..." when loading failed
    error_trace: str | None = None

    @property
    def loaded(self) -> bool:
        return self.backend is not None


_lock = threading.Lock()
_entries: list[BackendEntry] | None = None


def _load(ep: metadata.EntryPoint) -> BackendEntry:
    dist = getattr(ep, "dist", None)
    dist_name = dist.metadata["Name"] if dist is not None else None
    dist_version = dist.version if dist is not None else None
    try:
        obj = ep.load()
        backend = obj() if isinstance(obj, type) else obj
        if not isinstance(backend, Backend):
            raise TypeError(f"entry point {ep.value!r} gave {type(backend).__name__}, not a cula_core.backend.Backend")
        if not backend.name:
            raise TypeError(f"backend from {ep.value!r} has an empty name")
    except Exception as exc:
        return BackendEntry(
            entry_name=ep.name,
            value=ep.value,
            distribution=dist_name,
            version=dist_version,
            backend=None,
            error=f"{type(exc).__name__}: {exc}",
            error_trace=traceback.format_exc(),
        )
    return BackendEntry(ep.name, ep.value, dist_name, dist_version, backend, None)


def entries() -> list[BackendEntry]:
    """Every entry point of the group, loaded once per process (see `reload`)."""
    global _entries
    with _lock:
        if _entries is None:
            eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
            seen: set[str] = set()
            found = []
            for ep in eps:
                # The same distribution visible twice on sys.path lists its entry points twice.
                if (ep.name, ep.value) in seen:
                    continue
                seen.add((ep.name, ep.value))
                found.append(_load(ep))
            _entries = found
        return list(_entries)


def backends() -> list[Backend]:
    """The backends that loaded, by name."""
    return [e.backend for e in entries() if e.backend is not None]


def failed() -> list[BackendEntry]:
    return [e for e in entries() if e.backend is None]


def reload() -> None:
    """Forget what was discovered: the next use scans the entry points again (after installing or
    removing an arch package in a running process, and in tests), and the plans made with the old backends."""
    global _entries
    with _lock:
        _entries = None
    plans.forget()
