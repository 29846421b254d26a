"""Reference for context parallelism (CP): one sequence split into pieces that are processed independently.

The KDA state update is affine in the state. Over a piece of tokens ``[t0, t1)`` it is

    state_out = M @ state_in + c,    M = A_{t1-1} ... A_{t0},   A_t = (I - beta_t k_t k_t^T) diag(exp(g_t))

and ``c`` is the piece's final state when started from zero. CP therefore works in three steps: every piece
computes its ``(M, c)`` from local data only; a scan over pieces, ``S_{p+1} = M_p S_p + c_p``, gives each
piece its true initial state; every piece reruns its tokens from that state. :func:`context_parallel_reference`
does exactly this on one device, so it must equal the unsplit run (tests check it).

The backward runs the same scheme the other way. A piece's outputs are affine in its initial state too,
``o = o(0) + R @ state_in`` with ``R = initial_state_response(...)`` (``[T, K]`` per head), so the gradient
a piece sends to the state entering it, from its own outputs and the gradient ``dht`` on its own final
state, is ``e = R^T do + M^T dht``; the gradient of the state entering piece ``p`` is then the reverse scan
``D_p = e_p + M_p^T D_{p+1}`` (:func:`apply_state_maps_adjoint`). Context parallelism across ranks
(`cula_core.context_parallel`) exchanges exactly these ``(M, c)`` and ``e``.
"""

from __future__ import annotations

import itertools

import torch

from .chunk import chunk_kda_reference
from .recurrent import _compute_dtype, _seq_bounds

__all__ = [
    "apply_state_maps",
    "apply_state_maps_adjoint",
    "context_parallel_reference",
    "initial_state_response",
    "piece_affine_map",
    "split_at_chunks",
]


def piece_affine_map(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    start: int = 0,
    end: int | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine state map ``state_out = M @ state_in + c`` of tokens ``[start, end)`` of each sequence.

    Computed with the chunked form on an augmented state ``[M | c]`` of width ``K + V``: started from
    ``[I | 0]`` with values ``[0 | v]``, its first ``K`` columns evolve to ``M`` and the rest to ``c``.

    Args:
        k: ``[B, T, HQK, K]`` keys (normalised if wanted).
        v: ``[B, T, HV, V]`` values (``c`` depends on them).
        g: ``[B, T, HV, K]`` log decay; beta: ``[B, T, HV]``.
        start, end: the piece, ``0 <= start <= end <= T`` (``end=None``: ``T``).
        chunk_size: chunk length of the internal chunked evaluation.

    Returns:
        ``M [B, HV, K, K]`` and ``c [B, HV, K, V]`` in the promoted dtype of the inputs. An empty piece gives
        ``(I, 0)``.
    """
    B, T, _, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    end = T if end is None else end
    if not (0 <= start <= end <= T):
        raise ValueError(f"start, end: expected 0 <= start <= end <= {T}, got ({start}, {end})")
    dtype = _compute_dtype(k, v, g, beta)
    sl = slice(start, end)
    k_p, v_p, g_p, b_p = (x[:, sl].to(dtype) for x in (k, v, g, beta))
    eye = torch.eye(K, dtype=dtype, device=k.device).expand(B, HV, K, K)
    state0 = torch.cat([eye, eye.new_zeros(B, HV, K, V)], dim=-1)
    v_aug = torch.cat([v_p.new_zeros(B, end - start, HV, K), v_p], dim=-1)
    # q is irrelevant for the state; pass k to avoid allocating one
    _, S = chunk_kda_reference(k_p, k_p, v_aug, g_p, b_p, initial_state=state0, output_final_state=True,
                               chunk_size=chunk_size)
    return S[..., :K], S[..., K:]


def initial_state_response(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The outputs' linear response to the initial state: ``o(state) - o(0) = R @ state`` per token and head.

    KDA is linear in ``(v, initial_state)`` jointly for fixed ``q, k, g, beta``, so this is the output of a
    run with zero values from the identity state (``V = K``): row ``t`` of ``R`` holds the ``K`` coefficients
    with which ``o_t[j]`` reads column ``j`` of the initial state.

    Args:
        q, k: ``[B, T, HQK, K]`` (normalised if wanted); g: ``[B, T, HV, K]`` log decay; beta: ``[B, T, HV]``.
        scale: multiplies q; default ``K ** -0.5``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``), or None.
        chunk_size: chunk length of the internal chunked evaluation.

    Returns:
        ``R [B, T, HV, K]`` in the promoted dtype of the inputs (``o = o(0) + einsum("bthk,bhkv->bthv", R,
        state)`` for fixed length; with ``cu_seqlens`` each token reads its own sequence's state).
    """
    B, T, _, K = k.shape
    HV = g.shape[2]
    dtype = _compute_dtype(q, k, g, beta)
    N = B if cu_seqlens is None else len(_seq_bounds(cu_seqlens)) - 1
    eye = torch.eye(K, dtype=dtype, device=k.device).expand(N, HV, K, K).contiguous()
    zeros = torch.zeros(B, T, HV, K, dtype=dtype, device=k.device)
    R, _ = chunk_kda_reference(q, k, zeros, g, beta, scale=scale, initial_state=eye, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size)
    return R


def apply_state_maps(maps, state: torch.Tensor | None = None) -> torch.Tensor:
    """Run a state through consecutive pieces: ``state = M @ state + c`` for each ``(M, c)`` in order.

    Args:
        maps: non-empty sequence of ``(M [..., K, K], c [..., K, V])``, first piece first.
        state: ``[..., K, V]`` entering the first piece, or None (zeros).

    Returns:
        The state leaving the last piece, in the dtype of the maps.
    """
    maps = list(maps)
    if not maps:
        raise ValueError("maps: expected at least one (M, c) pair, got none")
    out = None if state is None else state.to(maps[0][1].dtype)
    for M, c in maps:
        out = c if out is None else M @ out + c
    return out


def apply_state_maps_adjoint(maps, grads) -> torch.Tensor:
    """Gradient of the loss with respect to the state entering the first of consecutive pieces.

    ``grads[p] = e_p`` is what piece ``p`` contributes by itself (its outputs and its own final-state
    gradient, :func:`initial_state_response`); the state leaving piece ``p`` enters piece ``p + 1``, so
    ``D_p = e_p + M_p^T D_{p+1}``, evaluated from the last piece back to the first.

    Args:
        maps: the pieces' ``M [..., K, K]``, first piece first (the last piece's is not needed and may be
            None).
        grads: the pieces' ``e [..., K, V]``, same length as ``maps``.

    Returns:
        ``D_0 [..., K, V]`` in the dtype of ``grads``.
    """
    maps, grads = list(maps), list(grads)
    if not grads or len(maps) != len(grads):
        raise ValueError(f"maps, grads: expected equal non-zero lengths, got {len(maps)} and {len(grads)}")
    out = grads[-1]
    for M, e in zip(reversed(maps[:-1]), reversed(grads[:-1]), strict=True):
        out = e + M.transpose(-1, -2).to(out.dtype) @ out
    return out


def split_at_chunks(T: int, num_pieces: int, chunk_size: int = 64) -> list[int]:
    """Boundaries ``[0, b_1, ..., T]`` splitting ``T`` tokens into ``num_pieces`` pieces at chunk multiples.

    Chunks (``ceil(T / chunk_size)``, the last possibly partial) are shared out as evenly as possible,
    earlier pieces taking the extra ones; the last piece holds the partial chunk, so it can be short.

    Args:
        T: sequence length, ``>= 0``.
        num_pieces: ``1 <= num_pieces <= max(1, ceil(T / chunk_size))``.
        chunk_size: chunk length.

    Returns:
        List of ``num_pieces + 1`` non-decreasing ints; every interior boundary is a multiple of chunk_size.
    """
    if T < 0 or chunk_size <= 0:
        raise ValueError(f"T, chunk_size: expected T >= 0 and chunk_size > 0, got ({T}, {chunk_size})")
    n_chunks = -(-T // chunk_size)
    if not (1 <= num_pieces <= max(1, n_chunks)):
        raise ValueError(f"num_pieces: expected 1..{max(1, n_chunks)} for T={T}, chunk_size={chunk_size}, "
                         f"got {num_pieces}")
    base, extra = divmod(n_chunks, num_pieces)
    bounds = [0]
    for p in range(num_pieces):
        bounds.append(min(T, bounds[-1] + (base + (p < extra)) * chunk_size))
    return bounds


def context_parallel_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    boundaries: list[int] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward computed the context-parallel way: per-piece maps, a scan, then per-piece reruns.

    Args:
        q: ``[B, T, HQK, K]``; k: ``[B, T, HQK, K]``.
        v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log decay; beta: ``[B, T, HV]``.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` or ``None`` (zeros).
        output_final_state: return the state after the last token.
        boundaries: ``[0, b_1, ..., T]`` piece boundaries (any non-decreasing cut points; kernels use chunk
            multiples, see :func:`split_at_chunks`). ``None``: one piece.
        cu_seqlens: optional ``[2]`` offsets ``[0, T]`` of a single packed sequence (``B == 1``); several
            packed sequences are not supported here.
        chunk_size: chunk length used for each piece.

    Returns:
        ``(o [B, T, HV, V], final_state [B, HV, K, V] or None)`` in the promoted dtype of the inputs.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None:
        bounds = _seq_bounds(cu_seqlens)
        if B != 1 or bounds != [0, T]:
            raise NotImplementedError(
                f"cu_seqlens: only a single packed sequence [0, {T}] with B == 1 is supported, got {bounds}")
    boundaries = [0, T] if boundaries is None else [int(b) for b in boundaries]
    if boundaries[0] != 0 or boundaries[-1] != T or any(b1 < b0 for b0, b1 in itertools.pairwise(boundaries)):
        raise ValueError(f"boundaries: expected non-decreasing cut points from 0 to {T}, got {boundaries}")
    dtype = _compute_dtype(q, k, v, g, beta)
    if initial_state is None:
        state = q.new_zeros(B, HV, K, V, dtype=dtype)
    else:
        state = initial_state.to(dtype)

    pieces = list(itertools.pairwise(boundaries))
    # step 1 (parallel across ranks in real CP): each piece's map from its own tokens only
    maps = [piece_affine_map(k, v, g, beta, t0, t1, chunk_size) for t0, t1 in pieces]
    # step 2: scan the maps to get every piece's true initial state
    starts = []
    for M, c in maps:
        starts.append(state)
        state = M @ state + c
    # step 3 (parallel): rerun every piece from its initial state
    outs, final_state = [], None
    for (t0, t1), S0 in zip(pieces, starts, strict=True):
        o_p, final_state = chunk_kda_reference(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1],
                                               beta[:, t0:t1], scale=scale, initial_state=S0,
                                               output_final_state=True, chunk_size=chunk_size)
        outs.append(o_p)
    o = torch.cat(outs, dim=1)
    return o, (final_state if output_final_state else None)
