"""Benchmark of cula-sm90's intra-card context parallel (CP): `cula.kda_prefill` with `intracard_cp` off, on and
"auto", against FLA 0.6.0's `chunk_kda` with its own intra-card CP (FLA_INTRACARD_CP=1, under
torch.inference_mode, varlen), on the same bf16 inputs (gate, q/k L2 norm, safe gate with lower_bound = -5 in
kernel for both).

    python -m tools.bench.intracard_cp [--smoke | --trim | --compare] [--longest 16384,131072] [--no-fla]
        [--sweep] [--profile] [--host-profile] [--out docs/benchmarks/intracard_cp.md] [--json rows.json]

`--sweep` times CP at forced piece counts (cula_sm90's prefill with `cp_pieces`), `--compare` the planner's count against the
one-wave rule's, `--profile` / `--host-profile` the CP path's kernels and host side.

Shapes (the issue's grid): H in (4, 8, 16); one or two sequences of T in (16384, 32768, 65536, 131072) tokens each;
and a mix of one long sequence (65536) with 31 short ones (512 each). Always varlen with `cu_seqlens_cpu` (FLA's
CP needs it). Timing: tools/bench/harness.measure (do_bench median after warm-up). FLA runs its own kernels
(`FLA_FLASH_KDA=0`), autotuned in this process on each exact shape (tools/bench/fla_tuning.py).

Columns: `CP gain` = cula no-CP ms / cula CP ms; `auto` = the time with intracard_cp="auto" and whether it split;
`speed-up` = FLA (its CP on) ms / cula auto ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import fla_tuning  # noqa: E402
from tools.bench import prefill as pb  # noqa: E402
from tools.bench.harness import Timing, environment, measure  # noqa: E402

SHAPES = ([dict(H=h, lens=[t] * n) for h in (4, 8, 16) for n in (1, 2) for t in (16384, 32768, 65536, 131072)]
          + [dict(H=h, lens=[65536] + [512] * 31) for h in (4, 8, 16)])
SMOKE = [dict(H=8, lens=[16384]), dict(H=8, lens=[16384] + [512] * 7)]
# --trim (a GPU-time budget): every H, one sequence of each length, two of 65536, the long + short mix at H = 8,
# and three shapes outside the grid at the edges of the auto rule
TRIM = ([dict(H=h, lens=[t] * n) for h in (4, 8, 16) for n, t in ((1, 16384), (1, 32768), (1, 65536), (1, 131072),
                                                                   (2, 65536))]
        + [dict(H=8, lens=[65536] + [512] * 31)]
        # outside the grid, where the auto rule's edges are: under min_tokens, and H = 32 (two pieces)
        + [dict(H=4, lens=[8192]), dict(H=32, lens=[16384]), dict(H=32, lens=[65536])])


def make_inputs(shape, seed=0):
    lens = shape["lens"]
    x = pb.make_inputs(dict(B=1, T=sum(lens), H=shape["H"]), seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x.update(pb.varlen_offsets(cu))
    return x


def cula_with(cp):
    def run(x):
        return pb.cula_prefill(x, intracard_cp=cp)

    return run


def cula_forced_pieces(pieces: int):
    """cula-sm90's prefill with CP on and `pieces` pieces per long sequence, whatever the planner's rule says:
    the host entry below the public op (validation and dispatch skipped), with the arguments that cula_with's
    call passes it for the input set x."""
    from cula_sm90.prefill import forward

    def run(x):
        return forward.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None,
                               x["cu_seqlens"], x["cu_seqlens_cpu"], scale=pb.K ** -0.5, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=pb.LOWER_BOUND,
                               beta_activation="sigmoid", intracard_cp="on", cp_pieces=pieces)

    return run


def fla_cp(x):
    with torch.inference_mode():
        return pb.fla_prefill(x)


def warm_cula() -> None:
    """Compile cula's kernels (stage 1, stage 2 and its affine mode) with one CP call."""
    t0 = time.perf_counter()
    cula_with(True)(make_inputs(dict(H=4, lens=[4096, 4096])))
    torch.cuda.synchronize()
    print(f"cula warm-up: {time.perf_counter() - t0:.0f} s", flush=True)


def profiled(fn, x: dict, calls: int, cpu: bool = False):
    """torch.profiler over `calls` calls of fn(x) after three warm-up calls (CUDA activity; CPU too with `cpu`)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    return prof


# --sweep: CP with a forced piece count (cula_forced_pieces) per shape, to see where the planner's rule stands
SWEEP = [(dict(H=4, lens=[131072]), (8, 12, 16, 24, 32)), (dict(H=8, lens=[131072]), (4, 6, 8, 12, 16)),
         (dict(H=16, lens=[131072]), (2, 3, 4, 6, 8)), (dict(H=8, lens=[65536]), (4, 6, 8, 12)),
         (dict(H=16, lens=[65536]), (2, 3, 4, 6)), (dict(H=16, lens=[65536] * 2), (2, 3)),
         (dict(H=4, lens=[16384]), (2, 4, 8, 16)), (dict(H=16, lens=[32768]), (2, 3, 4))]
# --compare: the shapes where the modelled piece count (cp_planner.stage2_cost) differs from the one-wave rule of
# run 1 (its count is the third item): auto (the model) against that count forced, each timed twice, in turn
COMPARE = ([(dict(H=16, lens=[t]), 4) for t in (32768, 65536, 131072)]
           + [(dict(H=8, lens=[t] * 2), 4) for t in (32768, 65536, 131072)]
           + [(dict(H=h, lens=[65536] + [512] * 31), n) for h, n in ((4, 16), (8, 8), (16, 4))])
PROFILE = [dict(H=4, lens=[16384]), dict(H=4, lens=[131072]), dict(H=16, lens=[131072])]


def sweep(timing) -> list[str]:
    lines = ["| H | sequences | pieces | cula CP ms | o, final state vs no-CP (rel.) |", "|---:|---:|---:|---:|---:|"]

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for s, counts in SWEEP:
        x = make_inputs(s)
        ref = cula_with(False)(x)
        for n in counts:
            ms = measure(cula_forced_pieces(n), [(x,)], timing).median_ms
            o, ht = cula_forced_pieces(n)(x)
            lines.append(f"| {s['H']} | {describe(s['lens'])} | {n} | {ms:.3f} | {rel(o, ref[0]):.1e}, "
                         f"{rel(ht, ref[1]):.1e} |")
            print(lines[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    return lines


def compare(timing, sms) -> list[str]:
    lines = ["| H | sequences | no-CP ms | auto pieces | auto ms (twice) | one-wave pieces | one-wave ms (twice) | "
             "one-wave / auto |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, old in COMPARE:
        x = make_inputs(s)
        t_off = measure(cula_with(False), [(x,)], timing).median_ms
        t_new, t_old = [], []
        for _ in range(2):
            t_new.append(measure(cula_with("auto"), [(x,)], timing).median_ms)
            t_old.append(measure(cula_forced_pieces(old), [(x,)], timing).median_ms)
        lines.append(f"| {s['H']} | {describe(s['lens'])} | {t_off:.3f} | {pieces(s['lens'], s['H'], sms, 'auto')} | "
                     f"{t_new[0]:.3f} / {t_new[1]:.3f} | {old} | {t_old[0]:.3f} / {t_old[1]:.3f} | "
                     f"{min(t_old) / min(t_new):.2f} |")
        print(lines[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    return lines


def host_profile(s=None, calls: int = 20) -> list[str]:
    """Host side of one CP call (torch.profiler, CPU and CUDA): the CPU operators that take the time, and any
    synchronising calls."""
    s = s or dict(H=4, lens=[16384])
    x = make_inputs(s)
    out = []
    for cp in (False, True):  # Python time of a call, the GPU left to catch up afterwards (host-bound if ~wall)
        run = cula_with(cp)
        run(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            run(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.append(f"host time per call, intracard_cp={cp}: {(t1 - t0) / calls * 1e3:.3f} ms "
                   f"(with the GPU's: {(t2 - t0) / calls * 1e3:.3f} ms)")
    prof = profiled(cula_with(True), x, calls, cpu=True)
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    out.append(f"host profile H={s['H']} {describe(s['lens'])} CP on, per call (self CPU us, calls):")
    out += [f"  {e.self_cpu_time_total / calls:9.1f} us x{e.count / calls:<5.1f} {e.key[:80]}" for e in ev[:25]]
    out += [f"  sync: {e.key} x{e.count / calls:.1f} {e.self_cpu_time_total / calls:.1f} us" for e in ev
            if "ynchronize" in e.key or "Memcpy" in e.key]
    print("\n".join(out), flush=True)
    return out


def profile(calls: int = 10) -> list[str]:
    """Per-kernel CUDA time per call of cula's prefill with CP on (torch.profiler), beside the call's wall time:
    the difference is time the GPU waits on the host (launch overhead of the CP path)."""
    out = []
    for s in PROFILE:
        x = make_inputs(s)
        run = cula_with(True)
        prof = profiled(run, x, calls)
        ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in ev) / calls / 1000
        wall = measure(run, [(x,)], Timing(warmup=20, repeats=100, method="auto")).median_ms
        out.append(f"profile H={s['H']} {describe(s['lens'])} CP on: wall {wall:.3f} ms, kernels {total:.3f} ms")
        out += [f"  {e.device_time_total / calls / 1000:8.3f} ms x{e.count // calls:<3d} {e.key[:80]}" for e in ev[:10]]
        print("\n".join(out[-11:]), flush=True)
        del x
        torch.cuda.empty_cache()
    return out


def pieces(lens, H, sms, mode) -> int:
    from cula_core import cp_planner

    from cula_sm90.prefill import forward

    cols = forward.state_cols(len(lens) * H, sms)
    return max(cp_planner.plan(tuple(lens), H, sms, mode, **forward.planner_kwargs(None, cols)).pieces)


def describe(lens) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)} x {lens[0]}"
    return f"{lens[0]} + {len(lens) - 1} x {lens[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--trim", action="store_true", help="the trimmed grid (TRIM) instead of the issue's")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the rows (times in ms) here as JSON")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--longest", type=lambda v: {int(x) for x in v.split(",")},
                    help="only the grid's shapes whose longest sequence is one of these (comma-separated)")
    ap.add_argument("--sweep", action="store_true", help="also time CP at forced piece counts (SWEEP)")
    ap.add_argument("--profile", action="store_true", help="also profile the CP path at a few shapes (PROFILE)")
    ap.add_argument("--compare", action="store_true", help="only: auto against the one-wave piece counts (COMPARE)")
    ap.add_argument("--host-profile", action="store_true", help="also the host side of one CP call")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("intracard_cp: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm90"
    shapes = [] if args.compare else SMOKE if args.smoke else TRIM if args.trim else SHAPES
    if args.longest:
        shapes = [s for s in shapes if max(s["lens"]) in args.longest]
    fla = None
    if not args.no_fla:
        fla_tuning.prepare()
        os.environ["FLA_INTRACARD_CP"] = "1"  # before fla is imported: its CP backend reads it
        try:
            import fla.ops.kda  # noqa: F401

            fla = fla_cp
        except ImportError as exc:
            print(f"intracard_cp: FLA not importable ({exc})", file=sys.stderr)
    warm_cula()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    head = ["H", "sequences", "cula no-CP ms", "cula CP ms", "CP gain", "cula auto ms", "pieces CP / auto",
            "FLA CP ms", "speed-up", "auto vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
    rows = []
    for s in shapes:
        x = make_inputs(s)
        t = {cp: measure(cula_with(cp), [(x,)], timing).median_ms for cp in (False, True, "auto")}
        f = None
        if fla is not None:
            fla_tuning.retune()
            fla(x)  # tunes on this shape
            f = measure(fla, [(x,)], timing).median_ms
        p_on, p_auto = (pieces(s["lens"], s["H"], sms, m) for m in ("on", "auto"))
        best = min(t[False], t[True])
        rows.append({"H": s["H"], "lens": s["lens"], "no_cp_ms": t[False], "cp_ms": t[True], "auto_ms": t["auto"],
                     "pieces_cp": p_on, "pieces_auto": p_auto, "fla_cp_ms": f})
        lines.append("| " + " | ".join([
            str(s["H"]), describe(s["lens"]), f"{t[False]:.3f}", f"{t[True]:.3f}", f"{t[False] / t[True]:.2f}x",
            f"{t['auto']:.3f}", f"{p_on} / {p_auto}", "n/a" if f is None else f"{f:.3f}",
            "n/a" if f is None else f"{f / t['auto']:.2f}x", f"{t['auto'] / best:.2f}"]) + " |")
        print(lines[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    extra = []
    if args.compare:
        extra += ["", "## auto (modelled piece count) against the one-wave rule's count", "", *compare(timing, sms)]
    if args.host_profile:
        extra += ["", "## Host side of a CP call", "", "```", *host_profile(), "```"]
    if args.sweep:
        extra += ["", "## Piece-count sweep (forced piece counts, intracard_cp=True)", "", *sweep(timing)]
    if args.profile:
        extra += ["", "## CP path per kernel (torch.profiler, CP on)", "", "```", *profile(), "```"]
    env = environment("cuda")
    report = "\n".join([
        "# cula-sm90 intra-card context parallel vs FLA 0.6.0", "",
        f"GPU: {env.get('gpu', '?')} ({sms} SMs); torch {env.get('torch')}, CUDA {env.get('cuda')}, FLA "
        f"{env.get('fla-core', '?')}, cula-sm90 {env.get('cula-sm90', '?')}.", "",
        f"Command: `python -m tools.bench.intracard_cp {' '.join(argv if argv is not None else sys.argv[1:])}` "
        "(inputs, timing: the module docstring). `CP gain` = cula no-CP / cula CP; "
        "`speed-up` = FLA (intra-card CP on) / cula auto; `auto vs best` = cula auto / min(no-CP, CP).", "",
        *lines, *extra]) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
