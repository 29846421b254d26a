"""The CPU side of tools/bench/harness.py: timing loop and input rotation (wall clock), error metrics,
speed-up and its aggregation, the markdown table, the JSON round trip, the optional plot."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import harness  # noqa: E402
from tools.bench.harness import Report, Row, Timing  # noqa: E402


def test_measure_warms_up_then_times_each_repeat_cycling_the_input_sets():
    calls = []
    report = harness.measure(lambda x: calls.append(x), [0, 1, 2], Timing(warmup=4, repeats=7, rotate=3))
    # warm-up and timed calls share one cycle over the input sets
    assert calls == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
    assert report.method == "wall"
    assert len(report.samples) == 7
    assert report.median_ms == sorted(report.samples)[3]
    assert report.min_ms <= report.median_ms <= report.max_ms


def test_measure_reports_the_median_not_the_mean(monkeypatch):
    clock = iter([0.0, 0.001, 1.0, 1.002, 2.0, 2.100])  # calls of 1 ms, 2 ms, 100 ms
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    m = harness.measure(lambda: None, [()], Timing(warmup=0, repeats=3))
    assert m.samples == pytest.approx((1.0, 2.0, 100.0))
    assert m.median_ms == pytest.approx(2.0)


def test_call_with_spreads_mappings_and_sequences():
    f = lambda *a, **kw: (a, kw)
    assert harness.call_with(f, {"x": 1}) == ((), {"x": 1})
    assert harness.call_with(f, (1, 2)) == ((1, 2), {})
    assert harness.call_with(f, 3) == ((3,), {})


def test_timing_and_method_validation():
    with pytest.raises(ValueError, match="method"):
        Timing(method="fast")
    with pytest.raises(ValueError, match="repeats"):
        Timing(repeats=0)
    assert harness.resolve_method("auto", cuda=False) == "wall"
    with pytest.raises(ValueError, match="needs CUDA"):
        harness.resolve_method("events", cuda=False)
    with pytest.raises(ValueError, match="input set"):
        harness.measure(lambda: None, [])


def test_closure_inputs_count_as_cuda_when_the_process_uses_cuda(monkeypatch):
    """`measure(fn, [()])` over a closure of CUDA tensors must not fall back to the host clock (it would time
    asynchronous launches: train_bwd's first rows read faster than HBM allows)."""
    monkeypatch.setattr(harness, "_cuda_in_use", lambda: False)
    assert harness._on_cuda([()]) is False
    monkeypatch.setattr(harness, "_cuda_in_use", lambda: True)
    assert harness._on_cuda([()]) is True
    assert harness._on_cuda([(torch.zeros(2),)]) is False  # tensors decide where they are


def test_errors_max_abs_and_relative_over_a_tuple_of_outputs():
    ref = (torch.tensor([1.0, -4.0]), torch.tensor([[10.0, 0.0]]), None)
    ours = (torch.tensor([1.5, -4.0]), torch.tensor([[10.0, 1.0]]), None)
    max_abs, max_rel = harness.errors(ours, ref)
    assert max_abs == pytest.approx(1.0)  # second tensor: |0 - 1|
    assert max_rel == pytest.approx(0.5 / 4.0)  # first: 0.5 / 4 beats second: 1 / 10
    assert harness.errors(ref, ref) == (0.0, 0.0)
    # bf16 against fp32 compares in fp64
    a, _r = harness.errors(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.001]))
    assert a == pytest.approx(0.001, rel=1e-3)


def test_errors_nan_and_structure():
    assert all(math.isnan(e) for e in harness.errors(torch.tensor([float("nan")]), torch.tensor([1.0])))
    assert harness.errors(torch.tensor([1.0]), torch.tensor([0.0])) == (1.0, math.inf)
    with pytest.raises(ValueError, match="structure"):
        harness.errors((torch.zeros(1),), (torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="shapes differ"):
        harness.errors(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="None"):
        harness.errors((torch.zeros(1), None), (torch.zeros(1), torch.zeros(1)))


def _report() -> Report:
    return Report(title="chunk_kda fwd", rows=[
        Row(shape={"T": 1024, "H": 16}, fla_ms=2.0, cula_ms=1.0, max_abs=1e-3, max_rel=2e-3),
        Row(shape={"T": 4096, "H": 16, "K": 128}, fla_ms=8.0, cula_ms=1.0),
        Row(shape={"T": 8192, "H": 16}, fla_ms=None, cula_ms=3.0, note="FLA not available | x"),
    ])


def test_speedup_is_fla_over_cula_and_geomean_skips_missing():
    r = _report()
    assert [row.speedup for row in r.rows] == [2.0, 8.0, None]
    assert r.geomean_speedup() == pytest.approx(4.0)  # sqrt(2 * 8)
    assert harness.geomean([None, 0.0, float("nan")]) is None


def test_markdown_table():
    md = _report().markdown().splitlines()
    assert md[0] == "### chunk_kda fwd"
    assert md[2] == "| T | H | K | FLA ms | cula ms | speed-up | max abs err | max rel err | note |"
    assert md[3].count("|") == 10
    assert md[4] == "| 1024 | 16 |  | 2.000 | 1.000 | 2.00x | 1.00e-03 | 2.00e-03 |  |"
    assert md[5] == "| 4096 | 16 | 128 | 8.000 | 1.000 | 8.00x | n/a | n/a |  |"
    assert md[6] == "| 8192 | 16 |  | n/a | 3.000 | n/a | n/a | n/a | FLA not available \\| x |"
    assert md[-1] == "geometric mean speed-up (FLA / cula): 4.00x over 2 shapes"


def test_markdown_without_notes_has_no_note_column_and_small_times_stay_readable():
    r = Report(title="t", rows=[Row(shape={"N": 1}, fla_ms=0.004, cula_ms=0.002)])
    md = r.markdown()
    assert "note" not in md
    assert "| 1 | 4.00e-03 | 2.00e-03 | 2.00x |" in md


def test_json_round_trip(tmp_path):
    r = _report()
    r.rows[0].max_rel = math.nan  # JSON has no NaN: it is written as a string and read back
    path = r.write_json(tmp_path / "sub" / "bench.json")
    data = json.loads(path.read_text())  # strict JSON
    assert data["title"] == "chunk_kda fwd"
    assert data["rows"][0]["speedup"] == 2.0 and data["rows"][0]["max_rel"] == "nan"
    assert data["rows"][2]["fla_ms"] is None and data["rows"][2]["speedup"] is None
    assert data["geomean_speedup"] == pytest.approx(4.0)
    back = Report.from_dict(data)
    assert [row.shape for row in back.rows] == [row.shape for row in r.rows]
    assert math.isnan(back.rows[0].max_rel)
    assert back.markdown().splitlines()[5:] == r.markdown().splitlines()[5:]


def test_compare_checks_errors_on_the_same_inputs_and_times_both():
    seen = []

    def make_inputs(shape, seed, device):
        seen.append((shape["n"], seed, device))
        return {"x": torch.full((shape["n"],), float(seed + 1))}

    ours = lambda x: x * 2
    fla = lambda x: x * 2 + 0.5
    report = harness.compare([{"n": 3}, {"n": 5}], make_inputs, ours, fla,
                             timing=Timing(warmup=1, repeats=3, rotate=2), device="cpu", title="t")
    assert seen == [(3, 0, "cpu"), (3, 1, "cpu"), (5, 0, "cpu"), (5, 1, "cpu")]
    assert [r.shape for r in report.rows] == [{"n": 3}, {"n": 5}]
    for r in report.rows:
        assert r.max_abs == pytest.approx(0.5) and r.max_rel == pytest.approx(0.5 / 2.5)
        assert r.fla_ms > 0 and r.cula_ms > 0 and r.speedup == pytest.approx(r.fla_ms / r.cula_ms)
    assert report.meta["method"] == "wall" and report.meta["timing"]["rotate"] == 2


def test_compare_without_fla_notes_it():
    def fla(x):
        raise ImportError("No module named 'fla'")

    report = harness.compare([{"n": 2}], lambda shape, seed, device: (torch.ones(shape["n"]),),
                             lambda x: x, fla, timing=Timing(warmup=0, repeats=1))
    (row,) = report.rows
    assert row.fla_ms is None and row.speedup is None and row.max_abs is None
    assert row.cula_ms is not None and "FLA not available" in row.note


def test_parse_args_smoke_defaults_and_emit(tmp_path, capsys):
    args = harness.parse_args("x", ["--smoke", "--rotate", "3", "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert args.timing == Timing(warmup=2, repeats=5, rotate=3, method="auto")
    harness.emit(_report(), args)
    out = capsys.readouterr().out
    assert out.startswith("### chunk_kda fwd") and f"wrote {tmp_path / 'r.json'}" in out
    assert json.loads((tmp_path / "r.json").read_text())["rows"][1]["speedup"] == 8.0


def test_plot_is_skipped_cleanly_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert _report().plot(tmp_path / "p.png") is None
    assert not (tmp_path / "p.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_plot_writes_a_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional; the no-matplotlib path is tested above")
    path = _report().plot(tmp_path / "p.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_benchmark_runs_on_cpu(capsys):
    pytest.importorskip("cula_core")
    assert harness.main(["--smoke", "--device", "cpu", "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "| B | T | H | K | FLA ms | cula ms |" in out
    row = [line for line in out.splitlines() if line.startswith("| 1 | 128 |")]
    assert len(row) == 1 and float(row[0].split("|")[6]) > 0  # cula ms was measured
