"""Benchmark of `cula.fused_recurrent_kda` on cula-sm90's decode kernels against FLA 0.6.0's fused_recurrent_kda,
on the same inputs in one process.

    python -m tools.bench.fused_recurrent [--quick] [--out docs/benchmarks/fused_recurrent.md] [--json FILE]
                                          [--warmup MS] [--rep MS]
    python -m tools.bench.fused_recurrent --slots-tilings   # the speculative step per recurrent-kernel tiling

`--slots-tilings` prints only the sweep behind the speculative step's tiling (configs.recurrent_tiling with
MODE_SLOTS): cula's slots mode at each tiling of SLOTS_SWEEP_TILINGS and at the dispatch's pick, H = 64, fp32 and
bf16 pools, T in (2, 4), N in (16, 128), graph-timed as the tables; no FLA.

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
  3. speculative pool step as vLLM calls it (speculative decoding): N requests of T in (2, 4) draft tokens in one
     row with cu_seqlens = arange(0, N * T + 1, T), a pool of P = N * T slots [P, H, K, V] in fp32 or bf16,
     ssm_state_indices [N, T] (int32, a permutation of range(P): a slot per token, the state after token t written
     to slot idx[n, t]) and num_accepted_tokens [N] (int32, seeded uniform in [1, T]: request n starts from the
     state in slot idx[n, num_accepted_tokens[n] - 1]). cula: `cula.fused_recurrent_kda(..., initial_state=pool,
     ssm_state_indices=idx, num_accepted_tokens=acc, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)` (sm90's slots mode);
     FLA: `fused_recurrent_kda_fwd(..., inplace_final_state=True, ssm_state_indices=idx, num_accepted_tokens=acc,
     cu_seqlens=cu)`. N as table 1.
Columns: device ms per call (20 calls captured in one CUDA graph and replayed under triton's do_bench, median:
tools/bench/mtp_decode.py's `graph_ms`; serving engines run decode steps this way), speed-up = FLA ms / cula ms,
state GB/s = bytes of state read + written per call / device time (table 3: one state read and T written per
request and head) and its share of the card's HBM peak (issue 21 asks >= 80% for bf16 pools at N = 128), eager ms
(Python calls timed by tools/bench/harness.py's `measure`, host cost included; not with --quick), and the error:
max |cula - FLA| / max |FLA| over o and the pool slots written (or the final state) after one call of each on
identical copies of the inputs. Under tables 1 and 3: the least and largest speed-up.

FLA runs its own Triton kernel (FLA_FLASH_KDA=0, FLA_CULA=0); it has no autotuner, and `fla_tuning.retune` before
each shape keeps that true should a later FLA add one (tools/bench/fla_tuning.py). cula runs with CULA_BACKEND=sm90
(a declined call fails instead of timing the reference). The section for this run's card replaces that card's
section of `--out` (one `## <card>` section per card). `--quick`: N in (1, 16, 128), new-state and speculative rows
at H = 64 only; meant to take about three minutes on an H100, compilation included.
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
from tools.bench.harness import Timing, add_do_bench_args, errors, measure, peak_hbm_gbs  # noqa: E402
from tools.bench.mtp_decode import graph_ms  # noqa: E402
from tools.bench.prefill import publish  # noqa: E402

K = V = 128
NS = (1, 2, 4, 8, 16, 32, 64, 128)
HS = (32, 64)
POOL_DTYPES = (torch.float32, torch.bfloat16)
QUICK_NS = (1, 16, 128)
SPEC_TS = (2, 4)  # draft tokens per request in the speculative pool step
HEADER = ("# fused_recurrent_kda on Hopper: cula (sm90 decode kernels) vs FLA 0.6.0\n\n"
          "One section per card; inputs, timing and columns: `tools/bench/fused_recurrent.py`'s docstring. FLA "
          "runs its own Triton\nkernel (`FLA_FLASH_KDA=0`, `FLA_CULA=0`), which has no autotuner (its launch "
          "parameters come from\n`triton.heuristics`: nothing tuned carries over between shapes); FlashKDA has no "
          "decode kernel, so it has no column\nhere.\n")


def make_inputs(N: int, H: int, T: int = 1, pool_dtype=torch.float32, seed: int = 0, *, device="cuda",
                slot_per_token: bool = False) -> dict:
    """One input set on `device`: the N sequences of T tokens in one row (cu_seqlens on `device` and on the host)
    and a state pool in `pool_dtype` (its values drawn on `device`). Without `slot_per_token`: a pool of N slots
    and `idx` [N] int32, a permutation of its slots. With it (the speculative step): a pool of N * T slots, `idx`
    [N, T] int32, a permutation of range(N * T) (each request's T slots distinct), and `accepted` [N] int32 in
    [1, T] (num_accepted_tokens)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # the pool is drawn where it lives: up to 512 slots of H * K * V values, slow to draw on the host
    pool_gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device)

    bf = torch.bfloat16
    L = N * T
    P = L if slot_per_token else N
    cu = torch.arange(0, L + 1, T, dtype=torch.int32)
    x = dict(q=r(1, L, H, K).to(bf), k=r(1, L, H, K).to(bf), v=r(1, L, H, V).to(bf), g=r(1, L, H, K).to(bf),
             beta=torch.sigmoid(r(1, L, H)).to(bf), A_log=torch.log(torch.rand(H, generator=gen) * 15 + 1).to(device),
             dt_bias=r(H * K, scale=0.5), cu=cu.to(device), cu_cpu=cu,
             pool=(torch.randn(P, H, K, V, generator=pool_gen, device=device) * 0.1).to(pool_dtype))
    idx = torch.randperm(P, generator=gen).to(torch.int32)
    if slot_per_token:
        x["idx"] = idx.reshape(N, T).to(device)
        x["accepted"] = torch.randint(1, T + 1, (N,), generator=gen, dtype=torch.int32).to(device)
    else:
        x["idx"] = idx.to(device)
    return x


def _gate(x: dict) -> dict:
    return dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)


def cula_pool(x: dict, pool: torch.Tensor):
    import cula

    return cula.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                    cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"], ssm_state_indices=x["idx"],
                                    num_accepted_tokens=x.get("accepted"), **_gate(x))[0]


def fla_pool(x: dict, pool: torch.Tensor):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                   inplace_final_state=True, ssm_state_indices=x["idx"],
                                   num_accepted_tokens=x.get("accepted"), cu_seqlens=x["cu"], **_gate(x))[0]


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


def rel_err(ours, reference) -> float:
    """max |ours - ref| / max |ref| (0 / 0 counts as 0), the largest over pairs of same-shape tensors, reduced on
    their device in fp32 (a pool holds GBs; tools/bench/harness.py's `errors` would copy it to the host in fp64).
    A NaN or inf in either makes it NaN."""
    worst = 0.0
    for a, b in zip(ours, reference, strict=True):
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return float("nan")
        diff, scale = (a - b).abs().max().item(), b.abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def _pool_step_row(x: dict, row: dict, state_bytes: int, timing: Timing, eager: bool, peak: float) -> dict:
    """One row of a pool table: both sides called once on identical copies of the pool (the error over o and the
    slots written), then timed, each on its own copy."""
    ours, theirs = x["pool"].clone(), x["pool"].clone()
    fla_tuning.retune()  # FLA's first call on this shape tunes on it
    o_ours, o_theirs = cula_pool(x, ours), fla_pool(x, theirs)
    written = x["idx"].flatten().long()
    row["err"] = rel_err((o_ours, ours[written]), (o_theirs, theirs[written]))
    del o_ours, o_theirs
    row["cula_ms"], row["fla_ms"] = graph_ms(cula_pool, (x, ours), timing), graph_ms(fla_pool, (x, theirs), timing)
    if eager:
        row["cula_eager_ms"] = measure(cula_pool, [(x, ours)], timing).median_ms
        row["fla_eager_ms"] = measure(fla_pool, [(x, theirs)], timing).median_ms
    _bandwidth(row, state_bytes, peak)
    return row


def pool_row(N: int, H: int, pool_dtype, timing: Timing, eager: bool, peak: float) -> dict:
    x = make_inputs(N, H, pool_dtype=pool_dtype, seed=N + H)
    row = dict(table="pool", H=H, N=N, pool=str(pool_dtype).replace("torch.", ""))
    return _pool_step_row(x, row, 2 * N * H * K * V * pool_dtype.itemsize, timing, eager, peak)


def spec_row(N: int, H: int, T: int, pool_dtype, timing: Timing, eager: bool, peak: float) -> dict:
    """The speculative pool step: N requests of T draft tokens, a slot per token (see make_inputs)."""
    x = make_inputs(N, H, T, pool_dtype=pool_dtype, seed=1000 + 10 * N + H + T, slot_per_token=True)
    row = dict(table="spec", H=H, N=N, T=T, pool=str(pool_dtype).replace("torch.", ""))
    # per request and head: the state after the last accepted token read, the state after each draft token written
    return _pool_step_row(x, row, (1 + T) * N * H * K * V * pool_dtype.itemsize, timing, eager, peak)


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
    specs = [r for r in rows if r["table"] == "spec"]
    if specs:
        lines += ["", "### Speculative pool step (vLLM: T draft tokens per request, a slot per token, "
                  "num_accepted_tokens)", "",
                  "| H | N | T | pool | FLA ms | cula ms | speed-up | cula state GB/s | cula % of HBM | FLA % of HBM "
                  "| FLA eager ms | cula eager ms | max rel err |",
                  "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in specs:
            lines.append(f"| {r['H']} | {r['N']} | {r['T']} | {r['pool']} | {r['fla_ms']:.4f} | {r['cula_ms']:.4f} "
                         f"| {_x(r['fla_ms'], r['cula_ms'])} | {r['cula_gbs']:.0f} | {r['cula_hbm_pct']:.0f}% "
                         f"| {r['fla_hbm_pct']:.0f}% | {_eager(r)} {r['err']:.1e} |")
        sp = [r["fla_ms"] / r["cula_ms"] for r in specs]
        lines += ["", f"speed-up over the speculative grid: min {min(sp):.2f}x, max {max(sp):.2f}x over {len(sp)} "
                  "cells."]
    return "\n".join(lines) + "\n"


#: tilings of the speculative-step sweep (`--slots-tilings`): those the recurrent kernel's dispatch table picks from
#: and five others of configs.TILINGS
SLOTS_SWEEP_TILINGS = ((32, 2, 2, 1), (64, 4, 4, 0), (32, 4, 4, 0), (32, 4, 2, 0), (64, 2, 4, 1), (32, 2, 4, 1),
                       (16, 4, 2, 0), (64, 2, 4, 0))


def slots_at_tiling(x: dict, tiling):
    """The speculative pool step of `x` (make_inputs with slot_per_token) on the sm90 recurrent kernel's slots mode
    at `tiling` (None: the dispatch's pick), through cula_sm90.decode.launch.run_recurrent."""
    from cula_sm90.decode import configs, launch

    N, T = x["idx"].shape
    H = x["v"].shape[2]
    q, k, v, g = (x[name].view(N, T, H, -1) for name in ("q", "k", "v", "g"))
    return launch.run_recurrent(configs.MODE_SLOTS, q, k, v, g, x["beta"].view(N, T, H), x["pool"], x["idx"],
                                x["A_log"], x["dt_bias"], scale=K ** -0.5, lower_bound=None,
                                use_qk_l2norm_in_kernel=True, num_accepted_tokens=x["accepted"], tiling=tiling)[0]


def slots_tiling_sweep(timing: Timing, H: int = 64) -> str:
    """Device ms of the speculative pool step per tiling of the recurrent kernel (the table
    configs.recurrent_tiling(..., MODE_SLOTS) comes from), fp32 and bf16 pools, T in SPEC_TS, N in (16, 128), as a
    markdown table."""
    keys = ("dispatch", *("x".join(map(str, t)) for t in SLOTS_SWEEP_TILINGS))
    lines = [f"| pool | T | N | {' | '.join(keys)} |", "|---|---:|---:|" + "---:|" * len(keys)]
    with torch.no_grad():
        for pool_dtype in POOL_DTYPES:
            for T in SPEC_TS:
                for N in (16, 128):
                    x = make_inputs(N, H, T, pool_dtype, slot_per_token=True)
                    ms = [graph_ms(slots_at_tiling, (x, t), timing) for t in (None, *SLOTS_SWEEP_TILINGS)]
                    lines.append(f"| {str(pool_dtype).replace('torch.', '')} | {T} | {N} | "
                                 + " | ".join(f"{m:.4f}" for m in ms) + " |")
                    print(lines[-1], flush=True)
                    del x
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="N in (1, 16, 128), new-state and speculative rows at H = 64, no eager")
    ap.add_argument("--out", type=Path, help="markdown file whose section for this card is rewritten")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--slots-tilings", action="store_true",
                    help="only the speculative step per tiling of the recurrent kernel (H = 64; no FLA), printed")
    add_do_bench_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_recurrent: needs a CUDA device", file=sys.stderr)
        return 1
    fla_tuning.prepare()  # before FLA is imported
    os.environ["FLA_CULA"] = "0"  # FLA's own kernel, even where cula.fla is registered
    os.environ["CULA_BACKEND"] = "sm90"  # fail loudly rather than time the reference

    timing = Timing(warmup=args.warmup, repeats=args.rep, method="do_bench")
    if args.slots_tilings:
        print(slots_tiling_sweep(timing))
        return 0
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
        for pool_dtype in POOL_DTYPES:
            for H in (64,) if args.quick else HS:
                for T in SPEC_TS:
                    for N in ns:
                        keep(spec_row(N, H, T, pool_dtype, timing, not args.quick, peak))
                        torch.cuda.empty_cache()
    if args.out and not args.out.exists():
        args.out.write_text(HEADER)
    publish("fused_recurrent", rows, render, args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
