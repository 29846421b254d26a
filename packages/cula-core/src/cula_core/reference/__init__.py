"""cula_core.reference: the KDA math in plain PyTorch (CPU or any GPU), the definition kernels are tested against.

gates             l2norm and the two log-decay gates (softplus, lower-bound/"safe"), FLA 0.6.0 conventions
recurrent         token-by-token recurrence (the definition), fixed length and varlen; over a state pool
chunk             chunked WY form with FLA-layout intermediates (Aqk, Akk, w, u, h, v_new); per-chunk states
decode            serving: multi-token-prediction decode over a state pool, commit of accepted tokens
context_parallel  per-piece affine state maps and the split/scan/rerun scheme context parallelism uses
"""

from .chunk import ChunkIntermediates, chunk_kda_reference, chunk_kda_states_reference
from .context_parallel import context_parallel_reference, piece_affine_map, split_at_chunks
from .decode import commit_accepted_reference, decode_mtp_reference, decode_step_reference
from .gates import activate_beta, kda_gate, l2norm, log_decay, safe_gate, softplus_gate
from .recurrent import recurrent_kda, recurrent_kda_pool

__all__ = [
    "ChunkIntermediates",
    "activate_beta",
    "chunk_kda_reference",
    "chunk_kda_states_reference",
    "commit_accepted_reference",
    "context_parallel_reference",
    "decode_mtp_reference",
    "decode_step_reference",
    "kda_gate",
    "l2norm",
    "log_decay",
    "piece_affine_map",
    "recurrent_kda",
    "recurrent_kda_pool",
    "safe_gate",
    "softplus_gate",
    "split_at_chunks",
]
