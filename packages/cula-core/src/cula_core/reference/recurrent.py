"""Token-by-token reference for KDA (the definition every other path is checked against).

Holds :func:`recurrent_kda` (FLA's ``naive_recurrent_kda`` / ``fused_recurrent_kda`` semantics, plus varlen)
and the private helpers shared by the other reference modules: the per-token scan that can also keep every
intermediate state (used by decode), and the varlen packing helpers (used by the chunked form).

Per sequence and value head ``hv`` (q/k head ``hv // (HV // HQK)``), state ``S`` of shape ``[K, V]``:

    S   = diag(exp(g_t)) S
    S   = S + beta_t * k_t (v_t - S^T k_t)^T
    o_t = S^T (scale * q_t)

Varlen inputs are unpacked into a zero-padded batch ``[N, T_max, ...]``. A padding token has ``g = 0``,
``beta = 0`` and ``k = 0``, so its transition is the identity: the state at the end of the padded row is
the state after the sequence's last real token, and a zero-length sequence returns its initial state.
The loop runs over tokens only; batch and heads are vectorised.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["recurrent_kda", "recurrent_kda_pool"]


# ----------------------------------------------------------------------------------------------------------
# shared helpers (private to cula_core.reference)
# ----------------------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Promoted floating dtype of the given tensors (None entries skipped)."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


def _expand_qk_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """``[B, T, HQK, K]`` -> ``[B, T, HV, K]``: value head ``hv`` reads q/k head ``hv // (HV // HQK)``."""
    HQK = x.shape[2]
    if HV % HQK != 0:
        raise ValueError(f"v: number of value heads HV={HV} must be a multiple of HQK={HQK}")
    return x if HV == HQK else x.repeat_interleave(HV // HQK, dim=2)


def _seq_bounds(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    """``cu_seqlens`` (``[N + 1]`` int tensor or list) as a host list of ints."""
    bounds = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else [int(b) for b in cu_seqlens]
    if len(bounds) < 1 or bounds[0] != 0 or any(b1 < b0 for b0, b1 in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets starting at 0, got {bounds}")
    return bounds


def _pad_time(x: torch.Tensor, T_pad: int) -> torch.Tensor:
    """Zero-pad ``x`` ``[B, T, ...]`` along dim 1 to ``T_pad`` tokens (no copy when already that long)."""
    T = x.shape[1]
    if T_pad == T:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], T_pad - T, *x.shape[2:])], dim=1)


class _Varlen:
    """Index maps between a packed varlen stream ``[1, T, ...]`` and a padded batch ``[N, T_pad, ...]``.

    Sequence ``n`` occupies rows ``n`` of the padded batch, positions ``0 .. len_n - 1``; the rest is zero.
    """

    def __init__(self, bounds: list[int], T_total: int, T_pad: int, device: torch.device):
        if bounds[-1] != T_total:
            raise ValueError(f"cu_seqlens: last offset {bounds[-1]} must equal the token count {T_total}")
        self.bounds = bounds
        self.N = len(bounds) - 1
        self.T_pad = T_pad
        self.lengths = [b1 - b0 for b0, b1 in itertools.pairwise(bounds)]
        # gather: padded (n, t) <- packed token bos_n + t, or the appended zero row T_total for padding
        t = torch.arange(T_pad, device=device)
        bos = torch.tensor(bounds[:-1], device=device, dtype=torch.long)
        lens = torch.tensor(self.lengths, device=device, dtype=torch.long)
        self.gather = torch.where(t[None, :] < lens[:, None], bos[:, None] + t[None, :], T_total)
        # scatter back: packed token i -> flat padded position n * T_pad + (i - bos_n)
        pos = [torch.arange(L, device=device) + n * T_pad for n, L in enumerate(self.lengths)]
        self.unpad = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long, device=device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` -> ``[N, T_pad, ...]`` with zeros past each sequence's end."""
        xz = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])], dim=0)
        return xz[self.gather]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, T_pad, ...]`` -> ``[1, T, ...]`` (the real tokens, in packed order)."""
        return y.reshape(self.N * self.T_pad, *y.shape[2:])[self.unpad].unsqueeze(0)


def _scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    S: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the recurrence over dim 1, vectorised over the batch and heads. Autograd-safe (no in-place).

    Args:
        q, k: ``[N, T, HV, K]`` (already expanded to value heads; q not yet scaled).
        v: ``[N, T, HV, V]``; g: ``[N, T, HV, K]`` log decay; beta: ``[N, T, HV]``, or ``[N, T, HV, V]`` (a
            beta per value channel, as FLA's fused recurrent kernel accepts).
        S: ``[N, HV, K, V]`` initial state, in the compute dtype.
        keep_states: also return the state after every token.

    Returns:
        ``o [N, T, HV, V]``, final ``S [N, HV, K, V]``, and ``states [N, T, HV, K, V]`` or ``None``.
    """
    N, T, HV, K = k.shape
    V = v.shape[-1]
    if T == 0:
        o = v.new_zeros(N, 0, HV, V)
        # a copy: the caller's initial state must never come back as an output (torch custom ops forbid it)
        return o, S.clone(), (S.new_zeros(N, 0, HV, K, V) if keep_states else None)
    decay = torch.exp(g).unsqueeze(-1)                      # [N, T, HV, K, 1]
    qs = (q * scale).unsqueeze(-2)                          # [N, T, HV, 1, K]
    kr = k.unsqueeze(-2)                                    # [N, T, HV, 1, K]
    kc = k.unsqueeze(-1)                                    # [N, T, HV, K, 1]
    bv = beta if beta.dim() == v.dim() else beta.unsqueeze(-1)  # [N, T, HV, 1] or per channel [N, T, HV, V]
    outs, states = [], []
    for t in range(T):
        S = S * decay[:, t]
        pred = (kr[:, t] @ S).squeeze(-2)                   # S^T k: [N, HV, V]
        delta = (bv[:, t] * (v[:, t] - pred)).unsqueeze(-2)  # [N, HV, 1, V]
        S = S + kc[:, t] @ delta
        outs.append((qs[:, t] @ S).squeeze(-2))
        if keep_states:
            states.append(S)
    o = torch.stack(outs, dim=1)
    return o, S, (torch.stack(states, dim=1) if keep_states else None)


# ----------------------------------------------------------------------------------------------------------
# public
# ----------------------------------------------------------------------------------------------------------


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward, one token at a time (the reference definition).

    Inputs are taken as final: q/k already normalised (if wanted), g already a log decay, beta already
    post-sigmoid. Computes in the promoted dtype of ``q, k, v, g, beta`` (pass fp32 or fp64);
    ``initial_state`` is cast to it. Differentiable with autograd w.r.t. every tensor input.

    Args:
        q: ``[B, T, HQK, K]`` queries.
        k: ``[B, T, HQK, K]`` keys.
        v: ``[B, T, HV, V]`` values, ``HV % HQK == 0`` (GVA when ``HV > HQK``).
        g: ``[B, T, HV, K]`` per-channel log decay.
        beta: ``[B, T, HV]`` write strengths, or ``[B, T, HV, V]``: one per value channel.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` or ``None`` (zeros); ``N = B``, or ``len(cu_seqlens) - 1``.
        output_final_state: return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (then ``B == 1``); zero-length sequences
            allowed (their final state is their initial state).

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` and ``final_state [N, HV, K, V]`` (or ``None``), both in
        the compute dtype.
    """
    B, T, _, K = q.shape
    HV = v.shape[2]
    if scale is None:
        scale = K ** -0.5
    dtype = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q, k = _expand_qk_heads(q, HV), _expand_qk_heads(k, HV)

    varlen = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"q: batch size must be 1 with cu_seqlens, got {B}")
        bounds = _seq_bounds(cu_seqlens)
        varlen = _Varlen(bounds, T, max([b1 - b0 for b0, b1 in itertools.pairwise(bounds)] + [0]), q.device)
        q, k, v, g, beta = (varlen.pad(x) for x in (q, k, v, g, beta))
    N = q.shape[0]

    if initial_state is None:
        S0 = q.new_zeros(N, HV, K, v.shape[-1])
    else:
        if initial_state.shape != (N, HV, K, v.shape[-1]):
            raise ValueError(
                f"initial_state: expected shape {(N, HV, K, v.shape[-1])}, got {tuple(initial_state.shape)}")
        S0 = initial_state.to(dtype)

    o, S, _ = _scan(q, k, v, g, beta, scale, S0)
    if varlen is not None:
        o = varlen.unpack(o)
    return o, (S if output_final_state else None)


def recurrent_kda_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    state_pool: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA over a pool of states, one token at a time (FLA's fused recurrent kernel in continuous batching).

    Sequence ``n`` (batch row ``n``, or the ``n``-th ``cu_seqlens`` range) starts from the pool slot
    ``ssm_state_indices[n]`` (``[N]`` indices), or ``ssm_state_indices[n, a - 1]`` with
    ``a = num_accepted_tokens[n]`` (``[N, T_idx]`` indices; column 0 without ``num_accepted_tokens``). Writes:
    with ``[N]`` indices the state after the sequence's last token goes to slot ``ssm_state_indices[n]``; with
    ``[N, T_idx]`` indices the state after its token ``t`` goes to slot ``ssm_state_indices[n, t]`` (in token
    order, so a slot named twice keeps the later state). A negative read slot makes the sequence padded: its
    outputs are zero and nothing is written; a negative write slot skips that write. Slots ``>= P`` are treated
    as negative. A zero-length sequence reads and writes nothing.

    Inputs are taken as final (see :func:`recurrent_kda`); the compute dtype is theirs, the pool is read into
    it and written back rounded to the pool's dtype. ``state_pool`` is ``[P, HV, K, V]``, any strides (a
    transposed view of a ``[P, HV, V, K]`` pool works: writes land in its storage). No autograd.

    Returns:
        ``o [B, T, HV, V]`` in the compute dtype (zeros for padded sequences); ``state_pool`` is updated in place.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    dtype = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q, k = _expand_qk_heads(q, HV), _expand_qk_heads(k, HV)
    device = q.device

    if cu_seqlens is not None:
        bounds = _seq_bounds(cu_seqlens)
        lengths = [b1 - b0 for b0, b1 in itertools.pairwise(bounds)]
        varlen = _Varlen(bounds, T, max([*lengths, 0]), device)
        q, k, v, g, beta = (varlen.pad(x) for x in (q, k, v, g, beta))
    else:
        varlen, lengths = None, [T] * B
    N = q.shape[0]
    P = state_pool.shape[0]

    idx = ssm_state_indices.to(device=device, dtype=torch.long)
    per_token = idx.dim() == 2
    cols = idx.shape[1] if per_token else 1
    idx = idx.reshape(N, cols)
    if num_accepted_tokens is not None:
        read_col = (num_accepted_tokens.to(device=device, dtype=torch.long) - 1).clamp(0, cols - 1)
    else:
        read_col = torch.zeros(N, dtype=torch.long, device=device)
    read = idx.gather(1, read_col[:, None]).squeeze(1)
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    live = (read >= 0) & (read < P) & (lens > 0)

    S0 = state_pool[read.clamp(0, max(P - 1, 0))].to(dtype) if P else q.new_zeros(N, HV, K, V)
    S0 = torch.where(live[:, None, None, None], S0, 0.0)
    o, S, states = _scan(q, k, v, g, beta, scale, S0, keep_states=per_token)
    o = o * live[:, None, None, None].to(o.dtype)

    with torch.no_grad():
        if per_token:
            # token by token, so that a slot named at two positions of a row keeps the later state
            t_idx = torch.arange(states.shape[1], device=device)
            for t in range(min(states.shape[1], cols)):
                slot = idx[:, t]
                write = live & (t_idx[t] < lens) & (slot >= 0) & (slot < P)
                state_pool[slot[write]] = states[write, t].to(state_pool.dtype)
        else:
            slot = idx[:, 0]
            state_pool[slot[live]] = S[live].to(state_pool.dtype)
    return varlen.unpack(o) if varlen is not None else o
