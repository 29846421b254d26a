"""The CPU side of tools/bench/prefill.py and tools/bench/fla_dispatch.py: the rendering of a card's table from
synthetic rows (no GPU, no FLA), with FLA timed on every shape, on a subset (`--fla-subset`) or on none
(`--no-fla`); fla_dispatch's check that each call reached the backend it was sent to; the FLA compile classes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import prefill as bench  # noqa: E402

ENV = {"gpu": "Test GPU", "torch": "t", "cuda": "c", "triton": "tr", "fla-core": "f", "cula-sm90": "s"}


def rows(fla_on):
    out = []
    for i, (cula, fk, fla) in enumerate([(1.0, 2.0, 4.0), (2.0, 1.0, 3.0), (1.0, 1.0, 8.0)]):
        r = {"shape": f"shape {i}", "cula_ms": cula, "flashkda_ms": fk, "err_flashkda": 1e-2}
        if i in fla_on:
            r["fla_ms"] = fla
        out.append(r)
    return out


def table(text):
    return [line for line in text.splitlines() if line.startswith("| shape ") and not line.startswith("| shape |")]


def test_every_shape_with_fla():
    text = bench.render(rows({0, 1, 2}), ENV, "cmd")
    assert "| shape | cula ms | FlashKDA ms | FLA ms | vs FlashKDA | vs FLA | err vs FlashKDA |" in text
    assert table(text)[1] == "| shape 1 | 2.000 | 1.000 | 3.000 | 0.50x | 1.50x | 1.0e-02 |"
    assert "vs FlashKDA: geomean 1.00x, min 0.50x over 3 shapes." in text
    assert "vs FLA: geomean 3.63x, min 1.50x over 3 shapes." in text  # (4 * 1.5 * 8) ** (1 / 3)


def test_fla_on_a_subset_leaves_dashes_and_averages_over_the_subset():
    text = bench.render(rows({0, 2}), ENV, "cmd")
    assert table(text)[1] == "| shape 1 | 2.000 | 1.000 | - | 0.50x | - | 1.0e-02 |"
    assert table(text)[2] == "| shape 2 | 1.000 | 1.000 | 8.000 | 1.00x | 8.00x | 1.0e-02 |"
    assert "vs FLA: geomean 5.66x, min 4.00x over 2 shapes." in text


def test_without_fla_no_fla_columns():
    text = bench.render(rows(set()), ENV, "cmd")
    assert "FLA ms" not in text and "vs FLA" not in text
    assert table(text)[0] == "| shape 0 | 1.000 | 2.000 | 2.00x | 1.0e-02 |"


def test_the_fla_subset_is_part_of_the_grid():
    assert bench.GRID == bench.FIXED + bench.VARLEN + bench.EXTRA
    assert len(bench.FLA_SUBSET) == 6 and all(s in bench.GRID for s in bench.FLA_SUBSET)


@pytest.mark.parametrize("fla_shapes", [None, "subset", []])
def test_shards_partition_the_grid_and_spread_flas_rows(fla_shapes):
    from tools.bench import grid

    fla_shapes = bench.FLA_SUBSET if fla_shapes == "subset" else fla_shapes
    n = 4

    def cost(s):
        return bench.row_cost(s, bench.timed_by_fla(s, fla_shapes))

    parts = [grid.shard(bench.GRID, f"{i}/{n}", cost) for i in range(n)]
    labels = [bench.label(s) for part in parts for s in part]
    assert sorted(labels) == sorted(bench.label(s) for s in bench.GRID) and len(set(labels)) == len(labels)
    loads = [sum(cost(s) for s in part) for part in parts]
    # balanced: the costliest part at most one row's cost above the mean
    assert max(loads) <= sum(loads) / n + max(cost(s) for s in bench.GRID), loads
    if fla_shapes:  # FLA's six tuned rows, the costly ones, do not pile up in one process
        assert max(sum(bench.timed_by_fla(s, fla_shapes) for s in part) for part in parts) == 2


# --- tools/bench/fla_dispatch.py (the same table machinery): rendering and the reached-backend check

def test_fla_dispatch_render_flags_calls_that_missed_their_backend():
    import torch

    from tools.bench import fla_dispatch

    rows = [{"shape": "a", "flashkda_ms": 2.0, "cula_ms": 1.0, "diff_flashkda": 0.0, "diff_cula": 1e-6},
            {"shape": "b", "flashkda_ms": 1.0, "cula_ms": 2.0, "diff_flashkda": 2e-2, "diff_cula": 0.0}]
    text = fla_dispatch.render(rows, ENV, "cmd")
    assert "| a | 2.000 | 1.000 | 2.00x | yes |" in text
    assert "| b | 1.000 | 2.000 | 0.50x | no (differences 2.0e-02 / 0.0e+00 from the direct calls) |" in text
    assert "geomean 1.00x, min 0.50x, max 2.00x over 2 shapes." in text
    o = torch.tensor([1.0, -2.0])
    assert fla_dispatch.max_diff((o, o), (o, o)) == 0.0
    assert fla_dispatch.max_diff((o + 0.2, o), (o, o)) == pytest.approx(0.1)  # 0.2 / max |o|
    assert all(s in bench.FIXED + bench.VARLEN + bench.EXTRA for s in fla_dispatch.SHAPES + fla_dispatch.SMOKE)


def test_a_new_table_file_starts_with_its_benchmarks_header(tmp_path):
    from tools.bench import fla_dispatch

    out = tmp_path / "t.md"
    bench.write_section(out, "## Card A\n\nrows\n", fla_dispatch.HEADER)
    bench.write_section(out, "## Card B\n\nrows\n", fla_dispatch.HEADER)
    bench.write_section(out, "## Card A\n\nnew rows\n", fla_dispatch.HEADER)
    text = out.read_text()
    assert text.startswith("# FLA's chunk_kda dispatched to cula or to FlashKDA")
    assert text.count("## Card A") == 1 and "new rows" in text and "## Card B" in text


def test_fla_warm_covers_every_compile_class_of_the_grid():
    from tools.bench import fla_tuning

    shapes = bench.FIXED + bench.VARLEN + bench.EXTRA
    classes = {bench.compile_class(s) for s in shapes}
    # T = 100 (not a multiple of 16) is its own class beside T = 512 at the same batch and heads
    assert bench.compile_class(dict(B=1, T=100, H=64)) != bench.compile_class(dict(B=1, T=512, H=64))
    calls = fla_tuning.warm_calls(shapes, bench.compile_class, jobs=2 * len(classes))
    assert {bench.compile_class(s) for s, _, _ in calls} == classes
    assert len(calls) == 2 * len(classes) and {(j, n) for _, j, n in calls} == {(0, 2), (1, 2)}


def test_peers_get_the_same_int64_offsets_on_every_call(monkeypatch):
    """FLA caches its chunk indices by the identity of cu_seqlens / cu_seqlens_cpu: the bench must hand FLA (and
    FlashKDA) the same int64 tensors on every timed call, made once with the inputs, as a model does for its layers;
    a conversion inside the call would rebuild FLA's indices (a host round trip) on every call."""
    import types

    import torch

    from tools.bench import fla_dispatch

    seen = []

    def fake_chunk_kda(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
        seen.append(("fla", cu_seqlens, cu_seqlens_cpu))
        return v, None

    def fake_fwd(q, k, v, g, beta, scale, out, cu_seqlens=None, **kw):
        seen.append(("flashkda", cu_seqlens, None))

    fla = types.ModuleType("fla")
    fla.ops = types.ModuleType("fla.ops")
    fla.ops.kda = types.ModuleType("fla.ops.kda")
    fla.ops.kda.chunk_kda = fake_chunk_kda
    flash_kda = types.ModuleType("flash_kda")
    flash_kda.fwd = fake_fwd
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.ops", fla.ops)
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fla.ops.kda)
    monkeypatch.setitem(sys.modules, "flash_kda", flash_kda)

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    x = dict(q=torch.zeros(1, 8, 2, bench.K), k=torch.zeros(1, 8, 2, bench.K), v=torch.zeros(1, 8, 2, bench.K),
             g=torch.zeros(1, 8, 2, bench.K), beta=torch.zeros(1, 8, 2), A_log=torch.zeros(2),
             dt_bias=torch.zeros(2 * bench.K), cu_seqlens=cu, cu_seqlens_cpu=cu, cu_seqlens_i64=cu.long(),
             cu_seqlens_cpu_i64=cu.long())
    for _ in range(2):
        bench.fla_prefill(x)
        bench.flashkda_prefill(x)
        fla_dispatch.fla_call(x)
    fla_calls = [s for s in seen if s[0] == "fla"]
    fk_calls = [s for s in seen if s[0] == "flashkda"]
    assert len(fla_calls) == 4 and len(fk_calls) == 2
    assert all(c[1] is x["cu_seqlens_i64"] and c[2] is x["cu_seqlens_cpu_i64"] for c in fla_calls)
    assert all(c[1] is x["cu_seqlens_i64"] for c in fk_calls)
    assert x["cu_seqlens_i64"].dtype == torch.int64


def test_a_varlen_input_set_without_int64_offsets_is_an_error_not_a_dense_call():
    import torch

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(KeyError, match="cu_seqlens_i64"):
        bench.fla_offsets(dict(cu_seqlens=cu, cu_seqlens_cpu=cu))
    assert bench.fla_offsets(dict(q=torch.zeros(1))) == {}


def test_profile_shape_takes_fixed_and_varlen_shapes_of_the_grid():
    import argparse

    assert bench.profile_shape("2,8192,64") == dict(B=2, T=8192, H=64)
    varlen = bench.profile_shape("64,4096,64,uniform")
    assert varlen == dict(B=1, N=64, T=4096, H=64, lens="uniform") and varlen in bench.VARLEN
    for bad in ("2,8192", "64,4096,64,sorted", "a,b,c", "1,2,3,4,5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected B,T,H or N,T,H,LENS"):
            bench.profile_shape(bad)
