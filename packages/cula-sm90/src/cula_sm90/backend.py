"""The sm90 backend object that cula_core discovers through the `cula.backends` entry point.

The package holds two kernel families, each a subpackage that owns its ops:
  * `cula_sm90.decode`:  kda_decode, kda_decode_mtp, kda_decode_mtp_kvbuffer, kda_flush_kvbuffer,
                         kda_flush_kvbuffer_all_layers (multi-token-prediction decode for speculative decoding)
  * `cula_sm90.prefill`: kda_prefill and the no-grad forward of chunk_kda, with intra-card context parallel

Each subpackage's `__init__` exports what `cula_core.backend.ComposedBackend` asks of a family: `OPS`,
`INT32_INDEXING` (the prefill kernels compute element offsets in int32; the decode kernels use 64-bit offsets,
for pools of any size), `unsupported_reason(call)` and `kernel(op)`. None imports CuTe DSL at module level:
importing the backend stays cheap and works without a GPU; the kernels are compiled on first use.
"""

from __future__ import annotations

from cula_core.backend import ComposedBackend

from cula_sm90 import decode, prefill


class Sm90Backend(ComposedBackend):
    name = "sm90"
    package = "cula-sm90"
    arch = (9, 0)
    capabilities = ((9, 0),)  # sm_90a instructions (wgmma, setmaxnreg) exist on Hopper only
    families = (decode, prefill)


backend = Sm90Backend()
