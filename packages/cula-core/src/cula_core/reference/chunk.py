"""Chunked-form reference for KDA: the algorithm fast kernels implement, with every intermediate exposed.

:func:`chunk_kda_reference` gives the same ``(o, final_state)`` as :func:`~.recurrent.recurrent_kda` (to
rounding) and can return :class:`ChunkIntermediates` in FLA 0.6.0's layouts, so a kernel can be checked
stage by stage. Chunks of ``BT = chunk_size`` tokens start at every sequence start; a sequence's last chunk
may be partial.

Per chunk, with ``G`` the chunk-local cumulative sum of ``g`` (``G_i = g_0 + ... + g_i``, per channel):

    Aqk[i, j] = scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])        (i >= j, else 0)
    L[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])       (i > j, else 0)
    Akk       = (I + L)^{-1}                                            (unit lower triangular)
    w         = Akk @ (beta * k * exp(G))           u = Akk @ (beta * v)
    v_new     = u - w @ h                            (h: state at the chunk start, [K, V])
    o         = (scale * q * exp(G)) @ h + Aqk @ v_new
    h_next    = diag(exp(G_last)) h + (k * exp(G_last - G))^T @ v_new

``Akk`` is FLA's stored ``Akk`` (after its ``solve_tril``): beta is folded into the rows of ``L`` and into the
right-hand sides of ``w``/``u``, not into ``Akk``'s columns (FLA's ``naive_chunk_kda`` instead keeps
``Akk @ diag(beta)``). Every decay is ``exp`` of a *difference* of cumulative log gates that is ``<= 0`` for
``g <= 0`` (never a ratio of cumulative products, and anti-causal differences are zeroed before ``exp``), so
nothing overflows however long the sequence or strong the decay. The score matrices are built in row blocks
of 16 as FLA's kernels do: pairwise decays inside a diagonal block, and ``exp(G_i - G_n) * exp(G_n - G_j)``
through the block's first token ``n`` (both factors ``<= 1``) to the columns before it. FLA stores
``g_cumsum`` in log2 units (times ``1/ln 2``); the ``g_cumsum`` here is in natural-log units.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .recurrent import _compute_dtype, _expand_qk_heads, _pad_time, _seq_bounds, _Varlen

__all__ = ["ChunkIntermediates", "chunk_kda_reference", "chunk_kda_states_reference"]

# Sub-chunk (row block) size of the intra-chunk scores, as FLA's kernels (BC = 16).
_SUB_CHUNK = 16
# Upper bound on elements of the [.., BT, BC, K] pairwise-decay tensors built at once; the intra-chunk
# stage is evaluated in slices of chunks so memory stays bounded for long sequences.
_PAIRWISE_BUDGET = 1 << 23


@dataclass
class ChunkIntermediates:
    """Intermediates of the chunked form, in FLA 0.6.0's layouts (``B == 1`` and packed ``T`` for varlen).

    ``NT`` is the number of chunks per batch row (fixed length: ``ceil(T / BT)``; varlen: the total over all
    sequences, ``sum_n ceil(len_n / BT)``, zero-length sequences contributing none). ``BT = chunk_size``.
    Row ``t`` of an ``A`` matrix is token ``t``; column ``j`` is the ``j``-th token of ``t``'s chunk (columns
    past a partial chunk's end are 0). All float tensors are in the compute dtype.

    Attributes:
        g_cumsum: ``[B, T, HV, K]`` chunk-local cumulative log decay ``G`` (natural log; FLA: ``G / ln 2``).
        Aqk: ``[B, T, HV, BT]`` scaled causal (diagonal included) q-k scores with decays.
        Akk: ``[B, T, HV, BT]`` ``(I + L)^{-1}``, unit lower triangular per chunk (beta not in its columns).
        w: ``[B, T, HV, K]`` ``Akk @ (beta * k * exp(G))``.
        u: ``[B, T, HV, V]`` ``Akk @ (beta * v)``.
        qg: ``[B, T, HV, K]`` ``q * exp(G)`` (unscaled, FLA's ``qg``).
        kg: ``[B, T, HV, K]`` ``k * exp(G_last - G)`` (FLA's ``kg``; ``G_last`` of the token's chunk).
        h: ``[B, NT, HV, K, V]`` state at the start of each chunk.
        v_new: ``[B, T, HV, V]`` ``u - w @ h``.
        chunk_indices: ``[B * NT, 2]`` int64 ``(sequence, chunk index within the sequence)`` per chunk, in
            the order of ``h.flatten(0, 1)`` (FLA's ``prepare_chunk_indices`` for varlen).
        chunk_offsets: ``[N + 1]`` int64 first chunk of each sequence in that order (FLA's
            ``prepare_chunk_offsets``).
        chunk_token_start: ``[B * NT]`` int64 index along the ``T`` axis of each chunk's first token.
        chunk_size: ``BT``.
    """

    g_cumsum: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_token_start: torch.Tensor
    chunk_size: int


def _sub_chunk_size(BT: int) -> int:
    return _SUB_CHUNK if BT > _SUB_CHUNK and BT % _SUB_CHUNK == 0 else BT


def decayed_scores(xs, k, G, BC):
    """``S[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d])`` for ``j <= i`` (0 above), for each ``x`` in ``xs``:
    a list of ``[..., BT, BT]`` score matrices, one per ``x``.

    Chunks are laid out ``[..., BT, K]`` (each ``x``, ``k`` and the in-chunk cumulative log decay ``G``); ``BC``
    divides ``BT``. Rows go in blocks of ``BC``: inside a diagonal block the decays are
    formed pairwise (``[BC, BC, K]``); columns before block ``p`` factor through ``G_n``, the block's first
    token, as ``exp(G_i - G_n) * exp(G_n - G_j)``. Both exponents are ``<= 0`` for decays (``g <= 0``), so
    neither factor can overflow, and that part is a plain matmul.
    """
    BT, K = k.shape[-2:]
    NC = BT // BC
    lead = k.shape[:-2]
    dev = k.device
    causal = torch.ones(BC, BC, dtype=torch.bool, device=dev).tril()[:, :, None]
    Gb, kb = G.reshape(*lead, NC, BC, K), k.reshape(*lead, NC, BC, K)
    diff = Gb.unsqueeze(-2) - Gb.unsqueeze(-3)                              # G_i - G_j: [..., NC, BC, BC, K]
    kdec = kb.unsqueeze(-3) * (torch.exp(torch.where(causal, diff, 0.0)) * causal)
    block_diag = torch.eye(NC, dtype=k.dtype, device=dev)[:, None, :, None]
    if NC > 1:
        blocks, cols = torch.arange(NC, device=dev), torch.arange(BT, device=dev)
        Gn = Gb[..., :1, :]                                                 # [..., NC, 1, K] block reference
        before = (cols[None, :] < (blocks * BC)[:, None])[..., None]        # [NC, BT, 1]: j before block p
        e = Gn - G.unsqueeze(-3)                                            # G_n - G_j: [..., NC, BT, K]
        kn = k.unsqueeze(-3) * (torch.exp(torch.where(before, e, 0.0)) * before)
        gq = torch.exp(Gb - Gn)                                             # exp(G_i - G_n), i in block p
    out = []
    for x in xs:
        xb = x.reshape(*lead, NC, BC, K)
        S = (xb.unsqueeze(-2) * kdec).sum(-1).unsqueeze(-2) * block_diag    # [..., NC, BC, NC, BC]
        if NC > 1:
            S = S + ((xb * gq) @ kn.transpose(-1, -2)).reshape(*lead, NC, BC, NC, BC)
        out.append(S.reshape(*lead, BT, BT))
    return out


def _intra_chunk(q, k, v, G, beta, scale):
    """Intra-chunk stage for chunks laid out ``[..., BT, D]``: returns ``Aqk, Akk, w, u`` (``[..., BT, *]``)."""
    BT = k.shape[-2]
    BC = _sub_chunk_size(BT)
    strict = torch.ones(BT, BT, dtype=torch.bool, device=k.device).tril(-1)
    Aqk, Lkk = decayed_scores((q, k), k, G, BC)
    Aqk = scale * Aqk
    L = Lkk * beta.unsqueeze(-1) * strict
    eye = torch.eye(BT, dtype=k.dtype, device=k.device)
    Akk = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    bcol = beta.unsqueeze(-1)
    w = Akk @ (bcol * k * torch.exp(G))
    u = Akk @ (bcol * v)
    return Aqk, Akk, w, u


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    return_intermediates: bool = False,
):
    """KDA forward in chunked (WY) form; same result as :func:`~.recurrent.recurrent_kda`.

    Inputs are taken as final (q/k normalised if wanted, g a log decay, beta post-sigmoid). Computes in the
    promoted dtype of ``q, k, v, g, beta``; ``initial_state`` is cast to it. Autograd-friendly (batched
    matmuls and ``torch.linalg.solve_triangular``, no in-place ops); the loop runs over chunks only.

    Args:
        q: ``[B, T, HQK, K]``; k: ``[B, T, HQK, K]``.
        v: ``[B, T, HV, V]`` with ``HV % HQK == 0``.
        g: ``[B, T, HV, K]`` per-channel log decay; beta: ``[B, T, HV]``.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` or ``None`` (zeros).
        output_final_state: return the state after each sequence.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); zero-length ones allowed.
        chunk_size: ``BT``, any positive int (FLA uses 64, or 32).
        return_intermediates: also return a :class:`ChunkIntermediates`.

    Returns:
        ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``, plus ``ChunkIntermediates`` when asked.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = int(chunk_size)
    if BT <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    if scale is None:
        scale = K ** -0.5
    dtype = _compute_dtype(q, k, v, g, beta)
    device = q.device
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q, k = _expand_qk_heads(q, HV), _expand_qk_heads(k, HV)

    # -- lay every sequence out on its own zero-padded row [N, NT * BT]: chunks then start at sequence
    #    starts, and padding tokens (g = beta = k = 0) are identity transitions that leave h unchanged.
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"q: batch size must be 1 with cu_seqlens, got {B}")
        bounds = _seq_bounds(cu_seqlens)
        lengths = [b1 - b0 for b0, b1 in itertools.pairwise(bounds)]
        NT = -(-max([*lengths, 0]) // BT)
        varlen = _Varlen(bounds, T, NT * BT, device)
        q, k, v, g, beta = (varlen.pad(x) for x in (q, k, v, g, beta))
    else:
        varlen = None
        lengths = [T] * B
        NT = -(-T // BT)
        q, k, v, g, beta = (_pad_time(x, NT * BT) for x in (q, k, v, g, beta))
    N = q.shape[0]

    if initial_state is None:
        h = q.new_zeros(N, HV, K, V)
    else:
        if initial_state.shape != (N, HV, K, V):
            raise ValueError(f"initial_state: expected shape {(N, HV, K, V)}, got {tuple(initial_state.shape)}")
        h = initial_state.to(dtype)

    # -- chunk view: [N, HV, NT, BT, D]
    def chunks(x):
        return x.reshape(N, NT, BT, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)
    bc = chunks(beta.unsqueeze(-1)).squeeze(-1)                          # [N, HV, NT, BT]
    G = gc.cumsum(dim=-2)

    # -- intra-chunk stage, in slices of chunks so the [BT, BC, K] pairwise decays stay within budget
    per_chunk = max(1, N * HV * BT * _sub_chunk_size(BT) * K)
    step = max(1, _PAIRWISE_BUDGET // per_chunk)
    parts = [
        _intra_chunk(qc[:, :, s:s + step], kc[:, :, s:s + step], vc[:, :, s:s + step],
                     G[:, :, s:s + step], bc[:, :, s:s + step], scale)
        for s in range(0, NT, step)
    ]
    if parts:
        Aqk, Akk, w, u = (torch.cat(t, dim=2) if len(t) > 1 else t[0] for t in zip(*parts, strict=True))
    else:  # no tokens at all
        Aqk = Akk = q.new_zeros(N, HV, 0, BT, BT)
        w, u = q.new_zeros(N, HV, 0, BT, K), q.new_zeros(N, HV, 0, BT, V)

    G_last = G[..., -1, :]                                               # [N, HV, NT, K]
    qg = qc * torch.exp(G)
    kg = kc * torch.exp(G_last.unsqueeze(-2) - G)

    # -- inter-chunk recurrence: the only sequential part
    hs, vns = [], []
    for c in range(NT):
        hs.append(h)
        vn = u[:, :, c] - w[:, :, c] @ h
        vns.append(vn)
        h = torch.exp(G_last[:, :, c]).unsqueeze(-1) * h + kg[:, :, c].transpose(-1, -2) @ vn
    # with no chunk at all h is still the caller's initial state: return a copy, never the input itself
    final_state = h if NT > 0 else h.clone()
    if NT > 0:
        h_all = torch.stack(hs, dim=2)                                   # [N, HV, NT, K, V]
        v_new = torch.stack(vns, dim=2)                                  # [N, HV, NT, BT, V]
        o = (scale * qg) @ h_all + Aqk @ v_new
    else:
        h_all = q.new_zeros(N, HV, 0, K, V)
        v_new = q.new_zeros(N, HV, 0, BT, V)
        o = q.new_zeros(N, HV, 0, BT, V)

    # -- back to token layout [N, T_pad, HV, D], then drop padding
    def tokens(x):
        return x.permute(0, 2, 3, 1, 4).reshape(N, NT * BT, HV, x.shape[-1])

    def restore(x):
        x = tokens(x)
        return varlen.unpack(x) if varlen is not None else x[:, :T]

    o = restore(o)
    final_state = final_state if output_final_state else None
    if not return_intermediates:
        return o, final_state

    # chunk bookkeeping, sequence-major: only chunks holding real tokens exist
    counts = [-(-L // BT) for L in lengths]
    seq_ids = [n for n, c in enumerate(counts) for _ in range(c)]
    in_seq = [i for c in counts for i in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    h_all = h_all.permute(0, 2, 1, 3, 4)                                 # [N, NT, HV, K, V]
    if varlen is not None:
        seq_start = varlen.bounds[:-1]
        token_start = [seq_start[n] + i * BT for n, i in zip(seq_ids, in_seq, strict=True)]
        keep = [n * NT + i for n, i in zip(seq_ids, in_seq, strict=True)]
        keep = torch.tensor(keep, dtype=torch.long, device=device)
        h_all = h_all.reshape(N * NT, HV, K, V)[keep].unsqueeze(0)
    else:
        token_start = [i * BT for i in in_seq]
    as_long = {"dtype": torch.long, "device": device}
    inter = ChunkIntermediates(
        g_cumsum=restore(G),
        Aqk=restore(Aqk),
        Akk=restore(Akk),
        w=restore(w),
        u=restore(u),
        qg=restore(qg),
        kg=restore(kg),
        h=h_all,
        v_new=restore(v_new),
        chunk_indices=torch.tensor([seq_ids, in_seq], **as_long).T.contiguous().reshape(-1, 2),
        chunk_offsets=torch.tensor(offsets, **as_long),
        chunk_token_start=torch.tensor(token_start, **as_long),
        chunk_size=BT,
    )
    return o, final_state, inter


def chunk_kda_states_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The forward of :func:`chunk_kda_reference` plus the state at the start of every chunk: what FLA 0.6.0's
    ``chunk_kda(..., return_intermediate_states=True)`` returns as its third output.

    Same arguments and conventions as :func:`chunk_kda_reference` (inputs taken as final).

    Returns:
        ``(o [B, T, HV, V], final_state [N, HV, K, V] or None, h [B, NT, HV, K, V])``, all in the compute dtype.
        ``h[:, c]`` is the state before chunk ``c`` (``h[:, 0]`` the initial state). Fixed length:
        ``NT = ceil(T / chunk_size)``; varlen (``B == 1``): ``NT`` counts the chunks of all sequences in order,
        ``ceil(len_n / chunk_size)`` each (none for an empty sequence).
    """
    o, final_state, inter = chunk_kda_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                                chunk_size=chunk_size, return_intermediates=True)
    return o, final_state, inter.h
