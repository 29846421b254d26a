"""A benchmark grid timed in several processes (one per GPU, or one after another) and put together again: the
bookkeeping that tools/bench/train.py and tools/bench/prefill.py share.

Each row is a dict with a `shape` label and the card it was timed on (`gpu`). A process times the part of the grid
`shard` gives it, skips the rows that earlier processes' JSON files already hold (`earlier_rows`, `timed_rows`) and
saves its rows after every one, so that a process stopped by a time limit keeps what it timed. A benchmark's `main`
takes the options with `add_arguments` / `check_arguments`, its part of the grid with `select`, and saves through
`saver`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def shard(shapes: list[dict], spec: str | None, cost: Callable[[dict], float]) -> list[dict]:
    """The shapes of shard `spec` ("I/N", 0 <= I < N), in the order of `shapes`; all of them for None.

    The N shards partition `shapes` with balanced costs (`cost(shape)`: a rough time of its row): the costliest
    shape first, each to the shard with the least cost so far (the lowest I on a tie), so that N processes finish
    together."""
    if spec is None:
        return list(shapes)
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be I/N with integers I and N, got {spec!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard I/N needs 0 <= I < N, got {spec!r}")
    load = [0.0] * n
    mine = set()
    for j in sorted(range(len(shapes)), key=lambda j: -cost(shapes[j])):
        k = min(range(n), key=lambda k: load[k])
        load[k] += cost(shapes[j])
        if k == i:
            mine.add(j)
    return [s for j, s in enumerate(shapes) if j in mine]


def earlier_rows(files: list[Path], gpu: str) -> list[dict]:
    """The rows of earlier runs in `files` (JSON lists of rows), in file order; a row timed on another card than
    `gpu` raises ValueError naming its file (a row that records no card, written before rows did, is taken as
    timed on `gpu`)."""
    rows = []
    for f in files:
        for r in json.loads(Path(f).read_text()):
            if r.get("gpu", gpu) != gpu:
                raise ValueError(f"{f}: row {r['shape']!r} was timed on {r['gpu']}, this process runs on {gpu}")
            rows.append(r)
    return rows


def timed_rows(shapes: list[dict], done: list[dict], measure: Callable[[dict], dict], save: Callable[[list], None],
               label: Callable[[dict], str]) -> list[dict]:
    """One row per shape, in the order of `shapes`: the row of `done` whose `shape` is the shape's `label` where
    there is one, else `measure(shape)`; `save(rows so far)` after every row."""
    known = {r["shape"]: r for r in done}
    rows = []
    for shape in shapes:
        rows.append(known.get(label(shape)) or measure(shape))
        save(list(rows))
    return rows


def add_arguments(ap) -> None:
    """The grid's options on an argparse parser: --json, --resume, --shard, --merge, and FLA's compile before the rows
    (--no-warm, --warm-only, --warm-jobs)."""
    ap.add_argument("--json", type=Path, help="rows as JSON, rewritten after every row")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --json; time the others")
    ap.add_argument("--shard", metavar="I/N",
                    help="time part I of N cost-balanced parts of the grid (one process per GPU)")
    ap.add_argument("--merge", type=Path, nargs="+", default=[], help="rows of earlier processes, counted as timed")
    ap.add_argument("--no-warm", action="store_true", help="no parallel compile of FLA's kernels before the rows")
    ap.add_argument("--warm-only", action="store_true",
                    help="compile FLA's kernels for the shapes to time (on every visible GPU) and exit")
    ap.add_argument("--warm-jobs", type=int, default=os.cpu_count() or 1,
                    help="processes compiling FLA's kernels at once (default: the CPU count)")


def check_arguments(ap, args) -> None:
    """Refuse (ap.error) the grid options that contradict each other."""
    if args.resume and not args.json:
        ap.error("--resume needs --json")
    if args.warm_only and args.no_warm:
        ap.error("--warm-only and --no-warm exclude each other")


def select(ap, args, shapes: list[dict], cost: Callable[[dict], float], label: Callable[[dict], str],
           gpu: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(this process's shapes: its shard of `shapes`; the rows already timed: --merge's files, then --json's with
    --resume; the shapes of its shard that no such row holds). A bad --shard or a row of another card: ap.error."""
    files = [*args.merge, *([args.json] if args.resume and args.json.exists() else [])]
    try:
        mine = shard(shapes, args.shard, cost)
        done = earlier_rows(files, gpu)
    except ValueError as e:
        ap.error(str(e))
    timed = {r["shape"] for r in done}
    return mine, done, [s for s in mine if label(s) not in timed]


def saver(path: Path | None) -> Callable[[list], None]:
    """save(rows): rewrite `path` with the rows as JSON (nothing without a path)."""
    if path is None:
        return lambda rows: None
    return lambda rows: path.write_text(json.dumps(rows, indent=2))
