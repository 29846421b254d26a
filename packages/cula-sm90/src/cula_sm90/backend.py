"""The sm90 backend object that cula_core discovers through the `cula.backends` entry point.

Kernels: none yet (prefill and MTP decode come in their own issues); until then this backend serves no op
and every call it would take falls back to the reference with a warning that says so.
"""

from cula_core.backend import Backend


class Sm90Backend(Backend):
    name = "sm90"
    package = "cula-sm90"
    arch = (9, 0)
    capabilities = ((9, 0),)  # sm_90a instructions (wgmma, setmaxnreg) exist on Hopper only
    ops = ()


backend = Sm90Backend()
