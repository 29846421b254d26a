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
or if the longest sequence is under ``min_tokens``. Otherwise pieces are added one at a time to the sequence
with the longest pieces, up to ``max_waves`` waves of the main pass, and the plan kept is the one a model of
stage 2 finds fastest (:func:`stage2_cost`: the map pass's and the main pass's CTAs dispatched in grid order
onto the SMs, a map chunk step weighing ``map_weight`` of a main one, plus ``piece_cost`` per piece; a plan
with more pieces must win by ``tie``). ``on`` uses the same construction without the two entry conditions (and
at least two pieces); ``off`` never splits.

The defaults (``min_tokens``, ``map_weight``, ``piece_cost``, ``tie``) were chosen by measurement: see
docs/benchmarks/intracard_cp.md.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

__all__ = ["CPPlan", "Segment", "makespan", "plan", "plan_pieces", "stage2_cost"]


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
                min_tokens: int = 16384, min_piece_chunks: int = 16, map_slices: int | None = None,
                map_weight: float = 0.6, piece_cost: float = 2.0, max_waves: int = 2, tie: float = 0.02,
                force_pieces: int | None = None) -> tuple[int, ...]:
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
        map_slices: CTAs per (piece, head) of the map pass (default ``2 * slices``: the augmented state [M | c]
            has K + V columns).
        map_weight: a map-pass chunk step's time relative to a main-pass one (no output product; the default
            fitted to a profile, docs/benchmarks/intracard_cp.md).
        piece_cost: modelled cost of each piece (the scan's work and launches), in chunk steps.
        max_waves: the main pass may take up to this many waves of CTAs.
        tie: a plan with more pieces must model at least this fraction faster to be taken (each piece costs
            scan work and launches the model leaves out).
        force_pieces: (benchmarks) in ``on`` and ``auto`` mode, every long sequence gets this many pieces (fewer
            where ``min_piece_chunks`` forbids), whatever the rule says.

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
    if force_pieces is not None:
        for i in long:
            pieces[i] = max(1, min(force_pieces, _chunks(lengths[i], chunk_size) // min_piece_chunks))
        return tuple(pieces)
    if mode == "auto" and (len(long) * num_heads * slices >= busy_fraction * num_sms or longest < min_tokens):
        return tuple(pieces)
    # candidates: add pieces one at a time to the sequence whose pieces are longest, up to `max_waves` waves of
    # the main pass; keep the candidate the stage-2 model (`stage2_cost`) finds fastest (fewer pieces on a tie)
    budget = max(max_waves * num_sms // (num_heads * slices), 2 if mode == "on" else 1)
    heap = [(-_chunks(L, chunk_size), i) for i, L in enumerate(lengths) if L > 0]
    heapq.heapify(heap)
    total = len(long)
    best = None
    while heap and total < budget:
        _, i = heapq.heappop(heap)
        n_chunks = _chunks(lengths[i], chunk_size)
        if n_chunks // (pieces[i] + 1) < min_piece_chunks:
            continue  # this sequence cannot be cut finer; the others may
        pieces[i] += 1
        total += 1
        heapq.heappush(heap, (-(n_chunks // pieces[i]), i))
        cost = piece_cost * sum(pieces) + stage2_cost(lengths, tuple(pieces), num_heads, num_sms, chunk_size,
                                                         slices, map_slices or 2 * slices, map_weight)
        if best is None or cost < best[0] * (1 - tie):
            best = (cost, tuple(pieces))
    return best[1] if best is not None else tuple(pieces)


def makespan(durations, num_sms: int) -> float:
    """Time to run CTAs of these durations, in launch order, one per SM at a time (each goes to the SM that
    frees first: how the hardware dispatches a grid when one CTA fills an SM)."""
    free = [0.0] * min(num_sms, len(durations))
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def stage2_cost(lengths, pieces, num_heads, num_sms, chunk_size, slices, map_slices, map_weight) -> float:
    """Modelled time of stage 2 with CP, in units of one chunk step of one main-pass CTA: the map pass (every
    piece but the last, `map_slices` CTAs per head, `map_weight` per chunk: no output product) then the main
    pass (every piece, `slices` CTAs per head). Launch order as the kernel's grid: segment fastest, then head,
    then slice."""
    main, maps = [], []
    for L, P in zip(lengths, pieces, strict=True):
        bounds = _split(L, P, chunk_size)
        for p in range(P):
            n = _chunks(bounds[p + 1] - bounds[p], chunk_size)
            main.append(n)
            if p < P - 1:
                maps.append(n * map_weight)
    return (makespan([d for _ in range(map_slices * num_heads) for d in maps], num_sms)
            + makespan([d for _ in range(slices * num_heads) for d in main], num_sms))


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
