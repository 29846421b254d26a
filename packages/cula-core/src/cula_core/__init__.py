"""cula_core: the public KDA ops of cula, with FLA 0.6.0's signatures.

Each op validates its inputs, then runs on the best installed arch backend (`cula-sm89`, `cula-sm90`,
`cula-sm100`, found through the ``cula.backends`` entry points at first use) or on the reference math
of `cula_core.reference`. Importing this package neither scans for backends nor initialises CUDA.
"""

from importlib import metadata as _metadata

from cula_core import reference
from cula_core.dispatch import BackendUnavailableError, CulaFallbackWarning
from cula_core.ops import (
    chunk_kda,
    fused_recurrent_kda,
    kda_decode,
    kda_decode_mtp,
    kda_decode_mtp_kvbuffer,
    kda_flush_kvbuffer,
    kda_flush_kvbuffer_all_layers,
    kda_prefill,
)

try:
    __version__ = _metadata.version("cula-core")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "BackendUnavailableError",
    "CulaFallbackWarning",
    "chunk_kda",
    "fused_recurrent_kda",
    "kda_decode",
    "kda_decode_mtp",
    "kda_decode_mtp_kvbuffer",
    "kda_flush_kvbuffer",
    "kda_flush_kvbuffer_all_layers",
    "kda_prefill",
    "reference",
]
