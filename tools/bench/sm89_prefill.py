"""Benchmark of cula-sm89's fp32 KDA prefill against FLA 0.6.0's chunk_kda, on the same fp32 inputs and in bf16
(as users would run FLA), with the errors of each against the fp64 reference.

    python -m tools.bench.sm89_prefill [--smoke] [--out docs/benchmarks/sm89_prefill.md] [--json FILE]
    python -m tools.bench.sm89_prefill --chunks      # also time every chunk size per K (how the default was chosen)

Shapes: B in (1, 2, 4), T in (1024, 4096, 16384), H in (16, 32), K = V in (64, 128); q/k L2-normalised, g a
log decay (logsigmoid / 8), beta in (0, 1), no initial state. Timing: the median of `triton.testing.do_bench`
(CUDA events, after warm-up) through tools/bench/harness.py; cula is timed through the public op
`cula_core.kda_prefill` (validation, dispatch and the custom op included), FLA through `fla.ops.kda.chunk_kda`.
Errors: ||out - ref|| / ||ref|| of o against cula_core.reference in fp64, measured on a B = 1, H = 4 slice of each
(T, K) (the errors depend on T and K, not on the batch), for cula (fp32), FLA fp32 and FLA bf16.

FLA at its best (tools/bench/fla_tuning.py): no autotune choice read from disk, its kernels compiled in parallel
processes first (their choices dropped), then on every shape and dtype this process forgets every choice and makes
one untimed call that tunes on it.

Columns: `speed-up` = FLA fp32 ms / cula ms; `vs FLA bf16` = FLA bf16 ms / cula ms (above 1: cula's fp32 is
faster than FLA's bf16).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import fla_tuning  # noqa: E402
from tools.bench.harness import Timing, add_do_bench_args, environment, measure  # noqa: E402

SHAPES = [dict(B=b, T=t, H=h, K=k) for k in (64, 128) for h in (16, 32) for b in (1, 2, 4) for t in (1024, 4096, 16384)]
SMOKE = [dict(B=1, T=1024, H=16, K=64), dict(B=2, T=4096, H=32, K=128)]


def make_inputs(B, T, H, K, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, K)
    g = F.logsigmoid(r(B, T, H, K)) / 8
    beta = torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta


def cula_fn():
    import cula_core

    os.environ["CULA_BACKEND"] = "sm89"  # fail loudly rather than time the reference

    def run(q, k, v, g, beta):
        return cula_core.kda_prefill(q, k, v, g, beta)[0]

    return run


def fla_fn():
    from fla.ops.kda import chunk_kda

    def run(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta)[0]

    return run


def warm_one(H, K, dtype):
    """One FLA call at (B=1, T=4096, H, K) in `dtype`: compiles (and autotunes) its kernels into Triton's cache."""
    x = make_inputs(1, 4096, H, K)
    with torch.no_grad():
        fla_fn()(*(bf16(*x) if dtype == "bf16" else x))
    torch.cuda.synchronize()


def warm_fla(shapes) -> None:
    """FLA's first call per (H, K, dtype) compiles ~12 configurations of each kernel: minutes in all. Compile them
    in parallel processes, one per (H, K, dtype) (fla_tuning.compile_in_parallel, which drops the choices they
    made with the GPU shared), so that this process tunes alone, on compiled kernels."""
    calls = [(H, K, dt) for H, K in sorted({(s["H"], s["K"]) for s in shapes}) for dt in ("fp32", "bf16")]
    seconds, bad = fla_tuning.compile_in_parallel("tools.bench.sm89_prefill", "warm_one", calls)
    print(f"FLA warm-up: {len(calls)} processes compiled in {seconds:.0f} s (failures: {bad})", flush=True)


def bf16(q, k, v, g, beta):
    """FLA as users run it: q, k, v, beta in bf16; g (the log decay) in fp32."""
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16()


def rel(o, ref):
    o = o.double()
    if not torch.isfinite(o).all():
        return float("nan")
    return ((o - ref).norm() / ref.norm()).item()


def errors(T, K, fla):
    """Relative errors of o vs the fp64 reference on a B = 1, H = 4 problem of length T, head dim K."""
    from cula_core.reference import chunk_kda_reference

    q, k, v, g, beta = make_inputs(1, T, 4, K, seed=123)
    ref = chunk_kda_reference(*(t.double() for t in (q, k, v, g, beta)))[0]
    out = {"cula": rel(cula_fn()(q, k, v, g, beta), ref)}
    if fla is not None:
        with torch.no_grad():
            out["fla32"] = rel(fla(q, k, v, g, beta), ref)
            out["fla16"] = rel(fla(*bf16(q, k, v, g, beta)), ref)
    return out


def fmt_ms(x):
    return "n/a" if x is None else f"{x:.3f}"


def fmt_x(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def fmt_e(x):
    return "n/a" if x is None else f"{x:.1e}"


def kernel_split(fn, x):
    """Device ms per kernel family (intra / inter) of one call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn(*x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*x)
        torch.cuda.synchronize()
    split = {"intra": 0.0, "inter": 0.0}
    for ev in prof.key_averages():
        for name in split:
            if f"kda_{name}" in ev.key:
                split[name] += getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0)) / 1e3
    return split


def chunk_table(timing):
    """cula's kernels alone (cula_sm89.ops.prefill) for each chunk size, on a few shapes per K, with the split
    between the intra- and inter-chunk kernels."""
    from cula_sm89.ops import prefill

    lines = ["| B | T | H | K | C | ms | intra ms | inter ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for K in (64, 128):
        for B, T, H in ((1, 4096, 16), (2, 4096, 32), (4, 16384, 32), (1, 16384, 16)):
            x = make_inputs(B, T, H, K)
            for c in (32, 64):
                def fn(*a, c=c):
                    return prefill(*a, chunk_size=c)

                ms = measure(fn, [x], timing).median_ms
                sp = kernel_split(fn, x)
                lines.append(f"| {B} | {T} | {H} | {K} | {c} | {ms:.3f} | {sp['intra']:.3f} | {sp['inter']:.3f} |")
                print(lines[-1], flush=True)
            del x
            torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two shapes only (CI)")
    ap.add_argument("--chunks", action="store_true", help="also time each chunk size per K")
    ap.add_argument("--chunks-only", action="store_true", help="only the chunk-size table (no FLA, no errors)")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    add_do_bench_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sm89_prefill: no CUDA device", file=sys.stderr)
        return 1
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    if args.chunks_only:
        print(chunk_table(timing))
        return 0
    cula = cula_fn()
    fla_tuning.prepare()  # before FLA is imported: no autotune choice from disk, FLA's own kernels
    try:
        fla = fla_fn()
    except ImportError as exc:
        print(f"sm89_prefill: FLA not importable ({exc}): its columns stay empty", file=sys.stderr)
        fla = None

    shapes = SMOKE if args.smoke else SHAPES
    if fla is not None:
        # H = 4: the error runs
        warm_fla(shapes + [dict(H=4, K=K) for K in {s["K"] for s in shapes}])
    errs = {}
    for T, K in sorted({(s["T"], s["K"]) for s in shapes}):
        errs[(T, K)] = errors(T, K, fla)
        print(f"errors T={T} K={K}: {errs[(T, K)]}", flush=True)
        torch.cuda.empty_cache()

    rows = []
    for s in shapes:
        x = make_inputs(**s)
        row = dict(s, cula=measure(cula, [x], timing).median_ms, fla32=None, fla16=None)
        if fla is not None:
            with torch.no_grad():
                try:
                    fla_tuning.retune()
                    fla(*x)  # tunes on this shape, untimed
                    row["fla32"] = measure(fla, [x], timing).median_ms
                except Exception as exc:  # a failing FLA configuration is reported, not fatal
                    row["note"] = f"FLA fp32 failed: {type(exc).__name__}"
                xb = bf16(*x)
                fla_tuning.retune()
                fla(*xb)  # tunes on this shape and dtype, untimed
                row["fla16"] = measure(fla, [xb], timing).median_ms
                del xb
        row.update({f"err_{k}": v for k, v in errs[(s["T"], s["K"])].items()})
        rows.append(row)
        print(row, flush=True)
        if args.json:  # as it goes: a run cut short still leaves every finished row
            import json

            args.json.write_text(json.dumps({"rows": rows}, indent=2, default=str))
        del x
        torch.cuda.empty_cache()

    env = environment("cuda")
    head = ["B", "T", "H", "K", "FLA fp32 ms", "FLA bf16 ms", "cula ms", "speed-up", "vs FLA bf16", "cula err",
            "FLA fp32 err", "FLA bf16 err"]
    lines = [
        "# cula-sm89 fp32 prefill vs FLA 0.6.0 chunk_kda",
        "",
        f"GPU: {env.get('gpu', '?')} (sm_{env.get('capability', '?').replace('.', '')}); torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, triton {env.get('triton', '?')}, "
        f"FLA {env.get('fla-core', env.get('flash-linear-attention', '?'))}, cula-sm89 {env.get('cula-sm89', '?')}.",
        "",
        "Command: `python -m tools.bench.sm89_prefill --out docs/benchmarks/sm89_prefill.md` "
        "(see the module docstring for inputs, timing and the error measure).",
        "`speed-up` = FLA fp32 ms / cula ms; `vs FLA bf16` = FLA bf16 ms / cula ms. Errors: ||o - ref|| / ||ref|| "
        "against the fp64 reference (B = 1, H = 4 slice of each T, K).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---:"] * len(head)) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["B"]), str(r["T"]), str(r["H"]), str(r["K"]), fmt_ms(r["fla32"]), fmt_ms(r["fla16"]),
            fmt_ms(r["cula"]), fmt_x(r["fla32"], r["cula"]), fmt_x(r["fla16"], r["cula"]),
            fmt_e(r.get("err_cula")), fmt_e(r.get("err_fla32")), fmt_e(r.get("err_fla16"))]) + " |")
    sp = [r["fla32"] / r["cula"] for r in rows if r["fla32"]]
    sb = [r["fla16"] / r["cula"] for r in rows if r["fla16"]]
    if sp:
        geo = torch.tensor(sp).log().mean().exp().item()
        lines += ["", f"speed-up over FLA fp32: min {min(sp):.2f}x, geometric mean {geo:.2f}x over {len(sp)} shapes; "
                      f"vs FLA bf16: min {min(sb):.2f}x, max {max(sb):.2f}x."]
    if args.chunks:
        lines += ["", "## Chunk size per K (kernels alone, cula_sm89.ops.prefill)", "", chunk_table(timing)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    if args.json:
        import json

        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2, default=str))
    return 0


def render(json_path: Path) -> str:
    """The markdown table of a (possibly partial) --json file (for a run that was cut short)."""
    import json

    rows = json.loads(json_path.read_text())["rows"]
    out = []
    for r in rows:
        out.append("| " + " | ".join([
            str(r["B"]), str(r["T"]), str(r["H"]), str(r["K"]), fmt_ms(r["fla32"]), fmt_ms(r["fla16"]),
            fmt_ms(r["cula"]), fmt_x(r["fla32"], r["cula"]), fmt_x(r["fla16"], r["cula"]),
            fmt_e(r.get("err_cula")), fmt_e(r.get("err_fla32")), fmt_e(r.get("err_fla16"))]) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
