"""Benchmark of `cula.fused_recurrent_kda` on cula-sm90's decode kernels against FLA 0.6.0's fused_recurrent_kda,
on the same inputs in one process.

    python -m tools.bench.fused_recurrent [--quick] [--out docs/benchmarks/fused_recurrent.md] [--json FILE]
                                          [--warmup MS] [--rep MS]

Inputs: K = V = 128, HQK = HV = H in (32, 64), bf16 q/k/v/g/beta (raw g with A_log and dt_bias: the softplus gate
in kernel; q/k L2 norm in kernel; post-sigmoid beta), every sequence live.

Tables:
  1. pool decode as vLLM calls it (mtp_decode.py's T = 1 grid): one token per sequence, the N tokens in one row
     with cu_seqlens = arange(N + 1), a state pool of N slots [N, H, K, V] in fp32 or bf16 updated in place through
     ssm_state_indices [N] (int32, a permutation). cula: `cula.fused_recurrent_kda(..., initial_state=pool,
     ssm_state_indices=idx, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)` (the host copy tells the dispatch every
     sequence has one token); FLA: its launch `fused_recurrent_kda_fwd(..., inplace_final_state=True,
     ssm_state_indices=idx, cu_seqlens=cu)` (FLA's public function drops ssm_state_indices). N in
     (1, 2, 4, 8, 16, 32, 64, 128).
  2. new state (FLA's layers): T = 1 with an fp32 initial state [N, H, K, V] and output_final_state=True, and
     outputs only (output_final_state=False) at T = 1 and 4; both sides through their public function.
Columns: device ms per call (20 calls captured in one CUDA graph and replayed under triton's do_bench, median:
tools/bench/mtp_decode.py's `graph_ms`; serving engines run decode steps this way), speed-up = FLA ms / cula ms,
state GB/s = bytes of state read + written per call / device time and its share of the card's HBM peak (issue 21
asks >= 80% for bf16 pools at N = 128), eager ms (Python calls timed by tools/bench/harness.py's `measure`, host cost
included; not with --quick), and the error: max |cula - FLA| / max |FLA| over o and the pool (or final state) after
the first call on the same inputs.

FLA runs its own Triton kernels (FLA_FLASH_KDA=0, FLA_CULA=0), retuned in this process on each shape
(tools/bench/fla_tuning.py). cula runs with CULA_BACKEND=sm90 (a declined call fails instead of timing the
reference). The section for this run's card replaces
that card's section of `--out` (one `## <card>` section per card). `--quick`: N in (1, 16, 128), new-state rows at
H = 64 only; about two minutes on an H100, compilation included.
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

from tools.bench import fla_tuning  # noqa: E402
from tools.bench.harness import Timing, add_do_bench_args, errors, measure  # noqa: E402
from tools.bench.mtp_decode import graph_ms, peak_hbm_gbs  # noqa: E402
from tools.bench.prefill import publish  # noqa: E402

K = V = 128
NS = (1, 2, 4, 8, 16, 32, 64, 128)
HS = (32, 64)
POOL_DTYPES = (torch.float32, torch.bfloat16)
QUICK_NS = (1, 16, 128)
HEADER = ("# fused_recurrent_kda on Hopper: cula (sm90 decode kernels) vs FLA 0.6.0\n\n"
          "One section per card; inputs, timing and columns: `tools/bench/fused_recurrent.py`'s docstring. FLA "
          "runs its own Triton\nkernel (`FLA_FLASH_KDA=0`, `FLA_CULA=0`), autotuned in the timing process on each "
          "exact shape (no restored\ntuning); FlashKDA has no decode kernel, so it has no column here.\n")


def make_inputs(N: int, H: int, T: int = 1, pool_dtype=torch.float32, seed: int = 0) -> dict:
    """One input set on the GPU: the N sequences of T tokens in one row (cu_seqlens on the GPU and on the host), a
    pool of N slots in `pool_dtype` and a permutation of its slots."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).cuda()

    bf = torch.bfloat16
    L = N * T
    cu = torch.arange(0, L + 1, T, dtype=torch.int32)
    return dict(q=r(1, L, H, K).to(bf), k=r(1, L, H, K).to(bf), v=r(1, L, H, V).to(bf), g=r(1, L, H, K).to(bf),
                beta=torch.sigmoid(r(1, L, H)).to(bf), A_log=torch.log(torch.rand(H, generator=gen) * 15 + 1).cuda(),
                dt_bias=r(H * K, scale=0.5), cu=cu.cuda(), cu_cpu=cu, pool=r(N, H, K, V, scale=0.1).to(pool_dtype),
                idx=torch.randperm(N, generator=gen).to(torch.int32).cuda())


def _gate(x: dict) -> dict:
    return dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)


def cula_pool(x: dict, pool: torch.Tensor):
    import cula

    return cula.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                    cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"], ssm_state_indices=x["idx"],
                                    **_gate(x))[0]


def fla_pool(x: dict, pool: torch.Tensor):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                   inplace_final_state=True, ssm_state_indices=x["idx"], cu_seqlens=x["cu"],
                                   **_gate(x))[0]


def cula_new_state(x: dict, h0: torch.Tensor, final: bool):
    import cula

    return cula.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                    output_final_state=final, cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"],
                                    **_gate(x))


def fla_new_state(x: dict, h0: torch.Tensor, final: bool):
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                               output_final_state=final, cu_seqlens=x["cu"], **_gate(x))


def _bandwidth(row: dict, state_bytes: int, peak: float) -> None:
    for side in ("cula", "fla"):
        gbs = state_bytes / (row[f"{side}_ms"] * 1e-3) / 1e9
        row[f"{side}_gbs"], row[f"{side}_hbm_pct"] = gbs, gbs / peak * 100


def pool_row(N: int, H: int, pool_dtype, timing: Timing, eager: bool, peak: float) -> dict:
    x = make_inputs(N, H, pool_dtype=pool_dtype, seed=N + H)
    ours, theirs = x["pool"].clone(), x["pool"].clone()
    fla_tuning.retune()  # FLA's first call on this shape tunes on it
    o_err = errors(cula_pool(x, ours).float(), fla_pool(x, theirs).float())[1]
    row = dict(table="pool", H=H, N=N, pool=str(pool_dtype).replace("torch.", ""),
               err=max(o_err, errors(ours.float(), theirs.float())[1]),
               cula_ms=graph_ms(cula_pool, (x, ours), timing), fla_ms=graph_ms(fla_pool, (x, theirs), timing))
    if eager:
        row["cula_eager_ms"] = measure(cula_pool, [(x, ours)], timing).median_ms
        row["fla_eager_ms"] = measure(fla_pool, [(x, theirs)], timing).median_ms
    _bandwidth(row, 2 * N * H * K * V * pool_dtype.itemsize, peak)
    return row


def new_state_row(N: int, H: int, T: int, final: bool, timing: Timing, eager: bool, peak: float) -> dict:
    x = make_inputs(N, H, T, seed=7 * N + T)
    h0 = x["pool"]  # fp32 [N, H, K, V]: one initial state per sequence
    fla_tuning.retune()
    err = errors(tuple(t for t in cula_new_state(x, h0, final) if t is not None),
                 tuple(t for t in fla_new_state(x, h0, final) if t is not None))[1]
    row = dict(table="new state", H=H, N=N, T=T, final=final, err=err,
               cula_ms=graph_ms(cula_new_state, (x, h0, final), timing),
               fla_ms=graph_ms(fla_new_state, (x, h0, final), timing))
    if eager:
        row["cula_eager_ms"] = measure(cula_new_state, [(x, h0, final)], timing).median_ms
        row["fla_eager_ms"] = measure(fla_new_state, [(x, h0, final)], timing).median_ms
    _bandwidth(row, (2 if final else 1) * N * H * K * V * 4, peak)
    return row


def _x(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _eager(r: dict) -> str:
    if "cula_eager_ms" not in r:
        return "- | - |"
    return f"{r['fla_eager_ms']:.4f} | {r['cula_eager_ms']:.4f} |"


def render(rows: list[dict], env: dict, command: str) -> str:
    peak = rows[0]["peak_gbs"] if rows else 0.0
    lines = [f"## {env.get('gpu', '?')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, triton {env.get('triton', '?')}, "
             f"FLA {env.get('fla-core', env.get('flash-linear-attention', '?'))}, "
             f"cula-sm90 {env.get('cula-sm90', '?')}; HBM peak taken as {peak:.0f} GB/s.", "",
             f"Command: `{command}`", "",
             "### Pool decode (vLLM: T = 1, one row with cu_seqlens, pool updated in place)", "",
             "| H | N | pool | FLA ms | cula ms | speed-up | cula state GB/s | cula % of HBM | FLA % of HBM "
             "| FLA eager ms | cula eager ms | max rel err |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    pools = [r for r in rows if r["table"] == "pool"]
    for r in pools:
        pool = r["pool"]
        lines.append(f"| {r['H']} | {r['N']} | {pool} | {r['fla_ms']:.4f} | {r['cula_ms']:.4f} "
                     f"| {_x(r['fla_ms'], r['cula_ms'])} | {r['cula_gbs']:.0f} | {r['cula_hbm_pct']:.0f}% "
                     f"| {r['fla_hbm_pct']:.0f}% | {_eager(r)} {r['err']:.1e} |")
    if pools:
        sp = [r["fla_ms"] / r["cula_ms"] for r in pools]
        lines += ["", f"speed-up over the pool grid: min {min(sp):.2f}x, max {max(sp):.2f}x over {len(sp)} cells."]
        big = [r for r in pools if r["pool"] == "bfloat16" and r["N"] == max(p["N"] for p in pools)]
        if big:
            lines.append("bf16 pools at N = " + str(big[0]["N"]) + ": " + ", ".join(
                f"H = {r['H']} {r['cula_hbm_pct']:.0f}% of HBM" for r in big) + " (issue 21: >= 80%).")
    news = [r for r in rows if r["table"] == "new state"]
    if news:
        lines += ["", "### New state (FLA's layers: fp32 initial state per sequence)", "",
                  "| H | N | T | output | FLA ms | cula ms | speed-up | cula % of HBM | FLA % of HBM "
                  "| FLA eager ms | cula eager ms | max rel err |",
                  "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in news:
            what = "o, final state" if r["final"] else "o only"
            lines.append(f"| {r['H']} | {r['N']} | {r['T']} | {what} | {r['fla_ms']:.4f} | {r['cula_ms']:.4f} "
                         f"| {_x(r['fla_ms'], r['cula_ms'])} | {r['cula_hbm_pct']:.0f}% | {r['fla_hbm_pct']:.0f}% "
                         f"| {_eager(r)} {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N in (1, 16, 128), new-state rows at H = 64, no eager")
    ap.add_argument("--out", type=Path, help="markdown file whose section for this card is rewritten")
    ap.add_argument("--json", type=Path)
    add_do_bench_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_recurrent: needs a CUDA device", file=sys.stderr)
        return 1
    fla_tuning.prepare()  # before FLA is imported
    os.environ["FLA_CULA"] = "0"  # FLA's own kernel, even where cula.fla is registered
    os.environ["CULA_BACKEND"] = "sm90"  # fail loudly rather than time the reference

    timing = Timing(warmup=args.warmup, repeats=args.rep, method="do_bench")
    peak = peak_hbm_gbs()
    ns = QUICK_NS if args.quick else NS
    rows = []

    def keep(row):
        row["peak_gbs"] = peak
        rows.append(row)
        print(row, flush=True)

    with torch.no_grad():
        for pool_dtype in POOL_DTYPES:
            for H in HS:
                for N in ns:
                    keep(pool_row(N, H, pool_dtype, timing, not args.quick, peak))
                    torch.cuda.empty_cache()
        for H in (64,) if args.quick else HS:
            for N in ns:
                for T, final in ((1, True), (1, False), (4, False)):
                    keep(new_state_row(N, H, T, final, timing, not args.quick, peak))
                    torch.cuda.empty_cache()
    if args.out and not args.out.exists():
        args.out.write_text(HEADER)
    publish("fused_recurrent", rows, render, args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
