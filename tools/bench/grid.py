"""A benchmark grid timed in several processes (one per GPU, or one after another) and put together again: the
bookkeeping that tools/bench/train.py and tools/bench/prefill.py share.

Each row is a dict with a `shape` label and the card it was timed on (`gpu`). A process times the part of the grid
`shard` gives it, skips the rows that earlier processes' JSON files already hold (`earlier_rows`, `timed_rows`) and
saves its rows after every one, so that a process stopped by a time limit keeps what it timed."""

from __future__ import annotations

import json
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

