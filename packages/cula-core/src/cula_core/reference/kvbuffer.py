"""Reference of the verify/flush pair of speculative decoding (layout: cula_core.ops.kvbuffer).

`mtp_kvbuffer_reference` runs T draft tokens per request in the delta form of the recurrence,
    S_t = D_t S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - (D_t S_{t-1})^T k_t),
and records per token the key, the cumulative log gate G_t and delta_t. `flush_kvbuffer_reference`
rebuilds the state after m accepted tokens from the old state as a rank-m update,
    S_m = diag(exp(G_m)) S_0 + sum_{t <= m} (exp(G_m - G_t) k_t) delta_t^T,
with decays as differences of cumulative log gates (each factor <= 1). Both take pools ``[P, HV, K, V]`` or,
with ``state_v_first=True``, ``[P, HV, V, K]``, fp32 or bf16: the KVBuffer and all math are fp32 (fp64 beside an
fp64 pool) and a flushed state is rounded to the pool's dtype once, when stored.
"""

from __future__ import annotations

import torch

from .recurrent import _expand_qk_heads

__all__ = ["flush_kvbuffer_reference", "mtp_kvbuffer_reference"]


def _live_rows(cache_idx: torch.Tensor, P: int, null_slot: int | None = None) -> torch.Tensor:
    """Requests whose slot is in the pool; the others (negative or `null_slot` = padded) are skipped."""
    live = (cache_idx >= 0) & (cache_idx < P)
    if null_slot is not None:
        live &= cache_idx != null_slot
    return live.nonzero().squeeze(1)


def _work_dtype(state_pool: torch.Tensor) -> torch.dtype:
    return torch.float64 if state_pool.dtype == torch.float64 else torch.float32


def _load_states(state_pool, slots, dtype, state_v_first):
    """The states of `slots` as ``[R, HV, K, V]`` in `dtype`, whatever the pool's layout."""
    S = state_pool[slots].to(dtype)
    return S.transpose(-1, -2) if state_v_first else S


def mtp_kvbuffer_reference(q, k, v, g, beta, state_pool, cache_idx, scale=None, *, state_v_first=False,
                           null_slot=None):
    """Outputs of T draft tokens and their KVBuffer; the pool is only read.

    Args:
        q, k: ``[N, T, HQK, K]`` (normalised); v: ``[N, T, HV, V]``; g: ``[N, T, HV, K]`` log decay;
        beta: ``[N, T, HV]``; state_pool: ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`) fp32, bf16
        or fp64; cache_idx: ``[N]`` (negative, or `null_slot`, = padded); scale: multiplies q, default
        ``K ** -0.5``.

    Returns:
        ``o [N, T, HV, V]`` and ``kvbuffer [N, T, HV, 2K + V]``, both fp32 (fp64 for an fp64 pool); zeros for
        padded slots.
    """
    N, T, _HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = _work_dtype(state_pool)
    o = state_pool.new_zeros(N, T, HV, V, dtype=dtype)
    buf = state_pool.new_zeros(N, T, HV, 2 * K + V, dtype=dtype)
    rows = _live_rows(cache_idx, state_pool.shape[0], null_slot)
    if rows.numel() == 0:
        return o, buf
    qa, ka = (_expand_qk_heads(x[rows].to(dtype), HV) for x in (q, k))
    va, ga, ba = (x[rows].to(dtype) for x in (v, g, beta))
    S = _load_states(state_pool, cache_idx[rows].long(), dtype, state_v_first)
    G = torch.zeros_like(ga[:, 0])
    for t in range(T):
        kt, gt = ka[:, t], ga[:, t]
        G = G + gt
        S = torch.exp(gt).unsqueeze(-1) * S
        delta = ba[:, t].unsqueeze(-1) * (va[:, t] - torch.einsum("nhkv,nhk->nhv", S, kt))
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        o[rows, t] = torch.einsum("nhkv,nhk->nhv", S, qa[:, t] * scale)
        buf[rows, t] = torch.cat([kt, G, delta], dim=-1)
    return o, buf


def flush_kvbuffer_reference(state_pool, cache_idx, kvbuffer, accept_len, *, state_v_first=False, null_slot=None):
    """In place: ``state_pool[cache_idx[i]]`` becomes the state after the first ``accept_len[i]`` tokens
    of request i (an int applies to every request); m = 0 and padded slots leave the pool bitwise as it
    was. Returns ``state_pool``.

    Args:
        state_pool: ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`), fp32 / bf16 / fp64;
        cache_idx: ``[N]`` (negative, or `null_slot`, = padded); kvbuffer: ``[N, T, HV, 2K + V]``;
        accept_len: int or ``[N]`` integer tensor, each in ``[0, T]``.
    """
    N, T = kvbuffer.shape[:2]
    K = state_pool.shape[3] if state_v_first else state_pool.shape[2]
    m = torch.as_tensor(accept_len, device=kvbuffer.device).long()
    m = m.expand(N) if m.dim() == 0 else m
    rows = _live_rows(cache_idx, state_pool.shape[0], null_slot)
    rows = rows[m[rows] > 0]
    if rows.numel() == 0:
        return state_pool
    dtype = _work_dtype(state_pool)
    buf = kvbuffer[rows].to(dtype)
    mr = m[rows]
    keys, G, delta = buf[..., :K], buf[..., K : 2 * K], buf[..., 2 * K :]
    G_m = G[torch.arange(rows.numel(), device=buf.device), mr - 1]  # [R, HV, K]
    accepted = (torch.arange(T, device=buf.device)[None, :] < mr[:, None])[:, :, None, None]  # [R, T, 1, 1]
    # Rejected tokens are selected away, not multiplied by 0: their rows may hold anything (an exponent
    # G_m - G_t > 0, a NaN or Inf of a diverged draft), and 0 * Inf or 0 * NaN is NaN.
    coef = torch.where(accepted, torch.exp(G_m.unsqueeze(1) - G) * keys, 0.0)
    delta = torch.where(accepted, delta, 0.0)
    slots = cache_idx[rows].long()
    S0 = _load_states(state_pool, slots, dtype, state_v_first)
    update = torch.einsum("rthk,rthv->rhkv", coef, delta)
    S = torch.exp(G_m).unsqueeze(-1) * S0 + update
    state_pool[slots] = (S.transpose(-1, -2) if state_v_first else S).to(state_pool.dtype)
    return state_pool
