"""cula-sm89: the fp32 KDA prefill for Ada (sm_89) and newer NVIDIA GPUs: CUDA C++ kernels, a pybind11 module
(`cula_sm89._C`) and a C ABI library (`libcula_sm89.so`, header `cula_sm89.h`) for callers outside Python.

The kernels register with cula_core through the `cula.backends` entry point (see `backend.py`): import `cula`
and call its ops (`kda_prefill`, or `chunk_kda` without autograd) rather than this package. `cula_sm89.ops`
holds the thin launcher (`prefill` takes prepared fp32 tensors and exposes the chunk size and the intra-chunk
buffers w, u for tests). docs/sm89.md describes the kernels, their numerics and their limits.
"""

from importlib import metadata as _metadata
from pathlib import Path as _Path

try:
    __version__ = _metadata.version("cula-sm89")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

_HERE = _Path(__file__).resolve().parent


def library_path() -> str:
    """Path of libcula_sm89.so, the C ABI library (for ctypes or a C/C++ build)."""
    return str(_HERE / "libcula_sm89.so")


def include_dir() -> str:
    """Folder holding cula_sm89.h: the wheel's include/, or csrc/ of a source checkout (editable install)."""
    shipped = _HERE / "include"
    if (shipped / "cula_sm89.h").is_file():
        return str(shipped)
    return str(_HERE.parents[1] / "csrc")
