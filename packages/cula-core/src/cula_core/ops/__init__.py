"""The public KDA ops, a module per op family; each is a torch custom op (``torch.ops.cula.*``) with a
fake implementation, dispatched at run time by `cula_core.dispatch`."""

from cula_core.ops.chunk_kda import chunk_kda
from cula_core.ops.decode import kda_decode, kda_decode_mtp
from cula_core.ops.fused_recurrent import fused_recurrent_kda
from cula_core.ops.kvbuffer import kda_decode_mtp_kvbuffer, kda_flush_kvbuffer, kda_flush_kvbuffer_all_layers
from cula_core.ops.prefill import kda_prefill

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "kda_decode",
    "kda_decode_mtp",
    "kda_decode_mtp_kvbuffer",
    "kda_flush_kvbuffer",
    "kda_flush_kvbuffer_all_layers",
    "kda_prefill",
]
