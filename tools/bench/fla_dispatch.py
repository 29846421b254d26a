"""Which backend FLA's `chunk_kda` should hand an inference call that both cula and FlashKDA serve: FLA 0.6.0's
`fla.ops.kda.chunk_kda` under `torch.no_grad`, with cula registered (`import cula.fla`), timed as a user calls it,
once dispatched to FlashKDA and once to cula, on the same bf16 inputs in one process. The evidence for
`cula.fla.PREFERENCE_VS_FLASH_KDA`.

    python -m tools.bench.fla_dispatch [--smoke] [--out docs/benchmarks/fla_dispatch.md] [--json FILE]
                                       [--warmup MS] [--rep MS]

Calls: the prefill benchmark's inputs and configuration (tools/bench/prefill.py: safe gate from raw g,
lower_bound -5, q/k L2 norm and sigmoid(beta) in kernel, K = V = 128, final state returned) with
`state_v_first=True`, as FLA's KimiDeltaAttention layer calls it (FlashKDA serves V-first states only); shapes:
the prefill grid's single sequences, batches and varlen calls at H = 64, and B = 4 T = 2048 H = 32.

Dispatch: FlashKDA with `FLA_CULA=0` (FLA reads the switch of cula's backend at every call, so cula declines);
cula with cula.fla's preference table replaced, for those calls, by one row naming cula (its verifier then accepts
ahead of FlashKDA: priority 2 before 3). Each path's output is compared with the direct call of the backend it
should have reached (`flash_kda.fwd`; `cula.kda_prefill` without intra-card CP, which `chunk_kda` does not run):
max |difference| / max |direct| over o and the final state above REACHED_TOL (two backends differ by ~1e-2)
means the call went elsewhere, and the row says so.

Timing: `triton.testing.do_bench` median after warm-up (CUDA events around back-to-back calls, so a host-bound call
shows its host time): each figure includes FLA's dispatch and the backends' verifiers. `cula vs FlashKDA` =
FlashKDA ms / cula ms through FLA (above 1: the table should name cula for the call's shape).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import prefill as pb  # noqa: E402
from tools.bench.harness import Timing, add_do_bench_args, measure  # noqa: E402

SHAPES = ([dict(B=1, T=t, H=64) for t in (512, 4096, 16384)] + [dict(B=2, T=t, H=64) for t in (512, 8192)]
          + [dict(B=1, N=n, T=8192, H=64, lens=kind) for n, kind in ((10, "random"), (20, "uniform"),
                                                                      (64, "random"))]
          + [dict(B=4, T=2048, H=32)])
SMOKE = [dict(B=1, T=512, H=64), dict(B=1, N=10, T=4096, H=64, lens="random")]
REACHED_TOL = 1e-3
HEADER = ("# FLA's chunk_kda dispatched to cula or to FlashKDA (inference)\n\n"
          "One section per card; calls, dispatch and timing: `tools/bench/fla_dispatch.py`'s docstring.\n")


def fla_call(x: dict):
    """FLA's chunk_kda as FLA's layer calls it for inference: V-first final state."""
    from fla.ops.kda import chunk_kda

    with torch.no_grad():
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **pb.fla_offsets(x), state_v_first=True,
                         **pb.gate_kwargs(x))


def max_diff(a, b) -> float:
    """max |a - b| / max |b| over o and the final state (V-first on both sides), the larger of the two."""
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(a, b, strict=True))


def time_shape(shape: dict, timing: Timing) -> dict:
    """One row: both dispatches of FLA's call timed, each checked against its backend's direct call."""
    import cula.fla

    x = pb.make_inputs(shape)
    direct_fk = pb.flashkda_prefill(x)
    o, ht = pb.cula_prefill(x, intracard_cp=False)
    direct_cula = (o, ht.transpose(-1, -2))
    table = cula.fla.PREFERENCE_VS_FLASH_KDA
    row = {"shape": pb.label(shape)}
    try:
        os.environ["FLA_CULA"] = "0"
        row["diff_flashkda"] = max_diff(fla_call(x), direct_fk)
        row["flashkda_ms"] = measure(fla_call, [(x,)], timing).median_ms
        os.environ.pop("FLA_CULA")
        cula.fla.PREFERENCE_VS_FLASH_KDA = (cula.fla.PreferenceRow(0, "cula", "docs/benchmarks/fla_dispatch.md"),)
        row["diff_cula"] = max_diff(fla_call(x), direct_cula)
        row["cula_ms"] = measure(fla_call, [(x,)], timing).median_ms
    finally:
        os.environ.pop("FLA_CULA", None)
        cula.fla.PREFERENCE_VS_FLASH_KDA = table
    return row


def run(shapes, timing: Timing) -> list[dict]:
    rows = []
    for shape in shapes:
        r = time_shape(shape, timing)
        print(f"{r['shape']:<48} FLA->FlashKDA {r['flashkda_ms']:.3f}  FLA->cula {r['cula_ms']:.3f}  "
              f"diffs {r['diff_flashkda']:.1e} / {r['diff_cula']:.1e}", flush=True)
        rows.append(r)
        torch.cuda.empty_cache()  # the shape's inputs are gone with time_shape's frame
    return rows


def render(rows: list[dict], env: dict, command: str) -> str:
    lines = [*pb.card_header(env, command),
             "| shape | FLA -> FlashKDA ms | FLA -> cula ms | cula vs FlashKDA | reached the intended backend |",
             "|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        ok = r["diff_flashkda"] <= REACHED_TOL and r["diff_cula"] <= REACHED_TOL
        ratio = r["flashkda_ms"] / r["cula_ms"]
        ratios.append(ratio)
        reached = "yes" if ok else (f"no (differences {r['diff_flashkda']:.1e} / {r['diff_cula']:.1e} from the "
                                    "direct calls)")
        lines.append(f"| {r['shape']} | {r['flashkda_ms']:.3f} | {r['cula_ms']:.3f} | {ratio:.2f}x | {reached} |")
    lines += ["", f"cula vs FlashKDA through FLA: geomean {pb.geomean(ratios):.2f}x, min {min(ratios):.2f}x, max "
              f"{max(ratios):.2f}x over {len(rows)} shapes."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two shapes")
    ap.add_argument("--out", type=Path, help="markdown file whose section for this card is rewritten")
    ap.add_argument("--json", type=Path)
    add_do_bench_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fla_dispatch: needs a CUDA device", file=sys.stderr)
        return 1
    from fla.ops.kda.backends.flash_kda import FlashKDABackend

    if not FlashKDABackend.is_available():
        print("fla_dispatch: FLA's FlashKDA backend is not available (flash_kda not installed, or FLA_FLASH_KDA=0)",
              file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm90"  # cula's path runs the Hopper kernels or fails loudly
    rows = run(SMOKE if args.smoke else SHAPES, Timing(warmup=args.warmup, repeats=args.rep, method="do_bench"))
    pb.publish("fla_dispatch", rows, render, args, argv, header=HEADER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
