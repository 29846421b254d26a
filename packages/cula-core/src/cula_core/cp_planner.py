"""Host-side planner of intra-card context parallel (CP) for chunked KDA prefill. Pure Python, no device data.

A chunked prefill kernel runs one CTA (or a few: slices of the state) per (sequence, head) that walks the
chunks of its sequence serially; a few long sequences with few heads leave most SMs idle. CP splits long
sequences into pieces at chunk boundaries, runs a pass that computes each piece's affine state map, scans the
maps (cula_core.reference.context_parallel) and then runs every piece at once.

The planner decides, from the sequence lengths (``cu_seqlens_cpu`` or the fixed length), the head count and
the SM count, how many pieces each sequence gets, and lays out the segments the kernels walk. It never
reads device memory; plans are cached by their arguments (lengths as a tuple).

``auto`` rule (:func:`plan_pieces`): CP pays when the serial walk, not the SM count, bounds the time. Only
sequences at least half as long as the longest count ("long": short ones finish early and free their SMs).
Nothing is split if the un-split launch already has ``long * heads * slices >= busy_fraction * num_sms`` CTAs,
or if the longest sequence is under ``min_tokens``. Otherwise the sequence with the longest pieces gets one
more piece, again and again, while the main pass still fits one wave (``pieces of long sequences * heads *
slices <= num_sms``) and every piece keeps at least ``min_piece_chunks`` chunks. ``on`` uses the same
construction without the two entry conditions (and at least two pieces); ``off`` never splits.

``min_tokens = 32768`` comes from the H100 measurements (docs/benchmarks/intracard_cp.md): with the log-depth
scan of the sm90 prefill, CP beat the serial walk on every measured shape of 32768 tokens or more at H = 4, 8
and 16 (1.08x to 3.6x), while at 16384 tokens it went either way from run to run (0.73x to 1.20x: the call
is short enough for the scan's launches to matter); before that scan it lost below 65536 tokens.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

__all__ = ["CPPlan", "Segment", "plan", "plan_pieces"]


@dataclass(frozen=True)
class Segment:
    """One token range a prefill kernel walks serially.

    Attributes:
        seq: sequence index.
        start, end: tokens ``[start, end)`` in the packed (``B * T`` or varlen) token axis.
        chunk0: global index of the segment's first chunk (chunks numbered sequence by sequence, every
            sequence starting a new chunk; an empty sequence owns none).
        first, last: whether the segment starts / ends its sequence.
    """

    seq: int
    start: int
    end: int
    chunk0: int
    first: bool
    last: bool


@dataclass(frozen=True)
class CPPlan:
    """Pieces per sequence and the segments in sequence order (one per sequence when nothing is split).

    ``split`` is True when some sequence has more than one piece. ``num_chunks`` is the total chunk count."""

    pieces: tuple[int, ...]
    segments: tuple[Segment, ...]
    num_chunks: int

    @property
    def split(self) -> bool:
        return any(p > 1 for p in self.pieces)


def _chunks(length: int, chunk_size: int) -> int:
    return -(-length // chunk_size)


@functools.lru_cache(maxsize=256)
def plan_pieces(lengths: tuple[int, ...], num_heads: int, num_sms: int, mode: str = "auto", *,
                chunk_size: int = 64, slices: int = 4, busy_fraction: float = 0.5,
                min_tokens: int = 32768, min_piece_chunks: int = 16) -> tuple[int, ...]:
    """Number of pieces of each sequence.

    Args:
        lengths: tokens per sequence (zeros allowed).
        num_heads: value heads (each (sequence, head) is walked serially).
        num_sms: streaming multiprocessors of the device.
        mode: ``"auto"``, ``"on"`` or ``"off"``.
        chunk_size: pieces are cut at multiples of it.
        slices: CTAs per (segment, head) of the main kernel.
        busy_fraction: ``auto`` leaves CP off when the un-split launch already has ``busy_fraction * num_sms``
            CTAs.
        min_tokens: ``auto`` leaves CP off when no sequence is this long.
        min_piece_chunks: no piece is shorter than this many chunks (the last one of a sequence excepted).

    Returns:
        One int ``>= 1`` per sequence (1 for empty ones).
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"mode: expected 'auto', 'on' or 'off', got {mode!r}")
    if num_heads <= 0 or num_sms <= 0:
        raise ValueError(f"num_heads, num_sms: expected positive ints, got ({num_heads}, {num_sms})")
    if any(L < 0 for L in lengths):
        raise ValueError(f"lengths: expected non-negative ints, got {lengths}")
    pieces = [1] * len(lengths)
    if mode == "off" or not lengths:
        return tuple(pieces)
    longest = max(lengths)
    # sequences that bound the time: within a factor 2 of the longest (short ones finish early and free SMs)
    long = [i for i, L in enumerate(lengths) if L > 0 and 2 * L >= longest]
    if mode == "auto" and (len(long) * num_heads * slices >= busy_fraction * num_sms or longest < min_tokens):
        return tuple(pieces)
    # pieces of the long sequences: as many as the main pass runs in one wave (at least two in "on" mode)
    budget = max(num_sms // (num_heads * slices), 2 if mode == "on" else 1)
    heap = [(-_chunks(L, chunk_size), i) for i, L in enumerate(lengths) if L > 0]
    heapq.heapify(heap)
    total = len(long)
    while heap and total < budget:
        _, i = heapq.heappop(heap)
        n_chunks = _chunks(lengths[i], chunk_size)
        if n_chunks // (pieces[i] + 1) < min_piece_chunks:
            continue  # this sequence cannot be cut finer; the others may
        pieces[i] += 1
        total += 1
        heapq.heappush(heap, (-(n_chunks // pieces[i]), i))
    return tuple(pieces)


def _split(length: int, pieces: int, chunk_size: int) -> list[int]:
    """Boundaries [0, ..., length] of `pieces` pieces at chunk multiples (as reference.split_at_chunks)."""
    n = _chunks(length, chunk_size)
    base, extra = divmod(n, pieces)
    bounds = [0]
    for p in range(pieces):
        bounds.append(min(length, bounds[-1] + (base + (p < extra)) * chunk_size))
    return bounds


@functools.lru_cache(maxsize=256)
def plan(lengths: tuple[int, ...], num_heads: int, num_sms: int, mode: str = "auto", *,
         chunk_size: int = 64, **kwargs) -> CPPlan:
    """The segments for `lengths` (packed one after the other) under :func:`plan_pieces`."""
    pieces = plan_pieces(lengths, num_heads, num_sms, mode, chunk_size=chunk_size, **kwargs)
    segments = []
    token = chunk = 0
    for n, (L, P) in enumerate(zip(lengths, pieces, strict=True)):
        bounds = _split(L, P, chunk_size)
        for p in range(P):
            s, e = bounds[p], bounds[p + 1]
            segments.append(Segment(n, token + s, token + e, chunk + s // chunk_size, p == 0, p == P - 1))
        token += L
        chunk += _chunks(L, chunk_size)
    return CPPlan(pieces, tuple(segments), chunk)
