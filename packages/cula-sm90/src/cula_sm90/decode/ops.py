"""The decode ops in the kernel calling convention of docs/backends.md (cula_core/reference_backend.py is
the executable specification): each prepares nothing core has not, and launches the kernels of launch.py.

Pools of another dtype than fp32 / bf16 are declined through the CallConfig (its `state_dtype` option); one that
is not 16-byte aligned, which the CallConfig cannot tell, runs the reference implementation here instead of a
kernel. `state_v_first` and `null_slot` (keywords of the calling convention, given only when set) go to the
kernels: the layout as a compile-time key, the null slot as a runtime argument."""

from __future__ import annotations

import torch

from cula_core import reference_backend
from cula_sm90.decode import configs, launch


def _kernel_can_take(state_pool: torch.Tensor) -> bool:
    return state_pool.dtype in configs.POOL_DTYPES and state_pool.data_ptr() % 16 == 0


def kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                   use_qk_l2norm_in_kernel, output_per_token_states, **pool):
    if not _kernel_can_take(state_pool):
        return reference_backend.kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                                                lower_bound=lower_bound,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                output_per_token_states=output_per_token_states, **pool)
    mode = configs.MODE_STATES if output_per_token_states else configs.MODE_FINAL
    return launch.run_recurrent(mode, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                                lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **pool)


def kda_decode(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
               use_qk_l2norm_in_kernel, **pool):
    o, _ = kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                          lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          output_per_token_states=False, **pool)
    return o


def kda_decode_mtp_kvbuffer(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                            use_qk_l2norm_in_kernel, **pool):
    if not _kernel_can_take(state_pool):
        return reference_backend.kda_decode_mtp_kvbuffer(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                                         scale=scale, lower_bound=lower_bound,
                                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **pool)
    return launch.run_recurrent(configs.MODE_KVBUFFER, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                scale=scale, lower_bound=lower_bound,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **pool)


def kda_flush_kvbuffer_all_layers(state_pools, cache_idx, kvbuffers, accept_len, accept_len_all, **pool):
    """`pool`: the calling convention's state_v_first / null_slot keywords (only those that are set)."""
    kvbuffers = [launch._aligned(b) for b in kvbuffers]
    if not all(_kernel_can_take(p) for p in state_pools):
        return reference_backend.kda_flush_kvbuffer_all_layers(state_pools, cache_idx, kvbuffers, accept_len,
                                                               accept_len_all, **pool)
    launch.run_flush(list(state_pools), cache_idx, kvbuffers, accept_len, accept_len_all, **pool)


def kda_flush_kvbuffer(state_pool, cache_idx, kvbuffer, accept_len, accept_len_all, **pool):
    kda_flush_kvbuffer_all_layers([state_pool], cache_idx, [kvbuffer], accept_len, accept_len_all, **pool)


KERNELS = {
    "kda_decode": kda_decode,
    "kda_decode_mtp": kda_decode_mtp,
    "kda_decode_mtp_kvbuffer": kda_decode_mtp_kvbuffer,
    "kda_flush_kvbuffer": kda_flush_kvbuffer,
    "kda_flush_kvbuffer_all_layers": kda_flush_kvbuffer_all_layers,
}
