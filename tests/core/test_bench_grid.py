"""tools/bench/grid.py, the bookkeeping of a benchmark grid timed by several processes (CPU): with --resume, rows
already timed are kept and only the missing shapes are measured; rows are saved after every shape; rows of another
card are refused; the train and prefill command lines refuse inconsistent grid options."""

import json

import pytest

from tools.bench import grid, prefill, train


def label(shape):
    return f"T={shape['T']}"


SHAPES = [dict(T=t) for t in (64, 128, 256)]


def test_timed_rows_measures_only_missing_shapes_and_saves_each_step():
    kept = dict(shape=label(SHAPES[1]), ms=1.0)
    measured, saved = [], []

    def measure(shape):
        measured.append(label(shape))
        return dict(shape=label(shape), ms=2.0)

    rows = grid.timed_rows(SHAPES, [kept], measure, saved.append, label)
    assert measured == [label(SHAPES[0]), label(SHAPES[2])]
    assert [r["shape"] for r in rows] == [label(s) for s in SHAPES]
    assert rows[1] is kept
    assert [len(s) for s in saved] == [1, 2, 3]


def test_timed_rows_without_earlier_rows_measures_every_shape():
    rows = grid.timed_rows(SHAPES, [], lambda s: dict(shape=label(s)), lambda rows: None, label)
    assert [r["shape"] for r in rows] == [label(s) for s in SHAPES]


def test_shard_spec_is_checked_and_none_keeps_every_shape():
    assert grid.shard(SHAPES, None, lambda s: s["T"]) == SHAPES
    for bad in ("3/3", "-1/3", "1", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            grid.shard(SHAPES, bad, lambda s: s["T"])


def test_earlier_rows_keep_file_order_and_refuse_another_card(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([dict(shape="s1", gpu="H100"), dict(shape="s2")]))
    b.write_text(json.dumps([dict(shape="s3", gpu="H100")]))
    rows = grid.earlier_rows([a, b], "H100")
    assert [r["shape"] for r in rows] == ["s1", "s2", "s3"]
    with pytest.raises(ValueError, match="a.json: row 's1' was timed on H100, this process runs on H200"):
        grid.earlier_rows([a, b], "H200")


@pytest.mark.parametrize("main", [train.main, prefill.main], ids=["train", "prefill"])
def test_cli_refuses_resume_without_json_and_warm_only_with_no_warm(main, capsys):
    for argv, message in ((["--resume"], "--resume needs --json"),
                          (["--warm-only", "--no-warm"], "--warm-only and --no-warm exclude each other")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


def test_select_takes_merged_and_resumed_rows_and_leaves_the_rest_to_time(tmp_path):
    import argparse

    ap = argparse.ArgumentParser()
    grid.add_arguments(ap)
    merged, own = tmp_path / "merged.json", tmp_path / "own.json"
    merged.write_text(json.dumps([dict(shape=label(SHAPES[0]), gpu="H100")]))
    own.write_text(json.dumps([dict(shape=label(SHAPES[2]), gpu="H100")]))
    args = ap.parse_args(["--merge", str(merged), "--json", str(own), "--resume"])
    mine, done, todo = grid.select(ap, args, SHAPES, lambda s: s["T"], label, "H100")
    assert mine == SHAPES and [r["shape"] for r in done] == [label(SHAPES[0]), label(SHAPES[2])]
    assert todo == [SHAPES[1]]
    # without --resume the --json file's rows are not counted as timed
    args = ap.parse_args(["--merge", str(merged), "--json", str(own)])
    assert grid.select(ap, args, SHAPES, lambda s: s["T"], label, "H100")[2] == SHAPES[1:]
    with pytest.raises(SystemExit):  # another card's rows: an argparse error
        grid.select(ap, ap.parse_args(["--merge", str(merged)]), SHAPES, lambda s: s["T"], label, "H200")


def test_saver_rewrites_the_file_with_the_rows_so_far(tmp_path):
    path = tmp_path / "rows.json"
    save = grid.saver(path)
    save([dict(shape="a")])
    save([dict(shape="a"), dict(shape="b")])
    assert json.loads(path.read_text()) == [dict(shape="a"), dict(shape="b")]
    grid.saver(None)([dict(shape="a")])  # no path: nothing written, nothing raised
