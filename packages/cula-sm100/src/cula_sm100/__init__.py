"""cula-sm100: Blackwell (sm_100a) KDA training path, forward and backward with native GVA, in CuTe DSL

The kernels register with cula_core through the `cula.backends` entry point (see `backend.py`); import
`cula` and call its ops rather than importing this package.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("cula-sm100")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
