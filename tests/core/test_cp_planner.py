"""Unit tests of cula_core.cp_planner (CPU, pure Python): the auto rule, modes, piece bounds, segment layout,
agreement with reference.split_at_chunks, caching, and argument errors."""

from __future__ import annotations

import pytest

from cula_core import cp_planner
from cula_core.reference.context_parallel import split_at_chunks

SMS = 132


def test_off_never_splits():
    assert cp_planner.plan_pieces((131072,), 4, SMS, "off") == (1,)


# the sm90 prefill's stage 2: 2 CTAs of 64 state columns per (piece, head) in the main pass, 4 in the map pass
SM90 = dict(slices=2, map_slices=4)


def test_auto_splits_one_long_sequence_with_few_heads():
    pieces = cp_planner.plan_pieces((131072,), 8, SMS, "auto")
    assert pieces[0] > 1
    # the main pass stays within max_waves (2) waves: pieces * heads * 4 slices <= 2 SMs
    assert pieces[0] * 8 * 4 <= 2 * SMS


def test_piece_counts_are_the_h100_sweep_optima():
    # docs/benchmarks/intracard_cp.md, run 1's sweep at one sequence of 131072 tokens: the fastest counts were
    # 16 (H = 4; 8, 12, 24, 32 slower), 8 (H = 8; 4, 6, 12, 16 slower), 3 (H = 16; 2, 4, 6, 8 slower; the
    # one-wave rule gave 4) and at 65536 tokens 8 (H = 8) and 3 (H = 16)
    for H, L, best in ((4, 131072, 16), (8, 131072, 8), (16, 131072, 3), (8, 65536, 8), (16, 65536, 3)):
        assert cp_planner.plan_pieces((L,), H, SMS, "auto", **SM90) == (best,), (H, L)
    # two sequences of 65536 at H = 16: 2 pieces each (3 measured 21% slower)
    assert cp_planner.plan_pieces((65536, 65536), 16, SMS, "auto", **SM90) == (2, 2)


def test_stage2_model_counts_waves():
    assert cp_planner.makespan([1.0] * 264, SMS) == 2.0
    assert cp_planner.makespan([1.0] * 133, SMS) == 2.0
    assert cp_planner.makespan([5.0, 1.0, 1.0], 2) == 5.0
    assert cp_planner.makespan([], SMS) == 0.0
    # H = 16, 2048 chunks in 4 pieces: map pass 3 * 16 * 4 = 192 CTAs (two waves of 512 chunks at weight 0.6),
    # main pass 4 * 16 * 2 = 128 CTAs (one wave of 512)
    cost = cp_planner.stage2_cost((131072,), (4,), 16, SMS, 64, 2, 4, 0.6)
    assert cost == pytest.approx(2 * 512 * 0.6 + 512)


def test_force_pieces():
    assert cp_planner.plan_pieces((131072, 512), 16, SMS, "on", force_pieces=6) == (6, 1)
    assert cp_planner.plan_pieces((64 * 40,), 1, SMS, "on", force_pieces=8) == (2,)  # min_piece_chunks = 16
    assert cp_planner.plan_pieces((131072,), 16, SMS, "off", force_pieces=6) == (1,)


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
    # H100 (run 3, no stream sync in the CP call): CP won from 16384 tokens at H = 4, 8, 16; shorter: not measured
    assert cp_planner.plan_pieces((8192,), 4, SMS, "auto") == (1,)
    assert cp_planner.plan_pieces((16384,), 4, SMS, "auto")[0] > 1
    assert cp_planner.plan_pieces((16384, 16384), 16, SMS, "auto", slices=2)[0] > 1  # stage 2: 2 CTAs per head
    assert cp_planner.plan_pieces((32768,), 4, SMS, "auto")[0] > 1
    assert cp_planner.plan_pieces((65536,), 8, SMS, "auto")[0] > 1
