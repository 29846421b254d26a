"""Benchmark of KDA training through the public op: `cula.chunk_kda` against FLA 0.6.0's `fla.ops.kda.chunk_kda`, the
forward alone, the whole forward + backward, and the peak extra GPU memory of a training step, on the same bf16
inputs in one process.

    python -m tools.bench.train [--smoke | --quick] [--out docs/benchmarks/train.md] [--json FILE [--resume]]
                                [--no-warm | --warm-only] [--warm-jobs J] [--shard I/N] [--merge FILE ...]
    python -m tools.bench.train --profile B,T,H,HV     # cula's kernels in one training step, no FLA

Every call: raw g with the safe gate (lower_bound = -5, A_log, dt_bias) and q/k L2 norm in kernel, K = V = 128,
gradients of q, k, v, g, beta, A_log and dt_bias. Shapes (issue 19's grid): B in (1, 2), T in (1024, 4096, 8192,
16384), HQK in (16, 32), HV in (HQK, 2 HQK); varlen (B = 1, 8192 tokens) with 10 and 20 sequences of random and
skewed lengths at HQK = HV = 32. `--quick`: six rows across the grid's corners.

FLA runs its own Triton kernels, autotuned in this process on each exact shape (tools/bench/fla_tuning.py: every
tuned choice is forgotten before a shape's first call; each row's line and JSON give how many FLA autotuners that
reaches, `fla_tuners`). Before the rows, FLA's kernels are compiled for every shape to time in parallel processes,
so that this process only tunes (compiling every configuration serially takes minutes per new shape): `warm_one`
runs FLA on a shape cut to 1024 tokens, one shape per compile class (batch, heads, varlen), each class's autotuning
configurations split into parts compiled by separate processes, at most `--warm-jobs` at once, spread over the
visible GPUs. `--no-warm` skips it; `--warm-only` does only that (on a machine with several GPUs: once for the whole
grid, then one `--no-warm` process per GPU). Timing: CUDA events, median over `--rep` calls after `--warmup` calls
(a training step is milliseconds: no do_bench rotation needed). `speed-up` = FLA ms / cula ms. Memory:
`torch.cuda.max_memory_allocated` during one forward + backward minus what was allocated before it (the inputs and
the output gradient), per implementation. The table for this run's card replaces that card's section of `--out`.
`--json FILE` is rewritten after every row; with `--resume`, the rows already in FILE (from an earlier process on the
same card and commit) are kept and only the missing shapes are timed, each still with FLA tuned in this process on it,
so a grid longer than one session's process limit can be timed in several processes. `--shard I/N` times part I of N
parts of the grid, balanced by a rough cost per row (`shape_cost`, `grid.shard`): on a machine with N GPUs, N
processes (each with CUDA_VISIBLE_DEVICES=I and its own --json) time the grid together, each row still with FLA tuned
in the process that times it; `--merge FILE ...` then counts the rows of those files as timed (a shape none of them
has is timed as usual) and writes the whole table. Every row records its card; rows of another card are refused.
`--profile B,T,H,HV`: the mean CUDA time per step of each kernel of cula's forward + backward on that shape
(torch.profiler over 5 steps after 3), the step's own time (CUDA events), and exit: where a step's time goes."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import fla_tuning, grid  # noqa: E402
from tools.bench.prefill import lengths, publish  # noqa: E402

# how a new --out file starts
HEADER = ("# KDA training on Hopper: cula `chunk_kda` vs FLA 0.6.0, whole op\n\n"
          "One section per card; inputs, timing, memory and columns: `tools/bench/train.py`'s docstring.\n")

K = V = 128
LOWER_BOUND = -5.0
TOKENS = 8192
GRID = [dict(B=b, T=t, H=h, HV=h * m) for h in (16, 32) for m in (1, 2) for b in (1, 2)
        for t in (1024, 4096, 8192, 16384)]
GRID += [dict(B=1, T=TOKENS, H=32, HV=32, N=n, lens=kind) for kind in ("random", "skewed") for n in (10, 20)]
QUICK = [dict(B=2, T=8192, H=32, HV=32), dict(B=2, T=8192, H=32, HV=64), dict(B=1, T=16384, H=16, HV=32),
         dict(B=1, T=1024, H=16, HV=16), dict(B=2, T=4096, H=16, HV=16),
         dict(B=1, T=TOKENS, H=32, HV=32, N=20, lens="skewed")]
SMOKE = [dict(B=1, T=1024, H=16, HV=32)]


def make_inputs(shape: dict, seed: int = 0) -> dict:
    B, T, H, HV = shape["B"], shape["T"], shape["H"], shape["HV"]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    x = dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, HV, V).bfloat16(),
             g=r(B, T, HV, K).bfloat16(), beta=torch.sigmoid(r(B, T, HV)).bfloat16(),
             A_log=torch.log(torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen)), dt_bias=0.1 * r(HV * K),
             do=r(B, T, HV, V).bfloat16(), cu=None, cu_cpu=None)
    if "N" in shape:
        cu = torch.tensor([0, *torch.tensor(lengths(shape["N"], T, shape["lens"])).cumsum(0).tolist()],
                          dtype=torch.int32)
        x.update(cu=cu.cuda(), cu_cpu=cu)
    return x


LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def step(impl: str, x: dict, backward: bool):
    """A closure running one forward (and backward) of `impl` ("cula" or "fla") on fresh leaves of x."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    kw = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], use_gate_in_kernel=True,
              use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND)
    if impl == "cula":
        import cula as mod

        if x["cu"] is not None:
            kw.update(cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])
    else:
        from fla.ops import kda as mod

        if x["cu"] is not None:
            kw.update(cu_seqlens=x["cu"].long(), cu_seqlens_cpu=x["cu_cpu"].long())
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]

    def run():
        for t in leaves.values():
            t.grad = None
        o = mod.chunk_kda(*args, **kw)[0]
        if backward:
            o.backward(x["do"])
            return [leaves[n].grad for n in LEAVES]
        return [o]

    return run


def warm_one(shape: dict, part: int = 0, parts: int = 1) -> None:
    """One FLA forward + backward on `shape` cut to 1024 tokens (its B, heads and kind kept; varlen: at most 8
    sequences), with each FLA autotuner restricted to part `part` of `parts` of its configurations
    (fla_tuning.prepare_compile_part): compiles those configurations of the Triton kernels the rows of this shape run.
    Run by fla_tuning.warm, one process per (compile class, part)."""
    fla_tuning.prepare_compile_part(part, parts)
    small = dict(shape, T=1024)
    if "N" in small:
        small["N"] = min(small["N"], 8)
    step("fla", make_inputs(small), True)()
    torch.cuda.synchronize()


def compile_class(shape: dict) -> tuple:
    """What FLA's compiled kernels of a row depend on, as far as warm_one's inputs go: batch, heads, varlen."""
    return shape["B"], shape["H"], shape["HV"], "N" in shape


def time_ms(fn, warmup: int, rep: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def profile_step(shape: dict, steps: int = 5) -> None:
    """Print the mean CUDA time per training step (forward + backward of cula.chunk_kda) of each kernel on
    `shape` (torch.profiler), after the step's median time by CUDA events."""
    from torch.profiler import ProfilerActivity, profile

    run = step("cula", make_inputs(shape), True)
    print(f"{label(shape)}: forward + backward {time_ms(run, 3, 10):.3f} ms; per step:")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"  {e.device_time_total / steps / 1000:8.3f} ms  x{e.count // steps:<3} {e.key[:90]}")


def run_shape(shape: dict, warmup: int, rep: int) -> dict:
    x = make_inputs(shape)
    row = dict(shape=label(shape), gpu=torch.cuda.get_device_name())
    ours_g, fla_g = step("cula", x, True)(), None
    reset = fla_tuning.retune()  # 0 before FLA's first call in this process (nothing tuned yet)
    fla_g = step("fla", x, True)()  # FLA tunes its forward and backward kernels on this shape
    row["fla_tuners"] = len(fla_tuning.autotuners())  # what retune reaches: the log shows every row was re-tuned
    row["grad_rel_err"] = max(rel(a, b) for a, b in zip(ours_g, fla_g))
    del ours_g, fla_g
    for impl in ("cula", "fla"):
        row[f"{impl}_fwd_ms"] = time_ms(step(impl, x, False), warmup, rep)
        row[f"{impl}_step_ms"] = time_ms(step(impl, x, True), warmup, rep)
        row[f"{impl}_mib"] = peak_extra_mib(step(impl, x, True))
    print(f"{row['shape']:<40} fwd cula {row['cula_fwd_ms']:.3f} FLA {row['fla_fwd_ms']:.3f} | fwd+bwd cula "
          f"{row['cula_step_ms']:.3f} FLA {row['fla_step_ms']:.3f} | MiB cula {row['cula_mib']:.0f} FLA "
          f"{row['fla_mib']:.0f} | grad err {row['grad_rel_err']:.1e} | FLA autotuners reset {reset} of "
          f"{row['fla_tuners']}", flush=True)
    del x
    torch.cuda.empty_cache()
    return row


def label(shape: dict) -> str:
    if "N" in shape:
        return f"varlen {shape['N']} seqs {shape['lens']}, {shape['T']} tokens, H={shape['H']} HV={shape['HV']}"
    return f"B={shape['B']} T={shape['T']} H={shape['H']} HV={shape['HV']}"


def geomean(xs):
    return math.exp(sum(math.log(v) for v in xs) / len(xs))


def render(rows: list[dict], env: dict, command: str) -> str:
    head = ("| shape | cula fwd ms | FLA fwd ms | fwd speed-up | cula fwd+bwd ms | FLA fwd+bwd ms | fwd+bwd speed-up "
            "| cula MiB | FLA MiB | grads vs FLA |")
    lines = [f"## {env.get('gpu', '?')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, triton {env.get('triton', '?')}, "
             f"FLA {env.get('fla-core', '?')}, cula-sm100 {env.get('cula-sm100', '?')}.", "",
             f"Command: `{command}`", "", head, "|" + "---|" * (head.count("|") - 1)]
    fwd = [r["fla_fwd_ms"] / r["cula_fwd_ms"] for r in rows]
    whole = [r["fla_step_ms"] / r["cula_step_ms"] for r in rows]
    for r, f, w in zip(rows, fwd, whole):
        lines.append(f"| {r['shape']} | {r['cula_fwd_ms']:.3f} | {r['fla_fwd_ms']:.3f} | {f:.2f}x | "
                     f"{r['cula_step_ms']:.3f} | {r['fla_step_ms']:.3f} | {w:.2f}x | {r['cula_mib']:.0f} | "
                     f"{r['fla_mib']:.0f} | {r['grad_rel_err']:.1e} |")
    mem = [r["fla_mib"] / r["cula_mib"] for r in rows]
    lines += ["", f"Forward: geomean {geomean(fwd):.2f}x, min {min(fwd):.2f}x. Forward + backward: geomean "
              f"{geomean(whole):.2f}x, min {min(whole):.2f}x. Peak extra memory, FLA / cula: min {min(mem):.2f} "
              f"over {len(rows)} rows. `grads vs FLA`: the largest norm-wise relative difference over the seven "
              "gradients."]
    return "\n".join(lines) + "\n"


#: a row's fixed cost in shape_cost's units (token-heads): FLA's in-process tuning (Triton benchmarks every
#: configuration of every kernel for a fixed time, whatever the shape) outweighs the size-bound part of a row; a
#: rough guess that keeps the parts near equal in rows and tilts them by size
ROW_COST = 1 << 22


def shape_cost(shape: dict) -> int:
    """Rough time of one row, for balancing shards: token-heads (B x T x HV) plus ROW_COST."""
    return shape["B"] * shape["T"] * shape["HV"] + ROW_COST


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="six rows across the grid's corners")
    ap.add_argument("--out", type=Path, help="markdown file whose section for this card is rewritten")
    grid.add_arguments(ap)
    ap.add_argument("--profile", metavar="B,T,H,HV",
                    help="cula's kernels in one training step on that shape, then exit")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10)
    args = ap.parse_args(argv)
    grid.check_arguments(ap, args)
    if not torch.cuda.is_available():
        print("train: needs a CUDA device", file=sys.stderr)
        return 1
    if args.profile:
        B, T, H, HV = (int(v) for v in args.profile.split(","))
        profile_step(dict(B=B, T=T, H=H, HV=HV))
        return 0
    fla_tuning.prepare()
    shapes, done, todo = grid.select(ap, args, SMOKE if args.smoke else QUICK if args.quick else GRID, shape_cost,
                                     label, torch.cuda.get_device_name())
    if todo and not args.no_warm:
        print(fla_tuning.warm("tools.bench.train", "warm_one", todo, compile_class, args.warm_jobs), flush=True)
    if args.warm_only:
        return 0
    rows = grid.timed_rows(shapes, done, lambda s: run_shape(s, args.warmup, args.rep), grid.saver(args.json), label)
    publish("train", rows, render, args, argv, header=HEADER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
