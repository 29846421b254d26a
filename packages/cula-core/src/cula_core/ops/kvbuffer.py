"""The verify/flush pair of speculative decoding: `kda_decode_mtp_kvbuffer` computes the outputs of T
draft tokens without writing T per-token states, and `kda_flush_kvbuffer` later makes the pool hold the
state after the accepted prefix of m tokens, as a rank-m update of the old state.

The KVBuffer ``[N, T, HV, 2K + V]`` fp32 (2K + V numbers per token instead of K·V) holds, for request
i, token t (1-based) and value head hv, with k_t the (normalised) key, g_t the log decay,
G_t = g_1 + ... + g_t, D_t = diag(exp(g_t)) and S_t the state after t tokens:
    [0:K]      k_t
    [K:2K]     G_t
    [2K:2K+V]  delta_t = beta_t * (v_t - (D_t S_{t-1})^T k_t)
so that S_t = D_t S_{t-1} + k_t delta_t^T and, unrolled, for any accepted length m:
    S_m = diag(exp(G_m)) S_0 + sum_{t <= m} (exp(G_m - G_t) * k_t) delta_t^T
Every backend reads and writes this layout: verify and flush may run on different backends. The KVBuffer is
fp32 whatever the pool's dtype (fp32 or bf16) and layout (``state_v_first``); the flush computes in fp32 and
rounds the rebuilt state to the pool's dtype once.
"""

from __future__ import annotations


import functools

import torch
from torch import Tensor

from cula_core import plans
from cula_core.cute_runtime import plan_table
from cula_core.dispatch import on_input_device
from cula_core.ops._common import call_op, make_call, run, select
from cula_core.ops.decode import decode_kernel, decode_plan, pool_kwargs, pool_options, validate_decode_call
from cula_core.validation import kvbuffer_dtype, kvbuffer_shape, require_disjoint, validate_kvbuffer


def _kda_decode_mtp_kvbuffer(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cache_idx: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, scale: float, lower_bound: float | None,
    use_qk_l2norm_in_kernel: bool, state_v_first: bool = False,
    null_slot: int | None = None,
) -> tuple[Tensor, Tensor]:
    kernel = decode_kernel("kda_decode_mtp_kvbuffer", q, v, state_pool, scale, lower_bound, use_qk_l2norm_in_kernel,
                           state_v_first, null_slot)
    return kernel(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)


_kda_decode_mtp_kvbuffer_op = torch.library.custom_op("cula::kda_decode_mtp_kvbuffer", _kda_decode_mtp_kvbuffer,
                                                          mutates_args=())


@_kda_decode_mtp_kvbuffer_op.register_fake
def _(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale, lower_bound, use_qk_l2norm_in_kernel,
      state_v_first=False, null_slot=None):
    N, T, HV, V = v.shape
    return torch.empty_like(v), state_pool.new_empty(kvbuffer_shape(N, T, HV, q.shape[3], V),
                                                     dtype=kvbuffer_dtype(state_pool.dtype))


def _flush_call(op: str, pool: Tensor, kvbuffer: Tensor, state_v_first: bool, null_slot: int | None, **options):
    """A flush's CallConfig: `dtype` is the KVBuffer's, the pool's dtype and layout are options (pool_options)."""
    HV = pool.shape[1]
    K = pool.shape[3] if state_v_first else pool.shape[2]
    V = kvbuffer.shape[3] - 2 * K
    return make_call(op, pool.device, dtype=kvbuffer.dtype, K=K, V=V, HQK=HV, HV=HV, T=kvbuffer.shape[1],
                     gate="precomputed", **pool_options(pool, state_v_first, null_slot), **options)


def _kda_flush_kvbuffer(
    state_pool: Tensor, cache_idx: Tensor, kvbuffer: Tensor, accept_len: Tensor | None, accept_len_all: int,
    state_v_first: bool = False, null_slot: int | None = None,
) -> None:
    flush_kernel(state_pool, kvbuffer, state_v_first, null_slot)(state_pool, cache_idx, kvbuffer, accept_len,
                                                                 accept_len_all)


_kda_flush_kvbuffer_op = torch.library.custom_op("cula::kda_flush_kvbuffer", _kda_flush_kvbuffer,
                                                     mutates_args=("state_pool",))


@_kda_flush_kvbuffer_op.register_fake
def _(state_pool, cache_idx, kvbuffer, accept_len, accept_len_all, state_v_first=False, null_slot=None):
    return None


def _kda_flush_kvbuffer_all_layers(
    state_pools: list[Tensor], cache_idx: Tensor, kvbuffers: list[Tensor], accept_len: Tensor | None,
    accept_len_all: int, state_v_first: bool = False, null_slot: int | None = None,
) -> None:
    call = _flush_call("kda_flush_kvbuffer_all_layers", state_pools[0], kvbuffers[0], state_v_first, null_slot,
                       layers=len(state_pools))
    sizes = {f"state_pools[{i}]": p for i, p in enumerate(state_pools)}
    run(call, sizes, state_pools, cache_idx, kvbuffers, accept_len, accept_len_all,
        **pool_kwargs(state_v_first, null_slot))


_kda_flush_kvbuffer_all_layers_op = torch.library.custom_op(
    "cula::kda_flush_kvbuffer_all_layers", _kda_flush_kvbuffer_all_layers, mutates_args=("state_pools",))


@_kda_flush_kvbuffer_all_layers_op.register_fake
def _(state_pools, cache_idx, kvbuffers, accept_len, accept_len_all, state_v_first=False, null_slot=None):
    return None


@on_input_device
def kda_decode_mtp_kvbuffer(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    cache_idx: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    null_slot: int | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Verify T draft tokens per request: all T outputs, and the KVBuffer that `kda_flush_kvbuffer`
    turns into the state after any accepted prefix. The pool is only read.

    Args: as `kda_decode_mtp` (q, k ``[N, T, HQK, K]``; v ``[N, T, HV, V]``; raw g ``[N, T, HV, K]``;
        beta ``[N, T, HV]``; state_pool ``[P, HV, K, V]`` or, with `state_v_first`, ``[P, HV, V, K]``, fp32 or
        bf16; cache_idx ``[N]`` int32, negative or `null_slot` = padded).

    Returns:
        ``(o, kvbuffer)``: o ``[N, T, HV, V]`` in v's dtype; kvbuffer ``[N, T, HV, 2K + V]`` fp32 (fp64 beside an
        fp64 reference pool) in the layout of this module's docstring (zeros for padded slots).
    """
    tensors = (q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)
    scalars = (scale, lower_bound, use_qk_l2norm_in_kernel, state_v_first, null_slot)
    o = plans.run_compiled(plan_table.KDA_DECODE_MTP_KVBUFFER, scalars, tensors)  # a repeat without Python host work
    if o is not None:
        return o, plan_table.next_result(o)
    key = plans.signature("kda_decode_mtp_kvbuffer", tensors, scalars)
    if key is not None:
        return (plans.lookup(key) or decode_plan(key, "kda_decode_mtp_kvbuffer", tensors, *scalars))(*tensors)
    _shapes, tensors, params, scale = validate_decode_call(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                                          scale, lower_bound, state_v_first=state_v_first,
                                                          null_slot=null_slot)
    return call_op(torch.ops.cula.kda_decode_mtp_kvbuffer, _kda_decode_mtp_kvbuffer, *tensors, state_pool,
                   cache_idx, *params, scale, None if lower_bound is None else float(lower_bound),
                   bool(use_qk_l2norm_in_kernel), bool(state_v_first), null_slot)


def _split_accept_len(accept_len) -> tuple[Tensor | None, int]:
    return (None, int(accept_len)) if isinstance(accept_len, int) else (accept_len, 0)


def flush_kernel(state_pool: Tensor, kvbuffer: Tensor, state_v_first: bool, null_slot: int | None):
    """The backend's `kda_flush_kvbuffer` for a validated call (its indexing limit applied), bound to the pool's
    layout: it takes (state_pool, cache_idx, kvbuffer, accept_len or None, accept_len_all)."""
    call = _flush_call("kda_flush_kvbuffer", state_pool, kvbuffer, state_v_first, null_slot)
    kernel = select(call, {"state_pool": state_pool, "kvbuffer": kvbuffer}).kernel("kda_flush_kvbuffer")
    return functools.partial(kernel, **pool_kwargs(state_v_first, null_slot))


def flush_plan(state_pool, cache_idx, kvbuffer, accept_len, accept_len_all, state_v_first, null_slot):
    """The plan (cula_core.plans) of a `kda_flush_kvbuffer` call (accept_len: the [N] tensor or None, with
    accept_len_all the int for every request): validate, then `flush_kernel`. Takes (state_pool, cache_idx,
    kvbuffer, accept_len)."""
    validate_kvbuffer("kvbuffer", kvbuffer, state_pool, cache_idx,
                      accept_len_all if accept_len is None else accept_len, state_v_first=state_v_first,
                      null_slot=null_slot)
    return functools.partial(_run_flush, flush_kernel(state_pool, kvbuffer, state_v_first, null_slot),
                             accept_len_all)


def _run_flush(kernel, accept_len_all, state_pool, cache_idx, kvbuffer, accept_len):
    kernel(state_pool, cache_idx, kvbuffer, accept_len, accept_len_all)


@on_input_device
def kda_flush_kvbuffer(state_pool: Tensor, cache_idx: Tensor, kvbuffer: Tensor, accept_len: Tensor | int, *,
                       state_v_first: bool = False, null_slot: int | None = None) -> None:
    r"""Commit the accepted prefix: for each live request i with m = accept_len[i] > 0, make
    ``state_pool[cache_idx[i]]`` the state after its first m verified tokens; m = 0 and padded slots leave
    the pool as it was. In place.

    Args:
        state_pool: ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`) fp32 or bf16, the pool the verify
            step read (unchanged since); a rebuilt state is computed in fp32 and stored in the pool's dtype.
        cache_idx: ``[N]`` int32, the verify step's indices.
        kvbuffer: ``[N, T, HV, 2K + V]`` fp32 from `kda_decode_mtp_kvbuffer`.
        accept_len: an int in ``[0, T]`` for every request, or ``[N]`` int32 on the pool's device (read at
            run time: one compiled kernel serves every accept length).
        state_v_first, null_slot: keyword only, as in `kda_decode` (the verify step's).
    """
    key = None
    if isinstance(accept_len, (int, Tensor)) and not isinstance(accept_len, bool):
        accept_tensor, accept_all = _split_accept_len(accept_len)
        key = plans.signature("kda_flush_kvbuffer", (state_pool, cache_idx, kvbuffer, accept_tensor),
                              (accept_all, state_v_first, null_slot))
    if key is not None:
        plan = plans.lookup(key) or plans.remember(key, flush_plan(state_pool, cache_idx, kvbuffer, accept_tensor,
                                                                   accept_all, state_v_first, null_slot))
        plan(state_pool, cache_idx, kvbuffer, accept_tensor)
        torch.autograd.graph.increment_version(state_pool)
        return
    validate_kvbuffer("kvbuffer", kvbuffer, state_pool, cache_idx, accept_len, state_v_first=state_v_first,
                      null_slot=null_slot)
    call_op(torch.ops.cula.kda_flush_kvbuffer, _kda_flush_kvbuffer, state_pool, cache_idx, kvbuffer.contiguous(),
            *_split_accept_len(accept_len), bool(state_v_first), null_slot, mutated=(state_pool,))


@on_input_device
def kda_flush_kvbuffer_all_layers(
    state_pools: list[Tensor], cache_idx: Tensor, kvbuffers: list[Tensor], accept_len: Tensor | int, *,
    state_v_first: bool = False, null_slot: int | None = None,
) -> None:
    r"""`kda_flush_kvbuffer` for all L layers in one call (one launch on the kernel backends).

    Args:
        state_pools: L pools ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`), fp32 or bf16 (one per
            layer, same shape and dtype, no two sharing memory).
        cache_idx: ``[N]`` int32, shared by the layers.
        kvbuffers: L KVBuffers ``[N, T, HV, 2K + V]`` fp32, ``kvbuffers[l]`` from layer l's verify.
        accept_len: int or ``[N]`` int32, shared by the layers.
        state_v_first, null_slot: keyword only, as in `kda_decode`.
    """
    if not isinstance(state_pools, (list, tuple)) or not isinstance(kvbuffers, (list, tuple)):
        raise TypeError(f"state_pools and kvbuffers must be lists of tensors, got {type(state_pools).__name__} "
                        f"and {type(kvbuffers).__name__}")
    if len(state_pools) == 0 or len(state_pools) != len(kvbuffers):
        raise ValueError(f"state_pools and kvbuffers must hold one tensor per layer (L >= 1), got "
                         f"{len(state_pools)} pools and {len(kvbuffers)} buffers")
    for layer, (pool, buf) in enumerate(zip(state_pools, kvbuffers, strict=True)):
        validate_kvbuffer(f"kvbuffers[{layer}]", buf, pool, cache_idx, accept_len, state_v_first=state_v_first,
                          null_slot=null_slot)
        if pool.dtype != state_pools[0].dtype:
            raise TypeError(f"every layer's pool must have the dtype of layer 0's, got state_pools[{layer}] "
                            f"{pool.dtype} vs {state_pools[0].dtype}")
        if pool.shape != state_pools[0].shape or buf.shape != kvbuffers[0].shape:
            raise ValueError(f"every layer must have the shapes of layer 0: state_pools[{layer}] "
                             f"{list(pool.shape)}, kvbuffers[{layer}] {list(buf.shape)} vs "
                             f"{list(state_pools[0].shape)}, {list(kvbuffers[0].shape)}")
    require_disjoint("state_pools", state_pools)
    pools = list(state_pools)
    call_op(torch.ops.cula.kda_flush_kvbuffer_all_layers, _kda_flush_kvbuffer_all_layers, pools, cache_idx,
            [b.contiguous() for b in kvbuffers], *_split_accept_len(accept_len), bool(state_v_first), null_slot,
            mutated=(pools,))
