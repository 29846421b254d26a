"""Unit tests of cula_core.cp_planner (CPU, pure Python): the auto rule, modes, piece bounds, segment layout,
agreement with reference.split_at_chunks, caching, and argument errors."""

from __future__ import annotations

import pytest

from cula_core import cp_planner
from cula_core.reference.context_parallel import split_at_chunks

SMS = 132


def test_off_never_splits():
    assert cp_planner.plan_pieces((131072,), 4, SMS, "off") == (1,)


def test_auto_splits_one_long_sequence_with_few_heads():
    pieces = cp_planner.plan_pieces((131072,), 8, SMS, "auto")
    assert pieces[0] > 1
    # the main pass stays within one wave: pieces * heads * 4 slices <= SMs
    assert pieces[0] * 8 * 4 <= SMS


def test_auto_leaves_full_launches_and_short_sequences_alone():
    assert cp_planner.plan_pieces((8192,) * 4, 64, SMS, "auto") == (1,) * 4   # 1024 CTAs already
    assert cp_planner.plan_pieces((4096,), 4, SMS, "auto") == (1,)             # under min_tokens
    assert cp_planner.plan_pieces((4096,), 4, SMS, "on")[0] > 1                 # "on" skips both conditions


def test_long_sequence_gets_the_pieces_in_a_mix():
    lens = (100000, 64, 1, 0, 3000)
    pieces = cp_planner.plan_pieces(lens, 8, SMS, "auto")
    assert pieces[0] > 1 and pieces[1:] == (1, 1, 1, 1)


def test_pieces_keep_min_chunks():
    pieces = cp_planner.plan_pieces((64 * 40,), 1, SMS, "on", min_piece_chunks=16)
    assert pieces == (2,)  # 40 chunks: 3 pieces would be 13 chunks each


def test_segments_layout_matches_reference_split():
    lens = (5000, 0, 70, 20000)
    p = cp_planner.plan(lens, 2, SMS, "on")
    assert p.pieces[0] > 1 and p.pieces[1] == 1
    assert p.num_chunks == sum(-(-L // 64) for L in lens)
    token = chunk = 0
    segs = iter(p.segments)
    for n, (L, P) in enumerate(zip(lens, p.pieces, strict=True)):
        bounds = split_at_chunks(L, P, 64) if L else [0, 0]
        for i in range(P):
            s = next(segs)
            assert (s.seq, s.start, s.end) == (n, token + bounds[i], token + bounds[i + 1])
            assert s.chunk0 == chunk + bounds[i] // 64
            assert s.first == (i == 0) and s.last == (i == P - 1)
        token += L
        chunk += -(-L // 64)
    assert next(segs, None) is None


def test_plans_are_cached_by_lengths():
    a = cp_planner.plan((70000,), 8, SMS, "auto")
    b = cp_planner.plan((70000,), 8, SMS, "auto")
    assert a is b


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        cp_planner.plan_pieces((10,), 1, SMS, "sometimes")
    with pytest.raises(ValueError, match="lengths"):
        cp_planner.plan_pieces((-1,), 1, SMS, "on")
    with pytest.raises(ValueError, match="num_heads"):
        cp_planner.plan_pieces((10,), 0, SMS, "on")


def test_auto_threshold_from_measurements():
    # H100 (log-depth scan): CP won from 32768 tokens at H = 4, 8, 16 and was a toss-up at 16384
    assert cp_planner.plan_pieces((16384,), 4, SMS, "auto") == (1,)
    assert cp_planner.plan_pieces((32768,), 4, SMS, "auto")[0] > 1
    assert cp_planner.plan_pieces((65536,), 8, SMS, "auto")[0] > 1
