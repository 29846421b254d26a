"""Benchmark of the sm100 backward's intra-chunk stage: the tensor-core kernel chunk_bwd_intra_tc (the live one)
against the CUDA-core kernel chunk_bwd_intra
(launch.chunk_bwd_intra(tc=False)), and FLA 0.6.0's stage (chunk_kda_bwd_intra + its GVA sum +
chunk_local_cumsum(reverse)) where FLA is installed.

    python -m tools.bench.bwd_intra [--out docs/benchmarks/bwd_intra.md] [--json FILE] [--smoke] [--no-fla]
        [--decay D]
    (and tools/bench/harness.parse_args's options: --warmup / --repeats in ms for do_bench, --method)

Shapes (the issue's): B=2 T=8192 H=32 with HV = 32 and 64, and varlen: 10 sequences of 8192 tokens in all
(random lengths, seed 0), HV = 32. Inputs as the GPU tests make them (tests/sm100/chunk_bwd_intra_tc_memcheck_case.
problem: unit q / k, G = chunk cumsum of logsigmoid(randn) / D, causal dAqk, strictly lower dL). `--decay D`
(default 8: mild, every block through the MMA; 0.25: strong, most blocks through the MMA with middle-row
references, some on the exact diagonal path; `--decay safe`: G = chunk cumsum of -5 sigmoid(2 randn), the safe
gate's range at lower_bound = -5, every block through the MMA with middle-row references). Timing: the
median of `triton.testing.do_bench` after warm-up (tools/bench/harness.measure, method auto). The kernels add
in place; the repeated calls keep adding to the same buffers (the work per call does not depend on their values,
though dG's repeated cumsums overflow to inf after a few dozen calls: no slower on the GPU). Before
timing, the TC kernel's result on fresh buffers is compared with the CUDA-core kernel's (||tc - cc|| / ||cc||
of the additions, the largest over dq, dk, dbeta, dG). speed-up = CUDA-core ms / TC ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests" / "sm100"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tools.bench.harness import environment, measure, parse_args  # noqa: E402

SHAPES = [dict(name="B=2 T=8192", B=2, T=8192, H=32, HV=32, lengths=None),
          dict(name="B=2 T=8192", B=2, T=8192, H=32, HV=64, lengths=None),
          dict(name="varlen random 10 seqs, 8192 tokens", B=1, T=8192, H=32, HV=32, lengths="random10")]
SMOKE = [dict(name="B=1 T=1024", B=1, T=1024, H=4, HV=8, lengths=None)]


def random_lengths(n, total, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(total - 1, generator=g)[:n - 1].add(1).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def make(shape, decay):
    from chunk_bwd_intra_tc_memcheck_case import problem

    lengths = random_lengths(10, shape["T"]) if shape["lengths"] == "random10" else None
    return problem(lengths, shape["H"], shape["HV"], decay, B=shape["B"], T=shape["T"], seed=0), lengths


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def bench_shape(shape, timing, with_fla, decay):
    """(CUDA-core ms, TC ms, FLA ms or None, TC rel. diff) of one shape."""
    from cula_sm100.backward import launch

    (pargs, base, ctab, _ch, scale), lengths = make(shape, decay)
    cc = [b.clone() for b in base]
    launch.chunk_bwd_intra(*pargs, *cc, ctab, scale=scale, tc=False)
    o = [b.clone() for b in base]
    launch.chunk_bwd_intra(*pargs, *o, ctab, scale=scale, tc=True)
    diff = max(rel(x - b0, c - b0) for x, c, b0 in zip(o, cc, base, strict=True))
    bufs = cc  # the timed calls keep adding to these
    ms_cc = measure(lambda: launch.chunk_bwd_intra(*pargs, *bufs, ctab, scale=scale, tc=False), [()], timing).median_ms
    ms_tc = measure(lambda: launch.chunk_bwd_intra(*pargs, *bufs, ctab, scale=scale, tc=True), [()], timing).median_ms
    ms_fla = None
    if with_fla:
        try:
            from chunk_bwd_intra_tc_memcheck_case import fla_stage

            B = shape["B"] if lengths is None else 1
            ms_fla = measure(fla_stage(pargs, base, B, lengths, scale), [()], timing).median_ms
        except Exception as e:  # FLA absent or its API moved: the row says n/a
            print(f"FLA stage not timed: {type(e).__name__}: {e}", file=sys.stderr)
    return ms_cc, ms_tc, ms_fla, diff


def _g_text(decay) -> str:
    return "-5 sigmoid(2 randn)" if decay == "safe" else f"logsigmoid(randn) / {decay:g}"


def _decay(text: str):
    return text if text == "safe" else float(text)


def main(argv=None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--out", type=Path, help="write the markdown report here")
    extra.add_argument("--no-fla", action="store_true", help="skip FLA's stage")
    extra.add_argument("--decay", type=_decay, default=8.0,
                       help="G = chunk cumsum of logsigmoid(randn) / DECAY (8: mild, 0.25: strong; default 8), or "
                            "'safe': of -5 sigmoid(2 randn), the safe gate's range at lower_bound = -5")
    own, rest = extra.parse_known_args(argv)
    args = parse_args(__doc__.splitlines()[0], rest)  # --smoke, --warmup, --repeats, --method, --json
    if not torch.cuda.is_available():
        print("bwd_intra: no CUDA device", file=sys.stderr)
        return 1
    head = ["shape", "H", "HV", "CUDA-core ms", "TC ms", "FLA ms", "TC speed-up", "TC vs FLA", "TC rel. diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    raw = []
    for shape in SMOKE if args.smoke else SHAPES:
        ms_cc, ms_tc, ms_fla, diff = bench_shape(shape, args.timing, not own.no_fla, own.decay)
        torch.cuda.empty_cache()
        row = [shape["name"], shape["H"], shape["HV"], f"{ms_cc:.3f}", f"{ms_tc:.3f}",
               "n/a" if ms_fla is None else f"{ms_fla:.3f}", f"{ms_cc / ms_tc:.2f}x",
               "n/a" if ms_fla is None else f"{ms_fla / ms_tc:.2f}x", f"{diff:.1e}"]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
        print(lines[-1], flush=True)
        raw.append(dict(shape=shape, cuda_core_ms=ms_cc, tc_ms=ms_tc, fla_ms=ms_fla, tc_rel_diff=diff))
    env = environment("cuda")
    cmd = "python -m tools.bench.bwd_intra " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# sm100 backward intra stage: tensor-core kernel vs CUDA-core kernel (and FLA 0.6.0)\n\n"
            f"Device: {env.get('gpu', '?')} (torch {env.get('torch')}, CUDA {env.get('cuda')}). Command: `{cmd}`.\n"
            f"Inputs: G = chunk cumsum of {_g_text(own.decay)}. Median of {args.timing.method} timing; "
            f"speed-up = CUDA-core ms / TC ms; TC rel. diff: the largest ||tc - cc|| / ||cc|| over dq, dk, dbeta, "
            f"dG.\n\n" + "\n".join(lines) + "\n")
    print(text)
    if own.out:
        own.out.write_text(text)
    if args.json:
        import json

        args.json.write_text(json.dumps(dict(env=env, rows=raw), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
