"""Benchmark of cula-sm90's intra-card context parallel (CP): `cula.kda_prefill` with `intracard_cp` off, on and
"auto", against FLA 0.6.0's `chunk_kda` with its own intra-card CP (FLA_INTRACARD_CP=1, under
torch.inference_mode, varlen), on the same bf16 inputs (gate, q/k L2 norm, safe gate with lower_bound = -5 in
kernel for both).

    python -m tools.bench.intracard_cp [--smoke] [--out docs/benchmarks/intracard_cp.md] [--json rows.json]
                                       [--keep-autotune]

Shapes (the issue's grid): H in (4, 8, 16); one or two sequences of T in (16384, 32768, 65536, 131072) tokens each;
and a mix of one long sequence (65536) with 31 short ones (512 each). Always varlen with `cu_seqlens_cpu` (FLA's
CP needs it). Timing: tools/bench/harness.measure (do_bench median after warm-up).

Columns: `CP gain` = cula no-CP ms / cula CP ms; `auto` = the time with intracard_cp="auto" and whether it split;
`speed-up` = FLA (its CP on) ms / cula auto ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("FLA_INTRACARD_CP", "1")  # before fla is imported: its CP backend reads it

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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


def make_inputs(shape, seed=0, device="cuda"):
    lens = shape["lens"]
    kw = pb.make_inputs(dict(B=1, T=sum(lens), H=shape["H"]), seed, device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    return kw


def cula_with(cp):
    def run(**kw):
        return pb.cula_prefill(**kw, intracard_cp=cp)

    return run


def fla_cp(**kw):
    with torch.inference_mode():
        return pb.fla_chunk_kda(**kw)


def warm_one(H: int, varlen: bool) -> None:
    with torch.inference_mode():
        pb.warm_one(H, varlen)


def describe(lens) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)} x {lens[0]}"
    return f"{lens[0]} + {len(lens) - 1} x {lens[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--trim", action="store_true", help="the trimmed grid (TRIM) instead of the issue's")
    ap.add_argument("--keep-autotune", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the rows (times in ms) here as JSON")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("intracard_cp: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm90"
    shapes = SMOKE if args.smoke else TRIM if args.trim else SHAPES
    fla = None
    if not args.no_fla:
        try:
            import fla.ops.kda

            fla = fla_cp
            pb.warm_fla({(s["H"], True) for s in shapes}, args.keep_autotune, module="tools.bench.intracard_cp")
        except ImportError as exc:
            print(f"intracard_cp: FLA not importable ({exc})", file=sys.stderr)
    from cula_core import cp_planner

    from cula_sm90.prefill import forward

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    head = ["H", "sequences", "cula no-CP ms", "cula CP ms", "CP gain", "cula auto ms", "auto splits", "FLA CP ms",
            "speed-up", "auto vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
    rows = []
    for s in shapes:
        x = make_inputs(s)
        t = {cp: measure(cula_with(cp), [x], timing).median_ms for cp in (False, True, "auto")}
        f = measure(fla, [x], timing).median_ms if fla is not None else None
        split = cp_planner.plan(tuple(s["lens"]), s["H"], sms, "auto", **forward.planner_kwargs()).split
        best = min(t[False], t[True])
        rows.append({"H": s["H"], "lens": s["lens"], "no_cp_ms": t[False], "cp_ms": t[True], "auto_ms": t["auto"],
                     "auto_splits": bool(split), "fla_cp_ms": f})
        lines.append("| " + " | ".join([
            str(s["H"]), describe(s["lens"]), f"{t[False]:.3f}", f"{t[True]:.3f}", f"{t[False] / t[True]:.2f}x",
            f"{t['auto']:.3f}", "yes" if split else "no", "n/a" if f is None else f"{f:.3f}",
            "n/a" if f is None else f"{f / t['auto']:.2f}x", f"{t['auto'] / best:.2f}"]) + " |")
        print(lines[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    env = environment("cuda")
    report = "\n".join([
        "# cula-sm90 intra-card context parallel vs FLA 0.6.0", "",
        f"GPU: {env.get('gpu', '?')} ({sms} SMs); torch {env.get('torch')}, CUDA {env.get('cuda')}, FLA "
        f"{env.get('fla-core', '?')}, cula-sm90 {env.get('cula-sm90', '?')}.", "",
        f"Command: `python -m tools.bench.intracard_cp {' '.join(argv if argv is not None else sys.argv[1:])}` "
        "(inputs, timing: the module docstring). `CP gain` = cula no-CP / cula CP; "
        "`speed-up` = FLA (intra-card CP on) / cula auto; `auto vs best` = cula auto / min(no-CP, CP).", "",
        *lines]) + "\n"
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
