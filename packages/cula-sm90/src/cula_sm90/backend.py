"""The sm90 backend object that cula_core discovers through the `cula.backends` entry point.

The package holds two kernel families, each a subpackage that owns its ops:
  * `cula_sm90.decode`:  kda_decode, kda_decode_mtp, kda_decode_mtp_kvbuffer, kda_flush_kvbuffer,
                         kda_flush_kvbuffer_all_layers (multi-token-prediction decode for speculative decoding)
  * `cula_sm90.prefill`: kda_prefill and the no-grad forward of chunk_kda, with intra-card context parallel

Each subpackage's `__init__` exports `OPS` (the ops it serves), `INT32_INDEXING` (whether its kernels compute
element offsets in int32: the prefill kernels do, the decode kernels use 64-bit offsets for pools of any
size), `unsupported_reason(call)` and `kernel(op)`, and imports no CuTe DSL at module level: importing the backend stays cheap and works without a GPU; the kernels
are compiled on first use.
"""

from __future__ import annotations

from cula_core.backend import Backend, CallConfig

from cula_sm90 import decode, prefill

_FAMILIES = (decode, prefill)


def _family(op: str):
    for fam in _FAMILIES:
        if op in fam.OPS:
            return fam
    return None


class Sm90Backend(Backend):
    name = "sm90"
    package = "cula-sm90"
    arch = (9, 0)
    capabilities = ((9, 0),)  # sm_90a instructions (wgmma, setmaxnreg) exist on Hopper only
    ops = tuple(op for fam in _FAMILIES for op in fam.OPS)

    def indexes_in_int32(self, op: str) -> bool:
        fam = _family(op)
        return fam is not None and fam.INT32_INDEXING

    def unsupported_reason(self, call: CallConfig) -> str | None:
        fam = _family(call.op)
        if fam is None:
            return f"sm90 does not implement {call.op}"
        return fam.unsupported_reason(call)

    def kernel(self, op: str):
        fam = _family(op)
        if fam is None:
            raise NotImplementedError(f"backend {self.name!r} has no kernel for {op}")
        return fam.kernel(op)


backend = Sm90Backend()
