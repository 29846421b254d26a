"""The sm89 backend object that cula_core discovers through the `cula.backends` entry point.

Kernels: none yet (they come with the Ada prefill issue); until then this backend serves no op and every
call it would take falls back to the reference with a warning that says so.
"""

from cula_core.backend import Backend


class Sm89Backend(Backend):
    name = "sm89"
    package = "cula-sm89"
    arch = (8, 9)
    # Built as sm_89 and sm_90 SASS plus compute_89 PTX, so it runs on Ada, Hopper and later chips.
    capabilities = ((8, 9), (9, 0), (10, 0), (10, 3), (12, 0))
    ops = ()


backend = Sm89Backend()
