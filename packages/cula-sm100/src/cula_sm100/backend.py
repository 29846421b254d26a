"""The sm100 backend object that cula_core discovers through the `cula.backends` entry point.

The training path of `chunk_kda`, in two subpackages:
  * `cula_sm100.forward`:  the forward that saves what backward needs (chunk_kda)
  * `cula_sm100.backward`: its backward (chunk_kda_backward)

Each subpackage's `__init__` exports `OPS`, `unsupported_reason(call)` and `kernel(op)`, and imports no CuTe
DSL at module level, so importing the backend stays cheap and works without a GPU.
"""

from __future__ import annotations

from cula_core.backend import Backend, CallConfig

from cula_sm100 import backward, forward

_FAMILIES = (forward, backward)


def _family(op: str):
    for fam in _FAMILIES:
        if op in fam.OPS:
            return fam
    return None


class Sm100Backend(Backend):
    name = "sm100"
    package = "cula-sm100"
    arch = (10, 0)
    # The training kernels use warp-level MMA that also runs on Hopper, where no other backend trains.
    capabilities = ((10, 0), (10, 3), (9, 0))
    ops = tuple(op for fam in _FAMILIES for op in fam.OPS)

    def unsupported_reason(self, call: CallConfig) -> str | None:
        fam = _family(call.op)
        if fam is None:
            return f"sm100 does not implement {call.op}"
        return fam.unsupported_reason(call)

    def kernel(self, op: str):
        fam = _family(op)
        if fam is None:
            raise NotImplementedError(f"backend {self.name!r} has no kernel for {op}")
        return fam.kernel(op)


backend = Sm100Backend()
