"""The CPU side of tools/bench/fused_recurrent.py: the speculative pool step's inputs (slot table and accepted
counts), the device-side error, and the rendering of its table from synthetic rows (no GPU, no FLA)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import fused_recurrent as bench  # noqa: E402

SPEC_HEADER = ("| H | N | T | pool | FLA ms | cula ms | speed-up | cula state GB/s | cula % of HBM | FLA % of HBM "
               "| FLA eager ms | cula eager ms | max rel err |")


@pytest.mark.parametrize("N,T", [(1, 2), (5, 2), (7, 4), (16, 4)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_spec_inputs_slot_table_is_a_permutation_and_accepted_counts_in_range(N, T, pool_dtype):
    H = 2
    x = bench.make_inputs(N, H, T, pool_dtype=pool_dtype, seed=3, device="cpu", slot_per_token=True)
    idx, acc = x["idx"], x["accepted"]
    assert idx.shape == (N, T) and idx.dtype == torch.int32
    assert sorted(idx.flatten().tolist()) == list(range(N * T))
    assert acc.shape == (N,) and acc.dtype == torch.int32
    assert int(acc.min()) >= 1 and int(acc.max()) <= T
    assert tuple(x["pool"].shape) == (N * T, H, bench.K, bench.V) and x["pool"].dtype == pool_dtype
    assert x["cu_cpu"].tolist() == list(range(0, N * T + 1, T))
    assert tuple(x["q"].shape) == (1, N * T, H, bench.K) and tuple(x["beta"].shape) == (1, N * T, H)


def test_spec_inputs_are_seeded_and_accepted_counts_cover_the_range():
    one = bench.make_inputs(64, 1, 4, seed=11, device="cpu", slot_per_token=True)
    two = bench.make_inputs(64, 1, 4, seed=11, device="cpu", slot_per_token=True)
    other = bench.make_inputs(64, 1, 4, seed=12, device="cpu", slot_per_token=True)
    for name in ("idx", "accepted", "pool", "q"):
        assert torch.equal(one[name], two[name]), name
    assert not torch.equal(one["idx"], other["idx"])
    assert set(one["accepted"].tolist()) == {1, 2, 3, 4}  # 64 draws in [1, 4]: every value appears


def test_pool_decode_inputs_keep_one_slot_per_sequence():
    x = bench.make_inputs(6, 2, pool_dtype=torch.bfloat16, seed=1, device="cpu")
    assert "accepted" not in x
    assert x["idx"].shape == (6,) and sorted(x["idx"].tolist()) == list(range(6))
    assert tuple(x["pool"].shape) == (6, 2, bench.K, bench.V) and x["pool"].dtype == torch.bfloat16


def test_rel_err_is_the_largest_max_abs_over_max_ref():
    ref_o, ref_s = torch.tensor([1.0, -4.0]), torch.tensor([[2.0, 0.5]])
    ours_o, ours_s = torch.tensor([1.5, -4.0]), torch.tensor([[2.0, 0.1]])
    assert bench.rel_err((ours_o, ours_s), (ref_o, ref_s)) == pytest.approx(max(0.5 / 4.0, 0.4 / 2.0))
    zeros = torch.zeros(3)
    assert bench.rel_err((zeros,), (zeros,)) == 0.0
    assert bench.rel_err((torch.ones(3),), (zeros,)) == math.inf
    assert math.isnan(bench.rel_err((torch.tensor([float("nan")]),), (torch.ones(1),)))
    assert bench.rel_err((ours_s.bfloat16(),), (ref_s,)) == pytest.approx(
        (ours_s.bfloat16().float() - ref_s).abs().max().item() / 2.0)


def _row(table, fla_ms, cula_ms, peak=3352.0, **fields):
    row = dict(table=table, fla_ms=fla_ms, cula_ms=cula_ms, err=1.5e-4, peak_gbs=peak, **fields)
    bench._bandwidth(row, 10**9, peak)  # 1 GB of state per call
    return row


def test_render_speculative_table_and_its_speedup_line():
    rows = [_row("pool", 0.2, 0.1, H=64, N=128, pool="bfloat16"),
            _row("spec", 0.30, 0.10, H=64, N=16, T=2, pool="float32"),
            _row("spec", 0.25, 0.20, H=64, N=128, T=4, pool="bfloat16", fla_eager_ms=0.5, cula_eager_ms=0.4),
            _row("spec", 0.10, 0.125, H=32, N=1, T=4, pool="bfloat16")]
    text = bench.render(rows, {"gpu": "NVIDIA H100 80GB HBM3"}, "python -m tools.bench.fused_recurrent --quick")
    lines = text.splitlines()
    assert lines[0] == "## NVIDIA H100 80GB HBM3" and sum(line.startswith("## ") for line in lines) == 1
    title = [i for i, line in enumerate(lines) if line.startswith("### Speculative pool step")]
    assert len(title) == 1
    start = lines.index(SPEC_HEADER, title[0])
    ncols = SPEC_HEADER.count("|") - 1
    assert lines[start + 1].count("|") - 1 == ncols
    body = lines[start + 2:start + 5]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in body]
    assert all(len(c) == ncols for c in cells)
    assert cells[0][:7] == ["64", "16", "2", "float32", "0.3000", "0.1000", "3.00x"]
    # 1 GB in 0.1 ms: 10000 GB/s, 298% of a 3352 GB/s peak (cula); FLA 1 GB in 0.3 ms
    assert cells[0][7:10] == ["10000", f"{1e4 / 3352 * 100:.0f}%", f"{1e4 / 3 / 3352 * 100:.0f}%"]
    assert cells[0][10:] == ["-", "-", "1.5e-04"]
    assert cells[1][:4] == ["64", "128", "4", "bfloat16"] and cells[1][10:12] == ["0.5000", "0.4000"]
    assert cells[2][6] == "0.80x"
    assert lines[start + 5] == ""
    assert lines[start + 6] == "speed-up over the speculative grid: min 0.80x, max 3.00x over 3 cells."
    # the pool table's line counts its own rows only
    assert "speed-up over the pool grid: min 2.00x, max 2.00x over 1 cells." in lines


def test_render_without_speculative_rows_has_no_speculative_table():
    text = bench.render([_row("pool", 0.2, 0.1, H=32, N=1, pool="float32")], {"gpu": "X"}, "cmd")
    assert "Speculative" not in text and "speculative grid" not in text


@pytest.mark.parametrize("quick", [True, False])
def test_main_runs_the_speculative_grid(monkeypatch, quick):
    """main's loops with the row builders replaced by recorders (no device): which speculative cells it asks for."""
    calls = []
    monkeypatch.setenv("FLA_CULA", "1")  # main sets both; monkeypatch restores them
    monkeypatch.setenv("CULA_BACKEND", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.fla_tuning, "prepare", lambda: None)
    monkeypatch.setattr(bench, "peak_hbm_gbs", lambda: 3352.0)
    monkeypatch.setattr(bench, "pool_row", lambda *a: {"table": "pool"})
    monkeypatch.setattr(bench, "new_state_row", lambda *a: {"table": "new state"})
    monkeypatch.setattr(bench, "publish", lambda *a: None)

    def spec_row(N, H, T, pool_dtype, timing, eager, peak):
        calls.append((pool_dtype, H, T, N, eager))
        return {"table": "spec"}

    monkeypatch.setattr(bench, "spec_row", spec_row)
    assert bench.main(["--quick"] if quick else []) == 0
    Hs, Ns = ((64,), bench.QUICK_NS) if quick else ((32, 64), bench.NS)
    assert sorted(calls, key=str) == sorted(((d, H, T, N, not quick) for d in (torch.float32, torch.bfloat16)
                                            for H in Hs for T in (2, 4) for N in Ns), key=str)


def test_slots_tiling_sweep_table(monkeypatch):
    """--slots-tilings: one row per (pool dtype, T, N), the dispatch's pick and every swept tiling as columns (the
    timing stubbed: no GPU here)."""
    calls = []

    def fake_graph_ms(fn, args, timing):
        calls.append(args[1])
        return 0.25 if args[1] is None else 0.5

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench, "make_inputs", lambda *a, **k: {})
    table = bench.slots_tiling_sweep(bench.Timing())
    lines = table.strip().splitlines()
    assert lines[0] == "| pool | T | N | dispatch | " + " | ".join(
        "x".join(map(str, t)) for t in bench.SLOTS_SWEEP_TILINGS) + " |"
    assert len(lines) == 2 + len(bench.POOL_DTYPES) * len(bench.SPEC_TS) * 2
    assert lines[2].startswith("| float32 | 2 | 16 | 0.2500 | 0.5000 |")
    assert calls[:1 + len(bench.SLOTS_SWEEP_TILINGS)] == [None, *bench.SLOTS_SWEEP_TILINGS]
