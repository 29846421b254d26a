"""Reference of the verify/flush pair of speculative decoding (layout: cula_core.ops.kvbuffer).

`mtp_kvbuffer_reference` runs T draft tokens per request in the delta form of the recurrence,
    S_t = D_t S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - (D_t S_{t-1})^T k_t),
and records per token the key, the cumulative log gate G_t and delta_t. `flush_kvbuffer_reference`
rebuilds the state after m accepted tokens from the old state as a rank-m update,
    S_m = diag(exp(G_m)) S_0 + sum_{t <= m} (exp(G_m - G_t) k_t) delta_t^T,
with decays as differences of cumulative log gates (each factor <= 1).
"""

from __future__ import annotations

import torch

from .recurrent import _expand_qk_heads

__all__ = ["flush_kvbuffer_reference", "mtp_kvbuffer_reference"]


def _live_rows(cache_idx: torch.Tensor, P: int) -> torch.Tensor:
    """Requests whose slot is in the pool; the others (negative = padded) are skipped."""
    return ((cache_idx >= 0) & (cache_idx < P)).nonzero().squeeze(1)


def mtp_kvbuffer_reference(q, k, v, g, beta, state_pool, cache_idx, scale=None):
    """Outputs of T draft tokens and their KVBuffer; the pool is only read.

    Args:
        q, k: ``[N, T, HQK, K]`` (normalised); v: ``[N, T, HV, V]``; g: ``[N, T, HV, K]`` log decay;
        beta: ``[N, T, HV]``; state_pool: ``[P, HV, K, V]`` fp32/fp64; cache_idx: ``[N]`` (negative = padded);
        scale: multiplies q, default ``K ** -0.5``.

    Returns:
        ``o [N, T, HV, V]`` and ``kvbuffer [N, T, HV, 2K + V]``, both in the pool's dtype; zeros for
        padded slots.
    """
    N, T, _HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = state_pool.dtype
    o = state_pool.new_zeros(N, T, HV, V)
    buf = state_pool.new_zeros(N, T, HV, 2 * K + V)
    rows = _live_rows(cache_idx, state_pool.shape[0])
    if rows.numel() == 0:
        return o, buf
    qa, ka = (_expand_qk_heads(x[rows].to(dtype), HV) for x in (q, k))
    va, ga, ba = (x[rows].to(dtype) for x in (v, g, beta))
    S = state_pool[cache_idx[rows].long()].clone()
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


def flush_kvbuffer_reference(state_pool, cache_idx, kvbuffer, accept_len):
    """In place: ``state_pool[cache_idx[i]]`` becomes the state after the first ``accept_len[i]`` tokens
    of request i (an int applies to every request); m = 0 and padded slots leave the pool bitwise as it
    was. Returns ``state_pool``.

    Args:
        state_pool: ``[P, HV, K, V]``; cache_idx: ``[N]``; kvbuffer: ``[N, T, HV, 2K + V]``;
        accept_len: int or ``[N]`` integer tensor, each in ``[0, T]``.
    """
    N, T = kvbuffer.shape[:2]
    K = state_pool.shape[2]
    m = torch.as_tensor(accept_len, device=kvbuffer.device).long()
    m = m.expand(N) if m.dim() == 0 else m
    rows = _live_rows(cache_idx, state_pool.shape[0])
    rows = rows[m[rows] > 0]
    if rows.numel() == 0:
        return state_pool
    buf = kvbuffer[rows].to(state_pool.dtype)
    mr = m[rows]
    keys, G, delta = buf[..., :K], buf[..., K : 2 * K], buf[..., 2 * K :]
    G_m = G[torch.arange(rows.numel(), device=buf.device), mr - 1]  # [R, HV, K]
    accepted = (torch.arange(T, device=buf.device)[None, :] < mr[:, None])[:, :, None, None]  # [R, T, 1, 1]
    # Rejected tokens are selected away, not multiplied by 0: their rows may hold anything (an exponent
    # G_m - G_t > 0, a NaN or Inf of a diverged draft), and 0 * Inf or 0 * NaN is NaN.
    coef = torch.where(accepted, torch.exp(G_m.unsqueeze(1) - G) * keys, 0.0)
    delta = torch.where(accepted, delta, 0.0)
    slots = cache_idx[rows].long()
    S0 = state_pool[slots]
    update = torch.einsum("rthk,rthv->rhkv", coef, delta)
    state_pool[slots] = torch.exp(G_m).unsqueeze(-1) * S0 + update
    return state_pool
