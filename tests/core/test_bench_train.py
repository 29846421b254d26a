"""tools/bench/train.py's row bookkeeping (CPU): with --resume, rows already timed are kept and only the missing
shapes are measured; the rows are saved after every shape."""

import json

import pytest

from tools.bench import train


def test_timed_rows_measures_only_missing_shapes_and_saves_each_step():
    shapes = train.QUICK[:3]
    kept = dict(shape=train.label(shapes[1]), cula_fwd_ms=1.0)
    measured, saved = [], []

    def measure(shape):
        measured.append(train.label(shape))
        return dict(shape=train.label(shape), cula_fwd_ms=2.0)

    rows = train.timed_rows(shapes, [kept], measure, saved.append)
    assert measured == [train.label(shapes[0]), train.label(shapes[2])]
    assert [r["shape"] for r in rows] == [train.label(s) for s in shapes]
    assert rows[1] is kept
    assert [len(s) for s in saved] == [1, 2, 3]


def test_timed_rows_without_earlier_rows_measures_every_shape():
    shapes = train.QUICK[:2]
    rows = train.timed_rows(shapes, [], lambda s: dict(shape=train.label(s)), lambda rows: None)
    assert [r["shape"] for r in rows] == [train.label(s) for s in shapes]


def test_compile_in_parallel_runs_each_call_in_its_own_process(tmp_path):
    from tools.bench import fla_tuning

    marks = [str(tmp_path / f"mark{i}") for i in range(3)]
    seconds, failed = fla_tuning.compile_in_parallel("os", "mkdir", [(m,) for m in marks[:2]])
    assert failed == [] and seconds >= 0
    assert [(tmp_path / f"mark{i}").exists() for i in range(3)] == [True, True, False]
    _, failed = fla_tuning.compile_in_parallel("sys", "exit", [(0,), (3,)])
    assert failed == [(3,)]


def test_shards_partition_the_grid():
    n = 4
    shards = [train.shard(train.GRID, f"{i}/{n}") for i in range(n)]
    labels = [train.label(s) for part in shards for s in part]
    assert sorted(labels) == sorted(train.label(s) for s in train.GRID)
    assert len(set(labels)) == len(labels)
    order = {train.label(s): j for j, s in enumerate(train.GRID)}
    assert all([order[train.label(s)] for s in part] == sorted(order[train.label(s)] for s in part) for part in shards)
    # balanced: the costliest part within 10% of the mean
    costs = [sum(train.shape_cost(s) for s in part) for part in shards]
    assert max(costs) <= 1.1 * sum(costs) / n, costs
    assert train.shard(train.QUICK, None) == train.QUICK
    for bad in ("4/4", "-1/4", "1", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            train.shard(train.GRID, bad)


def test_earlier_rows_keep_file_order_and_refuse_another_card(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([dict(shape="s1", gpu="H100"), dict(shape="s2")]))
    b.write_text(json.dumps([dict(shape="s3", gpu="H100")]))
    rows = train.earlier_rows([a, b], "H100")
    assert [r["shape"] for r in rows] == ["s1", "s2", "s3"]
    with pytest.raises(ValueError, match="a.json: row 's1' was timed on H100, this process runs on H200"):
        train.earlier_rows([a, b], "H200")
