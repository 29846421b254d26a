"""cula-sm89: Ada (sm_89) fp32 KDA prefill: CUDA C++ kernels with pybind11 bindings and a C ABI library

The kernels register with cula_core through the `cula.backends` entry point (see `backend.py`); import
`cula` and call its ops rather than importing this package.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("cula-sm89")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
