"""Benchmark harness shared by tools/bench/<name>.py: cula against FLA, in one process, on the same inputs.

A benchmark module gives the shapes, a function that makes one input set for a shape, and the two
callables, and lets `compare` do the rest:

    from tools.bench.harness import compare, emit, parse_args

    def make_inputs(shape, seed, device):      # -> dict of keyword arguments (or a tuple of arguments)
        ...
    def ours(**kw):  return cula.chunk_kda(**kw)
    def fla(**kw):   return fla.ops.kda.chunk_kda(**kw)   # raise ImportError where FLA is absent

    if __name__ == "__main__":
        args = parse_args("chunk_kda forward, sm100")
        shapes = [dict(B=1, T=t, H=32, K=128) for t in (1024, 4096)]
        emit(compare(shapes, make_inputs, ours, fla, timing=args.timing, device=args.device,
                     title="chunk_kda fwd"), args)

What it does:
  * times each callable after warm-up: CUDA events around every call (`method="events"`), or
    `triton.testing.do_bench` (`method="do_bench"`, the default on CUDA where Triton is installed), or the
    wall clock on a CPU; the figure reported is the median over the repeats. Inputs count as CUDA when they
    hold a CUDA tensor or, for input sets without tensors (a closure timed with `[()]`), when the process
    has initialised CUDA; a forced `"wall"` synchronises around each call when CUDA is in use;
  * `rotate=N` cycles through N independent input sets (seeds 0..N-1), so that successive calls do not
    find their inputs in L2;
  * checks cula's outputs against FLA's on input set 0: max abs error and max relative error (per output
    tensor: max |ours - fla| / max |fla|, the largest over the tensors);
  * a `Report` prints as a markdown table (one column per shape key, FLA ms, cula ms, speed-up = FLA / cula,
    the errors), writes JSON, and plots a PNG when matplotlib is installed (skipped, with a message, if not).

A benchmark takes `--smoke` (one small shape, few repeats: `parse_args` provides it with the other options).
List its module name under `benchmarks` in its package's entry of tools/packages.toml and the GPU CI job of
that arch runs `python -m tools.bench.<name> --smoke --json ...` on every push.

`python -m tools.bench.harness [--smoke]` runs it on cula's own chunk_kda and FLA's (the GPU CI smoke run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METHODS = ("auto", "events", "do_bench", "wall")


# ---------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """How to time: `warmup` calls (do_bench: ms) before `repeats` timed calls (do_bench: ms of
    measuring), cycling through `rotate` input sets; `method` is one of METHODS."""

    warmup: int = 10
    repeats: int = 50
    rotate: int = 1
    method: str = "auto"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.warmup < 0 or self.repeats < 1 or self.rotate < 1:
            raise ValueError(f"need warmup >= 0, repeats >= 1, rotate >= 1; got {self}")


@dataclass(frozen=True)
class Measurement:
    """Milliseconds per call: the median of `samples` (per-call times; do_bench may give only the median)."""

    median_ms: float
    samples: tuple[float, ...]
    method: str

    @property
    def min_ms(self) -> float:
        return min(self.samples)

    @property
    def max_ms(self) -> float:
        return max(self.samples)


def call_with(fn: Callable, inputs: Any) -> Any:
    """fn(**inputs) for a mapping, fn(*inputs) for a tuple or list, else fn(inputs)."""
    if isinstance(inputs, Mapping):
        return fn(**inputs)
    if isinstance(inputs, (tuple, list)):
        return fn(*inputs)
    return fn(inputs)


def _on_cuda(inputs: Sequence[Any]) -> bool:
    import torch

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, Mapping):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                yield from tensors(v)

    found = [t for inp in inputs for t in tensors(inp)]
    if found:
        return any(t.is_cuda for t in found)
    # inputs without tensors (a closure over its own tensors, `[()]`): the work is on the GPU whenever this
    # process uses CUDA. Timing it with the host clock would time asynchronous launches, not the kernels.
    return _cuda_in_use()


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def resolve_method(method: str, cuda: bool) -> str:
    """The method `auto` stands for: do_bench on CUDA with Triton, else CUDA events on CUDA, else wall."""
    if method != "auto":
        if method in ("events", "do_bench") and not cuda:
            raise ValueError(f"method {method!r} needs CUDA inputs")
        return method
    if not cuda:
        return "wall"
    try:
        import triton.testing  # noqa: F401
    except ImportError:
        return "events"
    return "do_bench"


def measure(fn: Callable, inputs: Sequence[Any], timing: Timing = Timing()) -> Measurement:
    """Time `fn` on `inputs` (a list of input sets, used in turn) after warm-up; see `Timing`."""
    if not inputs:
        raise ValueError("measure needs at least one input set")
    method = resolve_method(timing.method, _on_cuda(inputs))
    cycle = itertools.cycle(inputs)
    if method == "do_bench":
        import triton.testing

        def step():
            call_with(fn, next(cycle))

        try:
            times = triton.testing.do_bench(step, warmup=timing.warmup, rep=timing.repeats, return_mode="all")
        except TypeError:  # Triton without return_mode="all"
            times = [triton.testing.do_bench(step, warmup=timing.warmup, rep=timing.repeats, return_mode="median")]
        samples = tuple(float(t) for t in times)
        return Measurement(statistics.median(samples), samples, method)
    for _ in range(timing.warmup):
        call_with(fn, next(cycle))
    if method == "events":
        import torch

        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(timing.repeats)]
        for start, end in events:
            inp = next(cycle)
            start.record()
            call_with(fn, inp)
            end.record()
        torch.cuda.synchronize()
        samples = tuple(float(s.elapsed_time(e)) for s, e in events)
    else:
        # the host clock: synchronise around each call if CUDA is in use, so a forced "wall" still times the work
        sync = _cuda_in_use()
        if sync:
            import torch
        times = []
        for _ in range(timing.repeats):
            inp = next(cycle)
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            call_with(fn, inp)
            if sync:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        samples = tuple(times)
    return Measurement(statistics.median(samples), samples, method)


# ---------------------------------------------------------------- accuracy


def _flatten(x: Any, path: str = "out") -> list[tuple[str, Any]]:
    """(path, tensor-or-None) for every leaf of a tensor, tuple/list or mapping of tensors."""
    if isinstance(x, Mapping):
        return [leaf for k in x for leaf in _flatten(x[k], f"{path}[{k!r}]")]
    if isinstance(x, (tuple, list)):
        return [leaf for i, v in enumerate(x) for leaf in _flatten(v, f"{path}[{i}]")]
    return [(path, x)]


def errors(ours: Any, reference: Any) -> tuple[float, float]:
    """(max abs error, max relative error) of `ours` against `reference`: outputs of the same structure
    (a tensor, or tuples/lists/mappings of tensors; None where both have None). The relative error of
    one tensor is max |ours - ref| / max |ref| (0 / 0 counts as 0); both are the largest over the tensors.
    A NaN or inf in either output makes the errors NaN (a result, not a crash)."""
    import torch

    a, b = _flatten(ours), _flatten(reference)
    if [p for p, _ in a] != [p for p, _ in b]:
        raise ValueError(f"outputs differ in structure: {[p for p, _ in a]} vs {[p for p, _ in b]}")
    max_abs, max_rel = 0.0, 0.0
    for (path, x), (_, y) in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                raise ValueError(f"{path}: one output is None, the other is not")
            continue
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if x.shape != y.shape:
            raise ValueError(f"{path}: shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
        if x.numel() == 0:
            continue
        x64, y64 = x.detach().to("cpu", torch.float64), y.detach().to("cpu", torch.float64)
        if not (torch.isfinite(x64).all() and torch.isfinite(y64).all()):
            return math.nan, math.nan
        diff = (x64 - y64).abs().max().item()
        scale = y64.abs().max().item()
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return max_abs, max_rel


# ---------------------------------------------------------------- report


@dataclass
class Row:
    """One shape: its parameters, the median ms of each side (None: not run) and the errors."""

    shape: dict[str, Any]
    fla_ms: float | None
    cula_ms: float | None
    max_abs: float | None = None
    max_rel: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """FLA ms / cula ms: above 1 means cula is faster."""
        if self.fla_ms is None or self.cula_ms is None or self.cula_ms <= 0:
            return None
        return self.fla_ms / self.cula_ms


def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" if v >= 0.01 else f"{v:.2e}"


def fmt_speedup(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_err(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2e}"


def _md_cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


@dataclass
class Report:
    title: str
    rows: list[Row] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def shape_keys(self) -> list[str]:
        """Shape columns: every key of every row's shape, in the order first seen."""
        keys: list[str] = []
        for r in self.rows:
            keys += [k for k in r.shape if k not in keys]
        return keys

    def geomean_speedup(self) -> float | None:
        return geomean([r.speedup for r in self.rows])

    def markdown(self) -> str:
        keys = self.shape_keys()
        header = [*keys, "FLA ms", "cula ms", "speed-up", "max abs err", "max rel err"]
        if any(r.note for r in self.rows):
            header.append("note")
        lines = [f"### {self.title}", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if i < len(keys) + 5 else "---" for i in range(len(header))) + "|"]
        for r in self.rows:
            cells = [_md_cell(r.shape.get(k, "")) for k in keys]
            cells += [fmt_ms(r.fla_ms), fmt_ms(r.cula_ms), fmt_speedup(r.speedup), fmt_err(r.max_abs),
                      fmt_err(r.max_rel)]
            if "note" in header:
                cells.append(_md_cell(r.note))
            lines.append("| " + " | ".join(cells) + " |")
        g = self.geomean_speedup()
        if g is not None:
            lines += ["", f"geometric mean speed-up (FLA / cula): {g:.2f}x over "
                          f"{sum(r.speedup is not None for r in self.rows)} shapes"]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        def clean(v):  # JSON has no NaN/inf: write them as strings
            return v if not isinstance(v, float) or math.isfinite(v) else str(v)

        rows = []
        for r in self.rows:
            d = {k: clean(v) for k, v in asdict(r).items()}
            d["speedup"] = clean(r.speedup)
            rows.append(d)
        return {"title": self.title, "meta": self.meta, "rows": rows,
                "geomean_speedup": clean(self.geomean_speedup())}

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        def num(v):
            return float(v) if isinstance(v, str) else v

        rows = [Row(shape=dict(r["shape"]), fla_ms=num(r["fla_ms"]), cula_ms=num(r["cula_ms"]),
                    max_abs=num(r.get("max_abs")), max_rel=num(r.get("max_rel")), note=r.get("note", ""))
                for r in d["rows"]]
        return cls(title=d["title"], rows=rows, meta=dict(d.get("meta", {})))

    def plot(self, path: str | Path, x: str | None = None) -> Path | None:
        """Bar chart of FLA and cula ms per shape (PNG). None, with a message on stderr, where matplotlib
        is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"harness: matplotlib is not installed: no plot written to {path}", file=sys.stderr)
            return None
        keys = [x] if x else self.shape_keys()
        labels = [", ".join(f"{k}={r.shape[k]}" for k in keys if k in r.shape) for r in self.rows]
        pos = range(len(self.rows))
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(self.rows)), 4))
        w = 0.4
        ax.bar([p - w / 2 for p in pos], [r.fla_ms or 0 for r in self.rows], w, label="FLA")
        ax.bar([p + w / 2 for p in pos], [r.cula_ms or 0 for r in self.rows], w, label="cula")
        for p, r in zip(pos, self.rows, strict=True):
            if r.speedup is not None:
                ax.annotate(fmt_speedup(r.speedup), (p, max(r.fla_ms or 0, r.cula_ms or 0)),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(pos), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(self.title)
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


# ---------------------------------------------------------------- running


def environment(device: str | None = None) -> dict[str, Any]:
    """What the numbers were measured on, for the JSON."""
    import torch

    meta: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        d = torch.device(device)
        meta["gpu"] = torch.cuda.get_device_name(d)
        major, minor = torch.cuda.get_device_capability(d)
        meta["capability"] = f"{major}.{minor}"
    for dist in ("cula-core", "cula-sm89", "cula-sm90", "cula-sm100", "fla-core", "flash-linear-attention",
                 "triton"):
        try:
            from importlib import metadata

            meta[dist] = metadata.version(dist)
        except Exception:
            pass
    return meta


def peak_hbm_gbs(device: int = 0) -> float:
    """The card's HBM peak in GB/s, from its memory clock and bus width (two transfers per clock); 3352 (H100 SXM5
    HBM3) where torch does not report them."""
    import torch

    p = torch.cuda.get_device_properties(device)
    clock = getattr(p, "memory_clock_rate", 0)  # kHz
    bus = getattr(p, "memory_bus_width", 0)     # bits
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9
    return 3352.0


def compare(shapes: Sequence[Mapping[str, Any]], make_inputs: Callable[..., Any], cula_fn: Callable,
            fla_fn: Callable | None = None, *, timing: Timing = Timing(), device: str | None = None,
            title: str = "cula vs FLA", check: bool = True) -> Report:
    """For each shape: make `timing.rotate` input sets with `make_inputs(shape, seed=i, device=device)`,
    compare cula's outputs against FLA's on set 0 (when `check`), then time both on the same sets.
    `fla_fn` None, or raising ImportError, leaves the FLA column empty (noted in the row)."""
    report = Report(title=title, meta={**environment(device), "timing": asdict(timing)})
    for shape in shapes:
        inputs = [make_inputs(dict(shape), seed=i, device=device) for i in range(timing.rotate)]
        row = Row(shape=dict(shape), fla_ms=None, cula_ms=None)
        ours = call_with(cula_fn, inputs[0])
        ref = None
        if fla_fn is not None:
            try:
                ref = call_with(fla_fn, inputs[0])
            except ImportError as exc:
                row.note = f"FLA not available: {exc}"
        if check and ref is not None:
            row.max_abs, row.max_rel = errors(ours, ref)
        del ours, ref
        m = measure(cula_fn, inputs, timing)
        row.cula_ms = m.median_ms
        report.meta.setdefault("method", m.method)
        if fla_fn is not None and not row.note:
            row.fla_ms = measure(fla_fn, inputs, timing).median_ms
        report.rows.append(row)
        del inputs
        _free_cuda_cache()
    return report


def _free_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_do_bench_args(ap: argparse.ArgumentParser, warmup: int = 25, rep: int = 100) -> None:
    """--warmup / --rep of the scripts that time with triton's do_bench: its warm-up and measuring time, in ms."""
    ap.add_argument("--warmup", type=int, default=warmup, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=rep, help="do_bench measuring time, ms")


def parse_args(description: str = "cula benchmark", argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options every tools/bench benchmark takes; `.timing` holds the Timing they describe."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="one small shape, few repeats (CI smoke run)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (do_bench: ms); default 10 (smoke 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (do_bench: ms); default 50 (smoke 5)")
    p.add_argument("--rotate", type=int, default=1, help="number of input sets to cycle through (default 1)")
    p.add_argument("--method", choices=METHODS, default="auto", help="timer (default: auto)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here (needs matplotlib)")
    args = p.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 10)
    repeats = args.repeats if args.repeats is not None else (5 if args.smoke else 50)
    args.timing = Timing(warmup=warmup, repeats=repeats, rotate=args.rotate, method=args.method)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def emit(report: Report, args: argparse.Namespace, out=None) -> None:
    """Print the markdown table (to `out`, default stdout); write the JSON and the plot where asked."""
    out = out if out is not None else sys.stdout
    print(report.markdown(), file=out)
    if getattr(args, "json", None):
        print(f"wrote {report.write_json(args.json)}", file=out)
    if getattr(args, "plot", None):
        written = report.plot(args.plot)
        if written:
            print(f"wrote {written}", file=out)


# ---------------------------------------------------------------- smoke benchmark: chunk_kda


def _chunk_kda_inputs(shape: Mapping[str, Any], seed: int, device: str | None) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, K = shape["B"], shape["T"], shape["H"], shape["K"]
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device)

    return {"q": rnd(B, T, H, K).to(dtype), "k": rnd(B, T, H, K).to(dtype), "v": rnd(B, T, H, K).to(dtype),
            "g": -torch.rand(B, T, H, K, generator=gen).to(device) * 0.1,
            "beta": torch.rand(B, T, H, generator=gen).to(device).to(dtype),
            "use_qk_l2norm_in_kernel": True}


def _cula_chunk_kda(**kw):
    import torch

    from cula_core import chunk_kda

    with torch.no_grad():
        return chunk_kda(**kw)


def _fla_chunk_kda(**kw):
    import torch
    from fla.ops.kda import chunk_kda  # ImportError where FLA is absent: the report notes it

    with torch.no_grad():
        return chunk_kda(**kw)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("chunk_kda forward: cula (best backend here) vs FLA", argv)
    on_cuda = str(args.device).startswith("cuda")
    if args.smoke:
        shapes = [{"B": 1, "T": 512 if on_cuda else 128, "H": 4, "K": 128 if on_cuda else 32}]
    else:
        shapes = [{"B": 1, "T": t, "H": h, "K": 128} for t in (1024, 4096, 16384) for h in (16, 32)]
    report = compare(shapes, _chunk_kda_inputs, _cula_chunk_kda, _fla_chunk_kda, timing=args.timing,
                     device=args.device, title="chunk_kda forward (no grad): FLA vs cula")
    emit(report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
