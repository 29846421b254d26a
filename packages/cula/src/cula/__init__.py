"""cula: fast KDA (Kimi Delta Attention) kernels behind FLA's API.

This meta-package re-exports the public API of `cula_core`; the kernels live in the arch packages that
its extras install (`cula[sm89]`, `cula[sm90]`, `cula[sm100]`) and are found at first use.
"""

from importlib import metadata as _metadata

import cula_core as _core
from cula_core import *  # noqa: F403 - the public API, listed in cula_core.__all__

__all__ = list(_core.__all__)

try:
    __version__ = _metadata.version("cula")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
