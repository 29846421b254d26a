"""Serving-side reference for KDA decode over a state pool (continuous batching, multi-token prediction).

A serving engine keeps one recurrent state per live request in a pool ``state_pool [P, HV, K, V]`` (or
``[P, HV, V, K]`` with ``state_v_first=True``; fp32 or bf16: the math runs in at least fp32 and a state is
rounded to the pool's dtype only when stored) and addresses it through ``cache_idx [N]`` (negative = padded
batch slot, no request; so is ``null_slot``, the slot an engine reserves for padding, when given). Three
operations:

* :func:`decode_mtp_reference` runs ``T`` draft tokens per request from its pooled state and returns the
  outputs and the state after every token, leaving the pool untouched (drafts may be rejected).
* :func:`commit_accepted_reference` writes, per request, the state after its ``m`` accepted tokens back to
  the pool (``m == 0``: nothing written).
* :func:`decode_step_reference` is the ordinary one-token step (``T == 1``), updating the pool in place.

Token tensors use FLA's ``fused_recurrent_kda`` batch layout with one row per request, ``[N, T, ...]``
(``T == 1`` for the plain step, as FLA's continuous-batching decode with ``ssm_state_indices [N]``).
Inputs are final: q/k normalised, g a log decay, beta post-sigmoid. No autograd is intended here.
"""

from __future__ import annotations

import torch

from .recurrent import _compute_dtype, _expand_qk_heads, _scan

__all__ = ["commit_accepted_reference", "decode_mtp_reference", "decode_step_reference"]


def _active_rows(cache_idx: torch.Tensor, P: int, null_slot: int | None = None) -> torch.Tensor:
    """Rows ``i`` with ``cache_idx[i] >= 0`` and ``!= null_slot``, after checking they address the pool."""
    if cache_idx.dim() != 1:
        raise ValueError(f"cache_idx: expected shape [N], got {tuple(cache_idx.shape)}")
    live = cache_idx >= 0
    if null_slot is not None:
        live &= cache_idx != null_slot
    rows = live.nonzero().squeeze(1)
    if rows.numel() and int(cache_idx[rows].max()) >= P:
        raise ValueError(f"cache_idx: entries must be < pool size {P}, got max {int(cache_idx[rows].max())}")
    return rows


def decode_mtp_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    cache_idx: torch.Tensor,
    scale: float | None = None,
    *,
    state_v_first: bool = False,
    null_slot: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``T`` (draft) tokens per request from its pooled state; the pool is only read.

    Computes in the promoted dtype of the inputs and the pool (at least fp32): the state stays in that dtype
    through the T tokens and is rounded to the pool's dtype only in the returned per-token states.

    Args:
        q: ``[N, T, HQK, K]``; k: ``[N, T, HQK, K]``.
        v: ``[N, T, HV, V]`` (``HV % HQK == 0``).
        g: ``[N, T, HV, K]`` log decay; beta: ``[N, T, HV]``.
        state_pool: ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`) float (fp32 or bf16 in
            serving); never modified.
        cache_idx: ``[N]`` integer pool slot per request; any negative value marks a padded slot.
        scale: multiplies q; default ``K ** -0.5``.
        state_v_first: the pool's layout (FLA's flag): each state stored transposed, ``[V, K]``.
        null_slot: a slot index that marks a padded request as a negative one does (None: none does).

    Returns:
        ``o [N, T, HV, V]`` (compute dtype) and ``states [N, T, HV, K, V]`` (``[N, T, HV, V, K]`` V-first;
        ``state_pool.dtype``): ``states[i, t]`` is request ``i``'s state after its token ``t``. Padded slots
        get zeros in both and their (meaningless) pool entry is never read.
    """
    N, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    dtype = torch.promote_types(_compute_dtype(q, k, v, g, beta, state_pool), torch.float32)
    rows = _active_rows(cache_idx, state_pool.shape[0], null_slot)

    o = q.new_zeros(N, T, HV, V, dtype=dtype)
    states = state_pool.new_zeros(N, T, *state_pool.shape[1:])
    if rows.numel():
        qa, ka = (_expand_qk_heads(x[rows].to(dtype), HV) for x in (q, k))
        va, ga, ba = (x[rows].to(dtype) for x in (v, g, beta))
        S0 = state_pool[cache_idx[rows].long()].to(dtype)
        o_a, _, st = _scan(qa, ka, va, ga, ba, scale, S0.transpose(-1, -2) if state_v_first else S0,
                           keep_states=True)
        o[rows] = o_a
        states[rows] = (st.transpose(-1, -2) if state_v_first else st).to(state_pool.dtype)
    return o, states


def commit_accepted_reference(
    state_pool: torch.Tensor,
    cache_idx: torch.Tensor,
    states: torch.Tensor,
    accept_len: int | torch.Tensor,
    *,
    null_slot: int | None = None,
) -> torch.Tensor:
    """Write each request's state after its accepted tokens into the pool, in place.

    For request ``i`` with ``cache_idx[i] >= 0`` and ``m = accept_len[i] > 0``:
    ``state_pool[cache_idx[i]] = states[i, m - 1]``. Requests with ``m == 0`` and padded slots leave the
    pool bitwise untouched. Active ``cache_idx`` entries are expected to be distinct.

    Args:
        state_pool: ``[P, HV, K, V]`` float (either layout: the states are in the pool's), updated in place.
        cache_idx: ``[N]`` integer pool slots (negative, or ``null_slot``, = padded).
        states: ``[N, T, HV, K, V]`` per-token states from :func:`decode_mtp_reference`, in the pool's layout.
        accept_len: Python int (same for all requests) or ``[N]`` integer tensor, each in ``[0, T]``.
        null_slot: as in :func:`decode_mtp_reference`.

    Returns:
        ``state_pool`` (the same tensor).
    """
    N, T = states.shape[:2]
    m = torch.as_tensor(accept_len, device=states.device).long()
    m = m.expand(N) if m.dim() == 0 else m.to(states.device)
    if m.shape != (N,):
        raise ValueError(f"accept_len: expected an int or shape [{N}], got shape {tuple(m.shape)}")
    if N and (int(m.min()) < 0 or int(m.max()) > T):
        raise ValueError(f"accept_len: entries must be in [0, {T}], got {m.tolist()}")
    rows = _active_rows(cache_idx, state_pool.shape[0], null_slot).to(states.device)
    rows = rows[m[rows] > 0]
    if rows.numel():
        slots = cache_idx.to(states.device)[rows].long().to(state_pool.device)
        state_pool[slots] = states[rows, m[rows] - 1].to(state_pool.device, state_pool.dtype)
    return state_pool


def decode_step_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    cache_idx: torch.Tensor,
    scale: float | None = None,
    *,
    state_v_first: bool = False,
    null_slot: int | None = None,
) -> torch.Tensor:
    """One decode token per request; updates ``state_pool`` in place and returns the outputs.

    Args:
        q: ``[N, 1, HQK, K]``; k: ``[N, 1, HQK, K]``.
        v: ``[N, 1, HV, V]``; g: ``[N, 1, HV, K]`` log decay; beta: ``[N, 1, HV]``.
        state_pool: ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`) float (fp32 or bf16 in
            serving); the slots of live requests are advanced by one token, every other slot is left bitwise
            untouched.
        cache_idx: ``[N]`` integer pool slots (negative, or ``null_slot``, = padded: output zeros, pool not
            touched).
        scale: multiplies q; default ``K ** -0.5``.
        state_v_first, null_slot: as in :func:`decode_mtp_reference`.

    Returns:
        ``o [N, 1, HV, V]`` in the promoted dtype of the inputs and pool (at least fp32).
    """
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q: expected shape [N, 1, HQK, K] for one decode step, got {tuple(q.shape)}")
    o, states = decode_mtp_reference(q, k, v, g, beta, state_pool, cache_idx, scale, state_v_first=state_v_first,
                                     null_slot=null_slot)
    commit_accepted_reference(state_pool, cache_idx, states, 1, null_slot=null_slot)
    return o
