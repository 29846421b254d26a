"""The chunk tables of the chunked kernels, built on the host from host-known sequence bounds.

A batch of N sequences is described by its bounds (cu_seqlens as a tuple: N + 1 token offsets, starting at 0,
non-decreasing). Chunks of `chunk` tokens tile each sequence from its start; the last chunk of a sequence may be
partial, an empty sequence has none. Results are tuples (hashable, cached); callers copy them to the device once
per distinct batch.
"""

from __future__ import annotations

import functools
import itertools

import torch


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None,
                    cu_seqlens_cpu: torch.Tensor | None) -> tuple[int, ...] | None:
    """The N + 1 bounds of a call: B sequences of T tokens without cu_seqlens, else cu_seqlens_cpu's values.
    None for a varlen call without cu_seqlens_cpu: its bounds are on the device only, and reading them would
    synchronise the host with the stream."""
    if cu_seqlens is None:
        return tuple(b * T for b in range(B + 1))
    if cu_seqlens_cpu is None:
        return None
    return tuple(int(x) for x in cu_seqlens_cpu.tolist())


@functools.lru_cache(maxsize=256)
def chunk_offsets(bounds: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """N + 1 entries: the index of each sequence's first chunk in the batch's chunk order, then the chunk count
    (FLA's prepare_chunk_offsets)."""
    offsets = [0]
    for start, end in itertools.pairwise(bounds):
        offsets.append(offsets[-1] + -(-(end - start) // chunk))
    return tuple(offsets)


@functools.lru_cache(maxsize=256)
def chunk_table(bounds: tuple[int, ...], chunk: int) -> tuple[tuple[int, int], ...]:
    """One (first token, tokens) row per chunk, in sequence order."""
    return tuple((t, min(chunk, end - t)) for start, end in itertools.pairwise(bounds)
                 for t in range(start, end, chunk))


@functools.lru_cache(maxsize=256)
def sequence_table(bounds: tuple[int, ...], chunk: int) -> tuple[tuple[int, int, int], ...]:
    """One (first token, end token, first chunk) row per sequence."""
    offsets = chunk_offsets(bounds, chunk)
    return tuple((start, end, offsets[n]) for n, (start, end) in enumerate(itertools.pairwise(bounds)))
