"""Benchmark of KDA prefill on Hopper: cula (`cula.kda_prefill` on the sm90 backend) against FlashKDA
(`flash_kda.fwd`, MoonshotAI's CUTLASS forward) and FLA 0.6.0 (`fla.ops.kda.chunk_kda`, its own Triton kernels),
on the same bf16 inputs in one process.

    python -m tools.bench.prefill [--smoke] [--no-fla | --fla-subset] [--out docs/benchmarks/prefill.md]
                                  [--json FILE [--resume]] [--shard I/N] [--merge FILE ...] [--warmup MS]
                                  [--rep MS] [--no-warm | --warm-only] [--warm-jobs J] [--profile SHAPE] [--packing]

Every call does what FlashKDA does: safe gate (lower_bound = -5) from raw g with A_log / dt_bias, q/k L2 norm and
sigmoid(beta) in kernel (beta passed as logits), K = V = 128, no initial state, the final state returned.
Shapes (issue 18's grid): fixed length H = 64, B in (1, 2), T in (100, 512, 1024, 4096, 8192, 16384); varlen with
10, 20 and 64 sequences of 4096 / 8192 / 16384 tokens in all (lengths uniform, a seeded random split, or skewed: one
sequence holds half), H = 64; B = 4 T = 2048 H = 32; B = 1 T = 32768 H = 32; B = 1 T = 65536 H = 16.

Timing: `triton.testing.do_bench` median after warm-up (tools/bench/harness.py), each op called as a user calls it:
cula through the public op (validation, dispatch, `intracard_cp="auto"`, `cu_seqlens_cpu` given), FlashKDA with its
outputs allocated in the call, FLA under `torch.no_grad` with `FLA_FLASH_KDA=0` (its own kernels) and autotuned in
this process on each exact shape (tools/bench/fla_tuning.py). Varlen offsets are made once per input set, int32 for
cula and int64 for FLA and FlashKDA (`varlen_offsets`), and every call gets the same tensors: FLA caches its chunk
indices by tensor identity, as a model's layers reuse one batch's offsets. Columns: `vs FlashKDA` = FlashKDA ms /
cula ms, `vs FLA` = FLA ms / cula ms; `err vs FlashKDA` = max |cula - FlashKDA| / max |FlashKDA| over o and the
final state.
Before the rows, FLA's kernels are compiled for the shapes it is timed on in parallel processes (`warm_one`: one shape
per compile class, each class's autotuning configurations split over processes, at most `--warm-jobs` at once,
spread over the visible GPUs; `--no-warm` skips it, `--warm-only` does only that), so that this process only tunes.
Tuning on each shape still takes a process tens of seconds, so `--fla-subset` times FLA on FLA_SUBSET only (six
shapes, one of each kind; "-" elsewhere, its geomean over those). The table for this run's card replaces that card's
section of `--out` (one section per card).

Several processes, as tools/bench/train.py's grid (tools/bench/grid.py): `--json FILE` is rewritten after every row
and `--resume` keeps the rows already in it; `--shard I/N` times part I of N parts of the grid balanced by
`row_cost` (on a machine with N GPUs: `--warm-only` once, then one `--no-warm` process per GPU, each with
CUDA_VISIBLE_DEVICES=I and its own --json); `--merge FILE ...` counts the rows of those files as timed and writes
the whole table. Every row records its card; rows of another card are refused.

`--packing`: the sm90 stage 1 over packed tiles against the unpacked one (`cula_sm90.prefill.forward.prefill`'s
`pack_stage1`), the whole call, on the varlen 64-sequence shapes, beside FlashKDA; the outputs of the two must be
equal bit for bit. Prints a table and exits (the measurement behind `forward.packing_pays`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import fla_tuning, grid  # noqa: E402
from tools.bench.harness import Timing, add_do_bench_args, environment, measure  # noqa: E402

K = 128
LOWER_BOUND = -5.0
FIXED = [dict(B=b, T=t, H=64) for b in (1, 2) for t in (100, 512, 1024, 4096, 8192, 16384)]
LENGTH_KINDS = ("uniform", "random", "skewed")  # how `lengths` splits a varlen shape's tokens
VARLEN = [dict(B=1, N=n, T=t, H=64, lens=kind) for n in (10, 20, 64) for t in (4096, 8192, 16384)
          for kind in LENGTH_KINDS]
EXTRA = [dict(B=4, T=2048, H=32), dict(B=1, T=32768, H=32), dict(B=1, T=65536, H=16)]
GRID = FIXED + VARLEN + EXTRA
SMOKE = [dict(B=1, T=100, H=64), dict(B=1, T=4096, H=64), dict(B=1, N=10, T=4096, H=64, lens="skewed")]
# one shape of each kind: a single sequence, a batch, varlen with few / many sequences, fewer heads, CP
FLA_SUBSET = [dict(B=1, T=8192, H=64), dict(B=2, T=8192, H=64), dict(B=1, N=20, T=8192, H=64, lens="uniform"),
              dict(B=1, N=64, T=8192, H=64, lens="random"), dict(B=4, T=2048, H=32), dict(B=1, T=65536, H=16)]


def lengths(N: int, T: int, kind: str, seed: int = 0) -> list[int]:
    """N sequence lengths summing to T: equal, a seeded random split, or one sequence taking half."""
    if kind == "uniform":
        base = [T // N] * N
    elif kind == "random":
        gen = torch.Generator().manual_seed(1234 + seed)
        w = torch.rand(N, generator=gen) + 0.05
        base = [int(x) for x in (w / w.sum() * T).floor().tolist()]
    elif kind == "skewed":
        base = [T // 2] + [(T - T // 2) // (N - 1)] * (N - 1)
    else:
        raise ValueError(kind)
    base[-1] += T - sum(base)
    return base


def make_inputs(shape: dict, seed: int = 0) -> dict:
    """One input set on the GPU: raw g, beta logits, A_log [H] and dt_bias [H * K] fp32; for varlen shapes
    cu_seqlens int32 on the GPU and on the host (cula's), and int64 copies of both made here once (FLA's and
    FlashKDA's index type): as a model builds its batch's offsets once for every layer. FLA caches its chunk indices
    by the identity of these tensors, so a conversion inside the timed call would redo that work (a host round trip)
    on every call."""
    B, T, H = shape["B"], shape["T"], shape["H"]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    x = dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, H, K).bfloat16(),
             g=r(B, T, H, K).bfloat16(), beta=r(B, T, H).bfloat16(),
             A_log=torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen)), dt_bias=0.1 * r(H * K))
    if "N" in shape:
        cu = torch.tensor([0, *torch.tensor(lengths(shape["N"], T, shape["lens"])).cumsum(0).tolist()],
                          dtype=torch.int32)
        x.update(varlen_offsets(cu))
    return x


def varlen_offsets(cu: torch.Tensor) -> dict:
    """The offsets of a varlen input set from int32 host offsets `cu`: cula's (int32, on the GPU and the host) and
    FLA's / FlashKDA's int64 copies, made once (see make_inputs)."""
    return dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, cu_seqlens_i64=cu.long().cuda(), cu_seqlens_cpu_i64=cu.long())


def gate_kwargs(x: dict) -> dict:
    """The keyword arguments every timed call shares (FlashKDA's fixed configuration) for the input set x."""
    return dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=x["A_log"], dt_bias=x["dt_bias"], safe_gate=True, lower_bound=LOWER_BOUND,
                output_final_state=True)


def cula_prefill(x: dict, intracard_cp="auto"):
    import cula

    return cula.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x.get("cu_seqlens"),
                            cu_seqlens_cpu=x.get("cu_seqlens_cpu"), intracard_cp=intracard_cp, **gate_kwargs(x))


def fla_offsets(x: dict) -> dict:
    """FLA's cu_seqlens / cu_seqlens_cpu keywords for the input set x: varlen_offsets' int64 tensors (a varlen set
    without them is a KeyError, never a dense call), none for a dense set."""
    if "cu_seqlens" not in x:
        return {}
    return dict(cu_seqlens=x["cu_seqlens_i64"], cu_seqlens_cpu=x["cu_seqlens_cpu_i64"])


def fla_prefill(x: dict):
    from fla.ops.kda import chunk_kda

    with torch.no_grad():
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **fla_offsets(x), **gate_kwargs(x))


def warm_one(shape: dict, part: int = 0, parts: int = 1) -> None:
    """One FLA prefill on `shape` cut to at most 1024 tokens (its B, heads and kind kept; varlen: at most 8
    sequences), each FLA autotuner restricted to part `part` of `parts` of its configurations: compiles those
    configurations of the kernels the shape's FLA column runs. Run by fla_tuning.warm."""
    fla_tuning.prepare_compile_part(part, parts)
    small = dict(shape, T=min(shape["T"], 1024))
    if "N" in small:
        small["N"] = min(small["N"], 8)
    fla_prefill(make_inputs(small))
    torch.cuda.synchronize()


def compile_class(shape: dict) -> tuple:
    """What FLA's compiled kernels of a shape depend on, as far as warm_one's inputs go: batch, heads, varlen, and
    whether the token count is a multiple of 16 (Triton specialises integer arguments on it)."""
    return shape["B"], shape["H"], "N" in shape, shape["T"] % 16 == 0


def flashkda_prefill(x: dict):
    """FlashKDA as a user calls it: outputs allocated per call; its final state is V-first, [N, H, V, K]."""
    import flash_kda

    q = x["q"]
    _B, _T, H, _K = q.shape
    cu = x.get("cu_seqlens")
    N = q.shape[0] if cu is None else cu.numel() - 1
    out = torch.empty_like(x["v"])
    final = torch.empty(N, H, K, K, dtype=torch.float32, device=q.device)
    flash_kda.fwd(q, x["k"], x["v"], x["g"], x["beta"], K ** -0.5, out, A_log=x["A_log"],
                  dt_bias=x["dt_bias"].view(H, K), lower_bound=LOWER_BOUND, initial_state=None, final_state=final,
                  cu_seqlens=fla_offsets(x).get("cu_seqlens"))
    return out, final


def rel_err(ours, ref_out, ref_state_vfirst) -> float:
    """max |ours - ref| / max |ref| over o and the final state (FlashKDA's state transposed to [N, H, K, V])."""
    o, state = ours
    ref_state = ref_state_vfirst.transpose(-1, -2)
    return max(((o.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item(),
               ((state - ref_state).abs().max() / ref_state.abs().max()).item())


def profile_shape(text: str) -> dict:
    """`--profile`'s shape: "B,T,H" (fixed length) or "N,T,H,LENS" (varlen: N sequences of T tokens in all, LENS
    one of uniform / random / skewed, as the grid's varlen shapes)."""
    parts = text.split(",")
    try:
        if len(parts) == 3:
            B, T, H = (int(v) for v in parts)
            return dict(B=B, T=T, H=H)
        if len(parts) == 4 and parts[3] in LENGTH_KINDS:
            N, T, H = (int(v) for v in parts[:3])
            return dict(B=1, N=N, T=T, H=H, lens=parts[3])
    except ValueError:
        pass
    kinds = ", ".join(LENGTH_KINDS)
    raise argparse.ArgumentTypeError(f"{text!r}: expected B,T,H or N,T,H,LENS with LENS one of {kinds}")


def profile_kernels(shape: dict, calls: int = 10) -> None:
    """Mean CUDA time per call of each kernel of cula's prefill, then of FlashKDA's, at one shape (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    x = make_inputs(shape)
    runs = [("cula", cula_prefill)]
    try:
        import flash_kda  # noqa: F401
        runs.append(("FlashKDA", flashkda_prefill))
    except ImportError:
        print("FlashKDA not importable: cula only")
    for name, fn in runs:
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(x)
            torch.cuda.synchronize()
        print(f"profile {name}, {label(shape)}: per call")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            print(f"  {e.device_time_total / calls / 1000:8.3f} ms  {e.key[:90]}")


def packing_ab(timing: Timing) -> None:
    """Print cula's prefill with stage 1 packed and unpacked (forward.prefill's pack_stage1 True / False) on the
    varlen 64-sequence shapes, beside FlashKDA, each the median of `timing` in this process."""
    from cula_sm90.prefill import forward

    def call(x, pack):
        return forward.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None,
                               x["cu_seqlens"], x["cu_seqlens_cpu"], scale=K ** -0.5, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=LOWER_BOUND,
                               beta_activation="sigmoid", pack_stage1=pack)

    print(f"{torch.cuda.get_device_name()}: stage 1 packed vs unpacked, whole call (ms)")
    print("| shape | chunks | tiles | packing_pays | unpacked | packed | speed-up | FlashKDA | packed vs FlashKDA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in (s for s in VARLEN if s["N"] == 64):
        x = make_inputs(shape)
        lens = tuple(lengths(shape["N"], shape["T"], shape["lens"]))
        unpacked, packed = call(x, False), call(x, True)
        if not all(torch.equal(a, b) for a, b in zip(unpacked, packed)):
            raise AssertionError(f"{label(shape)}: packed and unpacked stage 1 give different outputs")
        ms = {pack: measure(call, [(x, pack)], timing).median_ms for pack in (False, True)}
        fk = measure(flashkda_prefill, [(x,)], timing).median_ms
        print(f"| {label(shape)} | {sum(-(-n // 64) for n in lens)} | {len(forward.packed_tiles(lens))} | "
              f"{forward.packing_pays(lens)} | {ms[False]:.3f} | {ms[True]:.3f} | {ms[False] / ms[True]:.2f}x | "
              f"{fk:.3f} | {fk / ms[True]:.2f}x |", flush=True)


def label(shape: dict) -> str:
    if "N" in shape:
        return f"varlen {shape['N']} seqs, {shape['T']} tokens, {shape['lens']}, H={shape['H']}"
    return f"B={shape['B']} T={shape['T']} H={shape['H']}"


def geomean(xs):
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else None


def timed_by_fla(shape: dict, fla_shapes) -> bool:
    """Whether FLA is timed on `shape`: `fla_shapes` is a list of shapes, or None for every shape."""
    return fla_shapes is None or shape in fla_shapes


def row_cost(shape: dict, with_fla: bool) -> float:
    """Rough seconds of one row, for balancing shards (grid.shard): FLA's in-process tuning (about 40 s whatever
    the shape) outweighs the timed calls, which grow with the token-heads."""
    size = shape["B"] * shape["T"] * shape["H"] / 2**20
    return (40 + 2 * size) if with_fla else (2 + size)


def run_shape(shape: dict, timing: Timing, with_fla: bool) -> dict:
    """One row: cula and FlashKDA timed on `shape` (and FLA, tuned on it in this process, when `with_fla`), the
    difference of cula's outputs from FlashKDA's, the card."""
    x = make_inputs(shape)
    ref_o, ref_state = flashkda_prefill(x)
    row = dict(shape=label(shape), gpu=torch.cuda.get_device_name(),
               err_flashkda=rel_err(cula_prefill(x), ref_o, ref_state))
    del ref_o, ref_state
    row["cula_ms"] = measure(cula_prefill, [(x,)], timing).median_ms
    row["flashkda_ms"] = measure(flashkda_prefill, [(x,)], timing).median_ms
    if with_fla:
        fla_tuning.retune()
        fla_prefill(x)  # tunes on this shape
        row["fla_ms"] = measure(fla_prefill, [(x,)], timing).median_ms
        row["fla_tuners"] = len(fla_tuning.autotuners())  # what retune reaches (printed: a check of the method)
    fla = f"{row['fla_ms']:.3f} (autotuners {row['fla_tuners']})" if with_fla else "-"
    print(f"{row['shape']:<48} cula {row['cula_ms']:.3f}  FlashKDA {row['flashkda_ms']:.3f}  FLA {fla}  "
          f"err {row['err_flashkda']:.2e}", flush=True)
    del x
    torch.cuda.empty_cache()
    return row


def card_header(env: dict, command: str) -> list[str]:
    """The lines that open a card's section: the card, the software, the command."""
    return [f"## {env.get('gpu', '?')}", "",
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, triton {env.get('triton', '?')}, "
            f"FLA {env.get('fla-core', '?')}, cula-sm90 {env.get('cula-sm90', '?')}.", "",
            f"Command: `{command}`", ""]


def render(rows: list[dict], env: dict, command: str) -> str:
    with_fla = any("fla_ms" in r for r in rows)
    head = "| shape | cula ms | FlashKDA ms | " + ("FLA ms | " if with_fla else "") + "vs FlashKDA | " + \
        ("vs FLA | " if with_fla else "") + "err vs FlashKDA |"
    lines = [*card_header(env, command), head, "|" + "---|" * (head.count("|") - 1)]
    vs_fk = [r["flashkda_ms"] / r["cula_ms"] for r in rows]
    vs_fla = [r["fla_ms"] / r["cula_ms"] for r in rows if "fla_ms" in r]
    for i, r in enumerate(rows):
        cells = [r["shape"], f"{r['cula_ms']:.3f}", f"{r['flashkda_ms']:.3f}"]
        has = "fla_ms" in r
        cells += ([f"{r['fla_ms']:.3f}"] if has else ["-"]) if with_fla else []
        cells += [f"{vs_fk[i]:.2f}x"]
        cells += ([f"{r['fla_ms'] / r['cula_ms']:.2f}x"] if has else ["-"]) if with_fla else []
        cells += [f"{r['err_flashkda']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"vs FlashKDA: geomean {geomean(vs_fk):.2f}x, min {min(vs_fk):.2f}x over {len(rows)} shapes."]
    if with_fla:
        lines.append(f"vs FLA: geomean {geomean(vs_fla):.2f}x, min {min(vs_fla):.2f}x over {len(vs_fla)} shapes.")
    return "\n".join(lines) + "\n"


HEADER = ("# KDA prefill on Hopper: cula vs FlashKDA and FLA 0.6.0\n\n"
          "One section per card; inputs, timing and columns: `tools/bench/prefill.py`'s docstring.\n")


def write_section(path: Path, section: str, header: str = HEADER) -> None:
    """Replace this card's `## <card>` section of `path` (or append it), keeping the other cards' sections; a new
    file starts with `header`."""
    title = section.splitlines()[0]
    text = path.read_text() if path.exists() else header
    parts = text.split("\n## ")
    kept = [parts[0].rstrip("\n")] + ["## " + p.rstrip("\n") for p in parts[1:] if ("## " + p).splitlines()[0] != title]
    path.write_text("\n\n".join(kept + [section.rstrip("\n")]) + "\n")


def publish(module: str, rows: list[dict], render_fn, args, argv, header: str = HEADER) -> None:
    """Print this card's section (`render_fn(rows, environment, command)`), write it into `args.out` (a new file
    starts with `header`) and the rows to `args.json` when given."""
    command = f"python -m tools.bench.{module} " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render_fn(rows, environment("cuda"), command.strip())
    print(section)
    if args.out:
        write_section(args.out, section, header)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="three shapes")
    fla = ap.add_mutually_exclusive_group()
    fla.add_argument("--no-fla", action="store_true", help="cula and FlashKDA only")
    fla.add_argument("--fla-subset", action="store_true", help="FLA timed on FLA_SUBSET's six shapes only")
    ap.add_argument("--out", type=Path, help="markdown file whose section for this card is rewritten")
    grid.add_arguments(ap)
    add_do_bench_args(ap)
    ap.add_argument("--profile", metavar="SHAPE", type=profile_shape,
                    help="per-kernel CUDA times of cula and FlashKDA at one shape (B,T,H or N,T,H,LENS for varlen: "
                         "LENS uniform, random or skewed), then exit")
    ap.add_argument("--packing", action="store_true",
                    help="stage 1 packed vs unpacked on the varlen 64-sequence shapes, then exit")
    args = ap.parse_args(argv)
    grid.check_arguments(ap, args)
    if not torch.cuda.is_available():
        print("prefill: needs a CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm90"  # fail loudly rather than time the reference
    if args.profile:
        profile_kernels(args.profile)
        return 0
    if args.packing:
        packing_ab(Timing(warmup=args.warmup, repeats=args.rep, method="do_bench"))
        return 0
    fla_shapes = [] if args.no_fla else FLA_SUBSET if args.fla_subset else None
    if fla_shapes != []:
        fla_tuning.prepare()
    shapes, done, todo = grid.select(ap, args, SMOKE if args.smoke else GRID,
                                     lambda s: row_cost(s, timed_by_fla(s, fla_shapes)), label,
                                     torch.cuda.get_device_name())
    to_warm = [s for s in todo if timed_by_fla(s, fla_shapes)]
    if to_warm and not args.no_warm:
        print(fla_tuning.warm("tools.bench.prefill", "warm_one", to_warm, compile_class, args.warm_jobs), flush=True)
    if args.warm_only:
        return 0
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="do_bench")
    rows = grid.timed_rows(shapes, done, lambda s: run_shape(s, timing, timed_by_fla(s, fla_shapes)),
                           grid.saver(args.json), label)
    publish("prefill", rows, render, args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
