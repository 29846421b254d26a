"""The sm100 backend object that cula_core discovers through the `cula.backends` entry point.

Kernels: none yet (the training forward and backward come in their own issues); until then this backend
serves no op and every call it would take falls back to the reference with a warning that says so.
"""

from cula_core.backend import Backend


class Sm100Backend(Backend):
    name = "sm100"
    package = "cula-sm100"
    arch = (10, 0)
    # The training kernels use warp-level MMA that also runs on Hopper, where no other backend trains.
    capabilities = ((10, 0), (10, 3), (9, 0))
    ops = ()


backend = Sm100Backend()
