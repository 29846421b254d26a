"""Context parallel across GPUs: `cula_core.context_parallel.chunk_kda_cp` against the single-GPU call and against
FLA 0.6.0's CP (`fla.ops.kda.chunk_kda(..., cp_context=fla.ops.cp.build_cp_context(...))`), on one host.

    python tools/bench/multi_gpu_cp.py [--quick] [--gpus N] [--no-fla] [--no-warm] [--warm-jobs J]
                                       [--out docs/benchmarks/multi_gpu_cp.md] [--profile]
                                       [--parts correctness,timing,scaling] [--t-rank T ...] [--heads H ...]
                                       [--merge RESULT.json ...]

One process per GPU (torch.multiprocessing spawn, NCCL, ``NCCL_NVLS_ENABLE=0``; ``CULA_STRICT=1`` so a call that
would fall back to the reference fails instead of timing it). FLA runs its own kernels (``FLA_FLASH_KDA=0``), with
no autotune results read from disk, tuned again in each rank on each timed shape (tools/bench/fla_tuning.py). Before
the ranks start, FLA's chunk kernels are compiled for the timed shapes in parallel processes (`warm_one`, one per
head count and configuration part, at most `--warm-jobs` at once, spread over the GPUs; `--no-warm` skips it), so
that the ranks mostly tune. Inputs: bf16 q/k/v, raw gate with the safe gate in kernel (A_log, dt_bias, lower_bound =
-5), q/k L2 norm in kernel, K = V = 128, HQK = HV = H.

1. correctness: a global varlen batch (a long sequence through every rank and short ones) split over the ranks,
   compared on every rank with the single-GPU `cula_core.chunk_kda` of the whole batch: outputs and the gradients
   of q, k, v, g, beta, A_log, dt_bias (max |cp - single| / max |single| per tensor; A_log / dt_bias summed over
   ranks), with cula's own context and with FLA's ``FLACPContext`` passed to cula (duck typing);
2. training step (forward + backward) per shape, one sequence of ``W * T_rank`` tokens: cula CP, FLA CP, and
   cula's single-GPU call on ``T_rank`` tokens alone (what CP adds). The time is each rank's median over the
   repeats (CUDA events), the maximum over ranks;
3. scaling at ``T = 512K`` (``--quick``: 128K) tokens, one sequence: 1 GPU (plain call) and CP over 2, 4, ... GPUs;
   efficiency = t_1 / (n * t_n).

Prints this machine's section (``## W x <card>``) at the end; it replaces that machine's section of ``--out``
(default docs/benchmarks/multi_gpu_cp.md; ``-`` for none), keeping the other machines' sections, and, when ``$OUT``
is set, the section and the JSON go there too. ``--quick`` is sized to run in under 4 minutes on 2 or 4 GPUs.

A grid too long for one call runs in pieces: ``--parts`` picks the parts to run, ``--t-rank`` / ``--heads`` narrow
the timing grid, and ``--merge`` takes the result JSON of earlier runs on the same kind of machine (each run writes
``multi_gpu_cp_<pid>.json`` to ``$OUT``, or /tmp), whose rows the section shows with this run's (a row timed again
replaces the earlier one; every run's command is listed).

``--profile`` replaces the three parts: on the first timed shape, every rank profiles three training steps of cula's
CP call and three of its single-GPU call on the rank's tokens alone (torch.profiler, CPU and CUDA, after warm-up)
and writes the kernel tables, sorted by CUDA time, to ``cp_profile_{cp,local}_rank{R}.txt`` in ``$OUT`` (or /tmp):
where a CP step's time goes beyond the local call's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

QUICK = dict(t_rank=[32768], heads=[16], scale_T=131072, scale_H=16, reps=5, warmup=2)
FULL = dict(t_rank=[32768, 65536, 131072], heads=[16, 32], scale_T=524288, scale_H=16, reps=10, warmup=3)
K = V = 128
LOWER_BOUND = -5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(T, H, device, seed, requires_grad=True):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, dtype=torch.bfloat16, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device=device, dtype=dtype)

    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H).sigmoid(),
             A_log=r(H, dtype=torch.float32, s=0.5), dt_bias=r(H * K, dtype=torch.float32, s=0.5))
    if requires_grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


OPTS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND)
TENSORS = ("q", "k", "v", "g", "beta")


def _cula_call(x, cu=None, cu_cpu=None, cp_context=None):
    import cula_core
    from cula_core.context_parallel import chunk_kda_cp

    args = [x[n] for n in TENSORS]
    if cp_context is not None:
        return chunk_kda_cp(*args, cp_context=cp_context, A_log=x["A_log"], dt_bias=x["dt_bias"], **OPTS)[0]
    return cula_core.chunk_kda(*args, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                               **OPTS)[0]


def _fla_call(x, cp_context):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(*(x[n] for n in TENSORS), A_log=x["A_log"], dt_bias=x["dt_bias"], cp_context=cp_context,
                         **OPTS)[0]


def timed_shapes(cfg: dict) -> list[dict]:
    """The (H, T per rank) shapes of the timing table for a grid (QUICK or FULL), in the order they are timed."""
    return [dict(H=H, T=t) for H in cfg["heads"] for t in cfg["t_rank"]]


def compile_class(shape: dict) -> tuple:
    """What FLA's compiled chunk kernels of a timed shape depend on, as far as warm_one's inputs go: the heads (every
    timed T is a multiple of 16; a rank's tokens are one varlen sequence whatever T)."""
    return (shape["H"],)


def warm_one(shape: dict, part: int = 0, parts: int = 1) -> None:
    """One FLA forward + backward, without CP, on one sequence of `shape["H"]` heads and 1024 tokens passed as varlen
    (FLA's CP hands each rank's tokens to its chunk kernels as a varlen batch), each FLA autotuner restricted to part
    `part` of `parts` of its configurations (fla_tuning.prepare_compile_part): compiles those configurations of the
    chunk kernels FLA's CP runs; its CP-only kernels still compile in the ranks. Run by fla_tuning.warm."""
    import torch

    from tools.bench import fla_tuning

    fla_tuning.prepare_compile_part(part, parts)
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    T = 1024
    x = _inputs(T, shape["H"], "cuda", seed=0)
    cu = torch.tensor([0, T], dtype=torch.long)
    o = fla_chunk_kda(*(x[n] for n in TENSORS), A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu.cuda(),
                      cu_seqlens_cpu=cu, **OPTS)[0]
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _correctness(rank, world, group, device, have_fla, log):
    """Max relative errors of CP against the single-GPU call, worst over ranks, per tensor and context kind."""
    import torch
    import torch.distributed as dist

    from cula_core.context_parallel import build_cp_context

    part = 8192
    total = world * part
    lens = [1000, total - 1000 - 3 * 700 - 1100, 700, 700, 700, 1100]   # sequence 1 runs through every rank
    bounds = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = _inputs(total, 16, device, seed=11)
    do = torch.randn(1, total, 16, V, generator=torch.Generator().manual_seed(12)).to(device, torch.bfloat16)
    o_ref = _cula_call(x, bounds.to(device), bounds)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    ref = dict(zip(names, torch.autograd.grad(o_ref, [x[n] for n in names], do), strict=True))
    a, b = rank * part, (rank + 1) * part
    contexts = {"cula": build_cp_context(bounds.to(device), group, cu_seqlens_cpu=bounds)}
    if have_fla:
        from fla.ops.cp import build_cp_context as fla_build

        contexts["FLA FLACPContext"] = fla_build(bounds.to(device), group, cu_seqlens_cpu=bounds)
    rows = []
    for kind, ctx in contexts.items():
        loc = {n: (x[n][:, a:b] if n in TENSORS else x[n]).detach().clone().requires_grad_(True) for n in names}
        o = _cula_call(loc, cp_context=ctx)
        grads = dict(zip(names, torch.autograd.grad(o, [loc[n] for n in names], do[:, a:b]), strict=True))
        errs = {"o": _rel(o, o_ref[:, a:b])}
        for n in TENSORS:
            errs["d" + n] = _rel(grads[n], ref[n][:, a:b])
        for n in ("A_log", "dt_bias"):
            summed = grads[n].clone()
            dist.all_reduce(summed, group=group)
            errs["d" + n] = _rel(summed, ref[n])
        worst = torch.tensor(list(errs.values()), device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        rows.append(dict(context=kind, **dict(zip(errs, worst.tolist(), strict=True))))
        log(f"correctness [{kind}]: " + ", ".join(f"{k} {v:.2e}" for k, v in rows[-1].items() if k != "context"))
    return rows


def _time(fn, reps, warmup, group, device):
    """Median ms per call on this rank, maximum over the group's ranks."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _train_step(call, x, do):
    def step():
        for t in x.values():
            t.grad = None
        call(x).backward(do)
    return step


def _shape_steps(shape, rank, world, group, device):
    """One timed shape on this rank: (the global offsets on the host, the rank's inputs x and output gradient do,
    and cula's training steps on them: "cp" through its CP context over the group, "local" the single-GPU call on
    the rank's tokens alone). Offsets go to the device here, once, not inside a step."""
    import torch

    from cula_core.context_parallel import build_cp_context

    H, t_rank = shape["H"], shape["T"]
    bounds = torch.tensor([0, world * t_rank], dtype=torch.int32)
    local = torch.tensor([0, t_rank], dtype=torch.int32)
    x = _inputs(t_rank, H, device, seed=rank)
    do = torch.randn(1, t_rank, H, V, device=device, dtype=torch.bfloat16)
    ctx = build_cp_context(bounds.to(device), group, cu_seqlens_cpu=bounds)
    local_dev = local.to(device)
    steps = {"cp": _train_step(lambda z: _cula_call(z, cp_context=ctx), x, do),
             "local": _train_step(lambda z: _cula_call(z, local_dev, local), x, do)}
    return bounds, x, do, steps


def _timing(rank, world, group, device, cfg, have_fla, log):
    import torch

    rows = []
    for shape in timed_shapes(cfg):
        H, t_rank = shape["H"], shape["T"]
        bounds, x, do, steps = _shape_steps(shape, rank, world, group, device)
        row = dict(H=H, T_rank=t_rank, T_total=world * t_rank)
        row["cula_cp_ms"] = _time(steps["cp"], cfg["reps"], cfg["warmup"], group, device)
        row["cula_local_ms"] = _time(steps["local"], cfg["reps"], cfg["warmup"], group, device)
        if have_fla:
            from fla.ops.cp import build_cp_context as fla_build

            from tools.bench import fla_tuning

            fla_tuning.retune()  # FLA tunes its kernels again, in this process, on this shape
            fctx = fla_build(bounds.to(device), group, cu_seqlens_cpu=bounds)
            row["fla_cp_ms"] = _time(_train_step(lambda z: _fla_call(z, fctx), x, do), cfg["reps"],
                                     cfg["warmup"], group, device)
            row["speedup"] = row["fla_cp_ms"] / row["cula_cp_ms"]
        rows.append(row)
        log("timing: " + json.dumps(row))
        del x, do, steps
        torch.cuda.empty_cache()
    return rows


def _scaling(rank, world, device, cfg, log):
    import torch
    import torch.distributed as dist

    from cula_core.context_parallel import build_cp_context

    T, H = cfg["scale_T"], cfg["scale_H"]
    rows = []
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= world]
    for n in sizes:
        group = dist.new_group(list(range(n)))   # every rank takes part in creating every group
        if rank < n:
            x = _inputs(T // n, H, device, seed=rank)
            do = torch.randn(1, T // n, H, V, device=device, dtype=torch.bfloat16)
            bounds = torch.tensor([0, T], dtype=torch.int32)
            if n == 1:
                local = bounds.to(device)
                call = lambda z: _cula_call(z, local, bounds)  # noqa: E731
            else:
                ctx = build_cp_context(bounds.to(device), group, cu_seqlens_cpu=bounds)
                call = lambda z, ctx=ctx: _cula_call(z, cp_context=ctx)  # noqa: E731
            ms = _time(_train_step(call, x, do), cfg["reps"], cfg["warmup"], group, device)
            rows.append(dict(gpus=n, T=T, H=H, ms=ms))
            del x, do
            torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        for row in rows:
            row["efficiency"] = rows[0]["ms"] / (row["gpus"] * row["ms"])
            log("scaling: " + json.dumps(row))
    return rows


def _profile(rank, world, group, device, cfg, out_dir, log):
    """--profile: the kernel tables of three cula CP steps and three single-GPU steps on this rank's tokens."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    shape = timed_shapes(cfg)[0]
    H, t_rank = shape["H"], shape["T"]
    _, _, _, steps = _shape_steps(shape, rank, world, group, device)
    for name, step in steps.items():
        for _ in range(cfg["warmup"] + 1):
            step()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        path = Path(out_dir) / f"cp_profile_{name}_rank{rank}.txt"
        path.write_text(f"{name}, rank {rank} of {world}, H={H}, T per rank={t_rank}, 3 training steps\n{table}\n")
        log(f"profile [{name}]: {path}")


def _worker(rank, world, port, cfg, have_fla, result_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    result = {}
    if cfg.get("profile"):
        try:
            _profile(rank, world, group, device, cfg, Path(result_path).parent, log)
        finally:
            dist.destroy_process_group()
        return
    try:
        if "correctness" in cfg["parts"]:
            result["correctness"] = _correctness(rank, world, group, device, have_fla, log)
        if "timing" in cfg["parts"]:
            result["timing"] = _timing(rank, world, group, device, cfg, have_fla, log)
        if "scaling" in cfg["parts"]:
            result["scaling"] = _scaling(rank, world, device, cfg, log)
    finally:
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
        dist.destroy_process_group()


HEADER = ("# Context parallel across GPUs: cula vs FLA 0.6.0 CP\n\n"
          "One section per machine; the script, inputs and columns: `tools/bench/multi_gpu_cp.py`'s docstring.\n")


PARTS = ("correctness", "timing", "scaling")


def merge_results(results: list[dict]) -> dict:
    """One result from several runs' results, in run order: rows keyed by their context (correctness), (H, T per
    rank) (timing) or (GPUs, T, H) (scaling), a later run's row replacing an earlier one; the runs' commands."""
    keys = {"correctness": lambda r: r["context"], "timing": lambda r: (r["H"], r["T_rank"]),
            "scaling": lambda r: (r["gpus"], r["T"], r["H"])}
    merged = {part: {} for part in PARTS}
    commands = []
    for result in results:
        for part in PARTS:
            for row in result.get(part, []):
                merged[part][keys[part](row)] = row
        if result.get("command") and result["command"] not in commands:
            commands.append(result["command"])
    out = {part: list(rows.values()) for part, rows in merged.items() if rows}
    out["commands"] = commands
    return out


def render_tables(result, world, card, command) -> str:
    """This machine's section of docs/benchmarks/multi_gpu_cp.md (`## <world> x <card>`) from a run's result (or
    merge_results' of several, whose commands are listed before `command`)."""
    commands = [c for c in result.get("commands", []) if c != command] + [command]
    shown = "; ".join(f"`{c}`" for c in commands)
    lines = [f"## {world} x {card}", "",
             f"Command{'s' if len(commands) > 1 else ''}: {shown} (NCCL_NVLS_ENABLE=0). bf16, K = V = 128, safe "
             "gate (lower_bound = -5) and q/k L2 norm in kernel. Training step = forward + backward; time = median "
             "of a rank's repeats, maximum over ranks.", "",
             "### Correctness (max |CP - single GPU| / max |single GPU|, worst rank)", ""]
    corr = result.get("correctness", [])
    if corr:
        keys = [k for k in corr[0] if k != "context"]
        lines += ["| context | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 1)]
        lines += ["| " + r["context"] + " | " + " | ".join(f"{r[k]:.2e}" for k in keys) + " |" for r in corr]
    lines += ["", "### Training step, one sequence of W * T_rank tokens", "",
              "| H | T per rank | T total | cula CP ms | FLA CP ms | speed-up (FLA / cula) "
              "| cula 1 GPU, T per rank ms | CP overhead |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result.get("timing", []):
        fla = f"{r['fla_cp_ms']:.2f}" if "fla_cp_ms" in r else "n/a"
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "n/a"
        lines.append(f"| {r['H']} | {r['T_rank']} | {r['T_total']} | {r['cula_cp_ms']:.2f} | {fla} | {sp} | "
                     f"{r['cula_local_ms']:.2f} | {r['cula_cp_ms'] / r['cula_local_ms']:.2f}x |")
    lines += ["", "### Scaling (cula), one sequence", "", "| GPUs | T | H | ms | efficiency t1 / (n tn) |",
              "| --- | --- | --- | --- | --- |"]
    for r in result.get("scaling", []):
        lines.append(f"| {r['gpus']} | {r['T']} | {r['H']} | {r['ms']:.2f} | {r['efficiency'] * 100:.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small grid: under 4 minutes on 2 or 4 GPUs")
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--no-fla", action="store_true", help="skip FLA's CP (also skipped when FLA is absent)")
    parser.add_argument("--no-warm", action="store_true", help="no parallel compile of FLA's kernels before the ranks")
    parser.add_argument("--warm-jobs", type=int, default=os.cpu_count() or 1,
                        help="processes compiling FLA's kernels at once (default: the CPU count)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "multi_gpu_cp.md"),
                        help="markdown file whose section for this machine the run replaces; '-' for none")
    parser.add_argument("--profile", action="store_true",
                        help="only profile cula's CP and single-GPU training steps per rank (kernel tables to $OUT)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--t-rank", type=int, nargs="+",
                        help="tokens per rank of the timing grid (default: the grid's)")
    parser.add_argument("--heads", type=int, nargs="+", help="head counts of the timing grid (default: the grid's)")
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="result JSON of earlier runs on this machine, shown with this run's rows")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}")
    if any(t <= 0 or t % 16 for t in args.t_rank or ()):
        parser.error(f"--t-rank: positive multiples of 16, got {args.t_rank}")
    if any(h <= 0 for h in args.heads or ()):
        parser.error(f"--heads: positive counts, got {args.heads}")
    earlier = [json.loads(f.read_text()) for f in args.merge]
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("CULA_STRICT", "1")
    sys.path.insert(0, str(ROOT))
    from tools.bench import fla_tuning

    fla_tuning.prepare()  # before FLA is imported, here and in the spawned ranks (they inherit the environment)
    import torch
    import torch.multiprocessing as mp

    world = args.gpus or torch.cuda.device_count()
    if world < 1:
        print("multi_gpu_cp: no CUDA device", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name(0)
    for f, r in zip(args.merge, earlier, strict=True):
        if (r.get("world"), r.get("card")) != (world, card):
            parser.error(f"--merge {f}: a run on {r.get('world')} x {r.get('card')}, this one is {world} x {card}")
    have_fla = False
    if not args.no_fla:
        try:
            import fla.ops.cp  # noqa: F401
            import fla.ops.kda  # noqa: F401
            have_fla = True
        except ImportError as exc:
            print(f"multi_gpu_cp: FLA's CP not importable ({exc}); timing cula only")
    cfg = dict(QUICK if args.quick else FULL, profile=args.profile, parts=parts)
    if args.t_rank:
        cfg["t_rank"] = args.t_rank
    if args.heads:
        cfg["heads"] = args.heads
    if args.profile:
        have_fla = False
    if have_fla and not args.no_warm and "timing" in parts:
        print(fla_tuning.warm("tools.bench.multi_gpu_cp", "warm_one", timed_shapes(cfg), compile_class,
                              args.warm_jobs), flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    result_path = (out_dir or Path("/tmp")) / f"multi_gpu_cp_{os.getpid()}.json"
    flags = [f for f, on in (("--quick", args.quick), (f"--gpus {args.gpus}", args.gpus), ("--no-fla", args.no_fla),
                             ("--no-warm", args.no_warm), (f"--parts {args.parts}", parts != list(PARTS)),
                             (f"--t-rank {' '.join(map(str, args.t_rank or ()))}", args.t_rank),
                             (f"--heads {' '.join(map(str, args.heads or ()))}", args.heads)) if on]
    command = " ".join(["python tools/bench/multi_gpu_cp.py", *flags])
    start = time.time()
    status = 0
    try:
        mp.spawn(_worker, args=(world, _free_port(), cfg, have_fla, str(result_path)), nprocs=world, join=True)
    except Exception:  # a rank failed: still print what was measured
        traceback.print_exc()
        status = 1
    if args.profile:
        print(f"({time.time() - start:.0f} s)")
        return status
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    result.update(command=command, world=world, card=card)
    result_path.write_text(json.dumps(result))  # for a later run's --merge
    table = render_tables(merge_results([*earlier, result]), world, card, command)
    print(f"\n{table}\n({time.time() - start:.0f} s)")
    from tools.bench.prefill import write_section

    if args.out != "-" and status == 0:
        write_section(Path(args.out), table, HEADER)
    if out_dir is not None:
        (out_dir / "multi_gpu_cp.md").write_text(HEADER + "\n" + table)
    return status


if __name__ == "__main__":
    sys.exit(main())
