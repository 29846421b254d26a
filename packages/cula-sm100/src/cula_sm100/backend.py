"""The sm100 backend object that cula_core discovers through the `cula.backends` entry point.

The training path of `chunk_kda`, in two kernel families (subpackages):
  * `cula_sm100.forward`:  chunk_kda's forward (with gradients wanted, it hands Aqk / Akk to the backward as
                           core's residuals)
  * `cula_sm100.backward`: chunk_kda_backward, recomputing the forward's other intermediates with its kernels

Each subpackage's `__init__` exports what `cula_core.backend.ComposedBackend` asks of a family: `OPS`,
`unsupported_reason(call)` and `kernel(op)`. The kernels form global offsets in 64 bits
(cula_core.cute_kernels.copies.head_rows), so no int32 limit is declared. None imports CuTe DSL at module level,
so importing the backend stays cheap and works without a GPU.
"""

from __future__ import annotations

from cula_core.backend import ComposedBackend

from cula_sm100 import backward, forward


class Sm100Backend(ComposedBackend):
    name = "sm100"
    package = "cula-sm100"
    arch = (10, 0)
    # The training kernels use warp-level MMA that also runs on Hopper, where no other backend trains.
    capabilities = ((10, 0), (10, 3), (9, 0))
    families = (forward, backward)


backend = Sm100Backend()
