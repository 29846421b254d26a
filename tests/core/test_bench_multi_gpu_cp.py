"""tools/bench/multi_gpu_cp.py on the CPU: the timing grid, FLA's compile classes before the ranks start (one warm
shape per head count, every configuration part of each), the tables rendered from a result."""

from tools.bench import fla_tuning
from tools.bench import multi_gpu_cp as bench


def test_timed_shapes_cover_the_grid_in_timing_order():
    shapes = bench.timed_shapes(bench.FULL)
    assert [(s["H"], s["T"]) for s in shapes] == [(h, t) for h in bench.FULL["heads"] for t in bench.FULL["t_rank"]]
    assert all(s["T"] % 16 == 0 for cfg in (bench.QUICK, bench.FULL) for s in bench.timed_shapes(cfg))


def test_warm_compiles_one_shape_per_head_count_in_every_part():
    for cfg in (bench.QUICK, bench.FULL):
        calls = fla_tuning.warm_calls(bench.timed_shapes(cfg), bench.compile_class, jobs=16)
        heads = sorted({shape["H"] for shape, _, _ in calls})
        assert heads == sorted(cfg["heads"])
        parts = calls[0][2]
        assert parts == 16 // len(heads)
        for h in heads:
            assert sorted(part for shape, part, _ in calls if shape["H"] == h) == list(range(parts))


def test_tables_show_missing_fla_timings_as_not_available():
    result = {"correctness": [{"context": "cula", "o": 1e-3}],
              "timing": [dict(H=16, T_rank=32768, T_total=65536, cula_cp_ms=15.0, cula_local_ms=10.0)],
              "scaling": [dict(gpus=1, T=131072, H=16, ms=40.0, efficiency=1.0),
                          dict(gpus=2, T=131072, H=16, ms=25.0, efficiency=0.8)]}
    text = bench.render_tables(result, 2, "Test GPU", "cmd")
    assert "| cula | 1.00e-03 |" in text
    assert "| 16 | 32768 | 65536 | 15.00 | n/a | n/a | 10.00 | 1.50x |" in text
    assert "| 2 | 131072 | 16 | 25.00 | 80% |" in text


def test_a_run_replaces_its_machines_section_and_keeps_the_others(tmp_path):
    from tools.bench.prefill import write_section

    result = {"timing": [dict(H=16, T_rank=32768, T_total=131072, cula_cp_ms=13.0, cula_local_ms=8.0,
                              fla_cp_ms=19.5, speedup=1.5)]}
    doc = tmp_path / "multi_gpu_cp.md"
    write_section(doc, bench.render_tables({}, 2, "GPU A", "cmd"), bench.HEADER)
    write_section(doc, bench.render_tables({}, 4, "GPU A", "cmd"), bench.HEADER)
    write_section(doc, bench.render_tables(result, 2, "GPU A", "cmd"), bench.HEADER)
    text = doc.read_text()
    assert text.startswith(bench.HEADER)
    assert text.count("## 2 x GPU A\n") == 1 and text.count("## 4 x GPU A\n") == 1
    assert text.count("### Correctness") == 2 and text.count("### Scaling (cula)") == 2
    assert "| 16 | 32768 | 131072 | 13.00 | 19.50 | 1.50x | 8.00 | 1.62x |" in text


def test_merged_runs_show_every_row_once_and_every_command():
    """A grid run in pieces (--parts / --t-rank / --heads, then --merge): each row once, a row timed again replaces
    the earlier one, each run's command listed in order."""
    first = {"command": "cmd --parts correctness,timing --heads 16",
             "correctness": [{"context": "cula", "o": 2e-3}],
             "timing": [dict(H=16, T_rank=32768, T_total=131072, cula_cp_ms=13.0, cula_local_ms=8.0),
                        dict(H=16, T_rank=65536, T_total=262144, cula_cp_ms=30.0, cula_local_ms=16.0)]}
    second = {"command": "cmd --parts timing,scaling --heads 16 32",
              "timing": [dict(H=16, T_rank=65536, T_total=262144, cula_cp_ms=26.0, cula_local_ms=16.0),
                         dict(H=32, T_rank=32768, T_total=131072, cula_cp_ms=20.0, cula_local_ms=12.0)],
              "scaling": [dict(gpus=1, T=524288, H=16, ms=100.0, efficiency=1.0)]}
    merged = bench.merge_results([first, second])
    assert merged["commands"] == [first["command"], second["command"]]
    assert [(r["H"], r["T_rank"], r["cula_cp_ms"]) for r in merged["timing"]] == [(16, 32768, 13.0),
                                                                                  (16, 65536, 26.0),
                                                                                  (32, 32768, 20.0)]
    assert [r["context"] for r in merged["correctness"]] == ["cula"] and len(merged["scaling"]) == 1
    text = bench.render_tables(merged, 4, "GPU A", second["command"])
    assert f"Commands: `{first['command']}`; `{second['command']}` (NCCL_NVLS_ENABLE=0)" in text
    assert "| 16 | 65536 | 262144 | 26.00 |" in text and "| 16 | 65536 | 262144 | 30.00 |" not in text
    assert "| 1 | 524288 | 16 | 100.00 | 100% |" in text
    single = bench.render_tables(first, 4, "GPU A", first["command"])
    assert f"Command: `{first['command']}` (NCCL" in single


def test_bad_piece_options_are_refused():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for argv, message in ((["--parts", "timing,speed"], "--parts takes a comma-separated subset"),
                          (["--t-rank", "1000"], "--t-rank: positive multiples of 16"),
                          (["--heads", "0"], "--heads: positive counts")):
        proc = subprocess.run([sys.executable, "tools/bench/multi_gpu_cp.py", *argv], cwd=root, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-500:]
