"""Benchmark of cula-sm100's chunk_kda backward against FLA 0.6.0: the fused chunk_wy_dqkg kernel against FLA's
`chunk_kda_bwd_wy_dqkg_fused`, the whole forward + backward of `chunk_kda`, and where cula's backward spends its time.

    python -m tools.bench.train_bwd [--smoke | --quick] [--no-e2e | --no-kernels] [--varlen-only]
                                    [--out docs/benchmarks/train_bwd.md] [--json FILE]
                                    [--deadline-s 400]
    python -m tools.bench.train_bwd --cula-only     # cula against itself, no FLA: JSON lines on stdout

`--cula-only`: for each CULA_ONLY_E2E shape, cula's backward stage times (`stage_times`) and its whole forward +
backward (`e2e_fn`, CUDA events, median of 7 calls after 3); then chunk_bwd_dhu alone (do_bench) at both V slice
widths and pipeline depths on DHU_SHAPES (random inputs, no states). For comparing two trees of cula's kernels on
one machine.

The issue's grid. Kernel rows: H = 32 q/k heads, HV in (32, 64), B in (1, 2), T in (256 ... 8192), plus varlen
(B = 1, 8192 tokens) with 10 and 20 sequences of uniform, random and skewed lengths. Whole forward + backward rows
(`cula_core.chunk_kda` with CULA_BACKEND=sm100 and `fla.ops.kda.chunk_kda`, use_gate_in_kernel and
use_qk_l2norm_in_kernel, then `.backward(do)`), each with cula's per-stage backward times.
Both kernels get the same inputs in their own conventions (ours: G in natural log, dq/dk summed per q/k head inside
the kernel; FLA: g in log2 units and dq/dk per value head; the FLA row includes the GVA sum FLA's caller does, a
`.view(...).sum()`).
FLA at its best (tools/bench/fla_tuning.py): no autotune choice read from disk (`fla_tuning.prepare`), its Triton
kernels compiled in parallel processes first (one per autotuning key: HV, kernel or whole op; their choices, made
with the GPU shared, dropped), then on every row this process forgets every choice (`fla_tuning.retune`: FLA's keys
leave out B and T) and makes one untimed call that tunes on the row's shape before FLA is timed.
One device slot: the rows are written (markdown and JSON) as they finish; past `--deadline-s` the remaining rows
are skipped and listed as not run.
Timing: median of `triton.testing.do_bench` (kernel rows) or of CUDA events over 5 calls after 2 (whole op),
through tools/bench/harness.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import fla_tuning  # noqa: E402
from tools.bench.harness import Timing, add_do_bench_args, environment, measure, peak_hbm_gbs  # noqa: E402

H = 32
K = V = 128
TOKENS = 8192
T_GRID = (256, 512, 1024, 2048, 4096, 8192)
VARLEN = [("uniform", n) for n in (10, 20)] + [("random", n) for n in (10, 20)] + [("skewed", n) for n in (10, 20)]
KERNEL_SHAPES = [dict(B=b, T=t, HV=hv) for hv in (32, 64) for b in (1, 2) for t in T_GRID]
KERNEL_SHAPES += [dict(B=1, T=TOKENS, HV=hv, varlen=vl) for hv in (32, 64) for vl in VARLEN]
E2E_SHAPES = [dict(B=b, T=t, HV=hv) for hv in (32, 64) for b, t in ((1, 1024), (2, 1024), (2, 4096), (1, 8192),
                                                                     (2, 8192))]
E2E_SHAPES += [dict(B=1, T=TOKENS, HV=32, varlen=vl) for vl in (("random", 10), ("skewed", 20))]
# --quick: the rows a short device slot affords (the most telling of each kind)
QUICK_KERNELS = [dict(B=2, T=8192, HV=32), dict(B=2, T=8192, HV=64), dict(B=1, T=TOKENS, HV=32, varlen=("random", 20)),
                 dict(B=1, T=256, HV=32)]
QUICK_E2E = [dict(B=2, T=4096, HV=32)]
SMOKE_KERNELS = [dict(B=2, T=1024, HV=32)]
SMOKE_E2E = [dict(B=1, T=1024, HV=32)]


def lengths_of(kind: str, n: int, total: int = TOKENS) -> list[int]:
    if kind == "uniform":
        base = [total // n] * n
    elif kind == "random":
        gen = torch.Generator().manual_seed(n)
        w = torch.rand(n, generator=gen) + 0.1
        base = [max(1, int(x)) for x in (w / w.sum() * total).tolist()]
    elif kind == "skewed":  # one long sequence and n - 1 short ones
        short = max(1, total // (8 * n))
        base = [short] * (n - 1) + [total - short * (n - 1)]
    else:
        raise ValueError(kind)
    base[-1] += total - sum(base)
    return base


def cu_of(shape):
    if "varlen" not in shape:
        return None, None
    lengths = lengths_of(*shape["varlen"])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu.cuda(), cu


def kernel_inputs(shape, seed=0):
    """Random tensors of the kernel's shapes and typical magnitudes (timing does not depend on the values)."""
    from cula_sm100.forward import launch as fwd

    B, T, HV = shape["B"], shape["T"], shape["HV"]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, scale=1.0):
        return scale * torch.randn(*s, generator=gen, device="cuda")

    cu, cu_cpu = cu_of(shape)
    ctab, _ = fwd.tables(B, T, cu, cu_cpu, "cuda")
    NC, TT, bf = ctab.shape[0], B * T, torch.bfloat16
    G = -torch.rand(TT, HV, K, generator=gen, device="cuda").cumsum(0).remainder(4.0)
    A = torch.tril(r(TT, HV, 64, scale=0.1)).to(bf)
    x = dict(q=r(TT, H, K, scale=0.1).to(bf), k=r(TT, H, K, scale=0.1).to(bf), v=r(TT, HV, V).to(bf),
             v_new=r(TT, HV, V).to(bf), G=G, beta=torch.rand(TT, HV, generator=gen, device="cuda"), A=A,
             h=r(NC, HV, K, V, scale=0.1).to(bf), do=r(TT, HV, V).to(bf), dh=r(NC, HV, K, V, scale=0.1).to(bf),
             dv=r(TT, HV, V).to(bf))
    return x, ctab, cu


def wy_bytes(shape) -> int:
    """Lower bound of the HBM bytes chunk_wy_dqkg (either implementation) reads and writes: every input once
    (q, k, v, v_new, do, dv, G, A, beta, h, dh) and every output once (dq, dk fp32 per q/k head, dv, dG, dA,
    dbeta)."""
    from cula_sm100.forward import launch as fwd

    B, T, HV = shape["B"], shape["T"], shape["HV"]
    TT = B * T
    cu, cu_cpu = cu_of(shape)
    NC = fwd.tables(B, T, cu, cu_cpu, "cuda")[0].shape[0]
    reads = TT * H * K * 2 * 2 + TT * HV * V * 2 * 4 + TT * HV * K * 4 + TT * HV * 64 * 2 + TT * HV * 4 \
        + NC * HV * K * V * 2 * 2
    writes = TT * H * K * 4 * 2 + TT * HV * V * 2 + TT * HV * K * 4 + TT * HV * 64 * 4 + TT * HV * 4
    return reads + writes


def harness_sanity(timing) -> float:
    """GB/s of a 1 GiB memset through the same harness: near the card's HBM peak or below it if the timer is sound."""
    buf = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    ms = measure(buf.zero_, [()], timing).median_ms
    return (1 << 30) / (ms * 1e-3) / 1e9


def ours_kernel(x, ctab):
    from cula_sm100.backward import launch

    return launch.chunk_wy_dqkg(x["q"], x["k"], x["v"], x["v_new"], x["G"], x["beta"], x["A"], x["h"], x["do"],
                                x["dh"], x["dv"], ctab, scale=K ** -0.5)


def fla_kernel_fn(x, shape, cu):
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    B, _T, HV = shape["B"], shape["T"], shape["HV"]
    b = {n: t.reshape(B, -1, *t.shape[1:]) for n, t in x.items() if n != "h" and n != "dh"}
    g2 = b["G"] / math.log(2)
    cul = cu.long() if cu is not None else None

    def run():
        dq, dk, *rest = chunk_kda_bwd_wy_dqkg_fused(
            q=b["q"], k=b["k"], v=b["v"], v_new=b["v_new"], g=g2, beta=b["beta"], A=b["A"], h=x["h"], do=b["do"],
            dh=x["dh"], dv=b["dv"], scale=K ** -0.5, cu_seqlens=cul, chunk_size=64)
        grp = HV // H
        return (dq.view(*dq.shape[:2], H, grp, K).sum(3), dk.view(*dk.shape[:2], H, grp, K).sum(3), *rest)

    return run


def warm_one(kind: str, hv: int, varlen: bool = False):
    """Compile FLA's kernels of one autotuning key: `kind` "wy" (the fused kernel) or "e2e" (the whole op's forward
    and backward kernels), at HV = hv, fixed length or varlen (a varlen call is another key: Triton's autotuner
    keys on the argument types too, and cu_seqlens is a tensor there). Run in parallel processes by `warm_fla`."""
    shape = dict(B=1, T=TOKENS, HV=hv, varlen=("uniform", 4)) if varlen else dict(B=1, T=1024, HV=hv)
    if kind == "wy":
        x, _, cu = kernel_inputs(shape)
        fla_kernel_fn(x, shape, cu)()
    else:
        e2e_fn("fla", e2e_inputs(shape))()
    torch.cuda.synchronize()


def warm_fla(keys) -> None:
    """FLA's kernels of every autotuning key in `keys` ((kind, HV, varlen): `warm_one`'s arguments) compiled in
    parallel processes (fla_tuning.compile_in_parallel); the choices they made (with the GPU shared) are dropped."""
    seconds, failed = fla_tuning.compile_in_parallel("tools.bench.train_bwd", "warm_one", list(keys))
    print(f"FLA warm-up: {len(keys)} processes in {seconds:.0f} s (failures: {failed})", flush=True)


def e2e_inputs(shape, seed=0):
    B, T, HV = shape["B"], shape["T"], shape["HV"]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    cu, cu_cpu = cu_of(shape)
    return dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, HV, V).bfloat16(),
                g=r(B, T, HV, K), beta=torch.sigmoid(r(B, T, HV)).bfloat16(),
                A_log=torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1), dt_bias=0.1 * r(HV * K),
                do=r(B, T, HV, V).bfloat16(), cu=cu, cu_cpu=cu_cpu)


def e2e_fn(impl, x):
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    kw = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], use_gate_in_kernel=True,
              use_qk_l2norm_in_kernel=True)
    if impl == "cula":
        import cula_core as mod

        if x["cu"] is not None:
            kw.update(cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])
    else:
        from fla.ops import kda as mod

        if x["cu"] is not None:
            kw.update(cu_seqlens=x["cu"].long())
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]

    def run():
        for t in leaves.values():
            t.grad = None
        o = mod.chunk_kda(*args, **kw)[0]
        o.backward(x["do"])
        return [t.grad for t in leaves.values()]

    return run


STAGES = ("recompute", "dav", "dhu", "chunk_wy_dqkg", "intra", "finish")
# --cula-only: whole-op shapes (stage times and cula's forward + backward) and chunk_bwd_dhu kernel shapes (B, T, HV)
CULA_ONLY_E2E = [dict(B=2, T=8192, HV=32), dict(B=2, T=8192, HV=64), dict(B=1, T=8192, HV=32),
                 dict(B=2, T=4096, HV=32), dict(B=1, T=TOKENS, HV=32, varlen=("skewed", 20)),
                 dict(B=1, T=TOKENS, HV=32, varlen=("random", 10))]
DHU_SHAPES = [(2, 8192, 32), (2, 8192, 64), (1, 8192, 32), (1, 16384, 32), (1, 16384, 16)]


def stage_times(shape, reps=3):
    """Median ms of each stage of cula's backward (launch.chunk_kda_backward with CUDA events between stages):
    where the backward's time goes, to order the remaining work. The backward gets the forward's residuals
    (Aqk, Akk) as the public op hands them over, so recompute is the live path's (no chunk_intra)."""
    from cula_sm100.backward import launch
    from cula_sm100.forward import launch as fwd

    x = e2e_inputs(shape)
    inputs = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None, x["cu"], x["cu_cpu"])
    args = (x["do"], None, *inputs)
    kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, gate="softplus", lower_bound=None,
              beta_activation="none")
    with torch.no_grad():
        _o, _ht, residuals = fwd.chunk_kda(*(t.detach() if t is not None else None for t in inputs),
                                           output_final_state=False, save_residuals=True, **kw)
    kw["residuals"] = residuals
    per = {n: [] for n in STAGES}
    for i in range(reps + 2):
        ev = []

        def mark(name, ev=ev):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            ev.append(e)

        launch.chunk_kda_backward(*args, marks=mark, **kw)
        torch.cuda.synchronize()
        if i >= 2:
            for n, a, b in zip(STAGES, ev, ev[1:], strict=False):
                per[n].append(a.elapsed_time(b))
    return {n: sorted(v)[len(v) // 2] for n, v in per.items()}


def cula_only(timing) -> None:
    """--cula-only (see the module docstring): one JSON line per row on stdout."""
    from cula_sm100.backward import launch
    from cula_sm100.forward import launch as fwd

    for shape in CULA_ONLY_E2E:
        stages = stage_times(shape, reps=7)
        step = measure(e2e_fn("cula", e2e_inputs(shape)), [()], Timing(warmup=3, repeats=7, method="events"))
        print(json.dumps(dict(shape=shape_label(shape), HV=shape["HV"],
                              stages_ms={n: round(v, 3) for n, v in stages.items()},
                              cula_fwd_bwd_ms=round(step.median_ms, 3))), flush=True)
    for B, T, HV in DHU_SHAPES:
        TT = B * T
        qg, kg, w, do, dv = (torch.randn(TT, HV, K, device="cuda").bfloat16() for _ in range(5))
        G = -0.1 * torch.rand(TT, HV, K, device="cuda")
        ctab, stab = fwd.tables(B, T, None, None, "cuda")
        ms = {}
        for bv, stages in itertools.product((32, 64), (1, 2)):
            ms[f"BV={bv} stages={stages}"] = round(measure(
                lambda bv=bv, stages=stages: launch.chunk_bwd_dhu(qg, kg, w, G, do, dv, None, ctab, stab,
                                                                  want_dh0=False, bv=bv, stages=stages),
                [()], timing).median_ms, 4)
        print(json.dumps(dict(dhu=f"B={B} T={T} HV={HV}", ms=ms)), flush=True)


def shape_label(s):
    if "varlen" in s:
        kind, n = s["varlen"]
        return f"varlen {kind} {n} seqs, {s['T']} tokens"
    return f"B={s['B']} T={s['T']}"


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one shape of each table (CI)")
    ap.add_argument("--quick", action="store_true", help="a few rows of each table")
    ap.add_argument("--out", type=Path, help="write the markdown report here (rewritten after every row)")
    ap.add_argument("--json", type=Path, help="write the raw numbers here (rewritten after every row)")
    add_do_bench_args(ap, warmup=10, rep=40)
    ap.add_argument("--no-e2e", action="store_true", help="kernel rows only")
    ap.add_argument("--no-kernels", action="store_true", help="whole-op rows only")
    ap.add_argument("--varlen-only", action="store_true", help="only the varlen rows (of the tables selected)")
    ap.add_argument("--no-warm", action="store_true", help="no parallel FLA compile processes")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the rows left after this many seconds")
    ap.add_argument("--cula-only", action="store_true",
                    help="cula against itself, no FLA: stage times, whole forward + backward and chunk_bwd_dhu at "
                         "both slice widths, as JSON lines (see the module docstring)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if not torch.cuda.is_available():
        print("train_bwd: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm100"
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    if args.cula_only:
        cula_only(timing)
        return 0
    kshapes = [] if args.no_kernels else (SMOKE_KERNELS if args.smoke else QUICK_KERNELS if args.quick
                                           else KERNEL_SHAPES)
    eshapes = [] if args.no_e2e else (SMOKE_E2E if args.smoke else QUICK_E2E if args.quick else E2E_SHAPES)
    if args.varlen_only:
        kshapes, eshapes = ([x for x in shapes if "varlen" in x] for shapes in (kshapes, eshapes))
    fla_tuning.prepare()  # before FLA is imported: no autotune choice from disk, FLA's own kernels
    try:
        import fla  # noqa: F401
        have_fla = True
    except ImportError:
        have_fla = False
    if have_fla and not args.no_warm:
        warm_fla(sorted({("wy", s["HV"], "varlen" in s) for s in kshapes}
                        | {("e2e", s["HV"], "varlen" in s) for s in eshapes}))
    raw = {"kernel": [], "e2e": [], "skipped": []}
    env = environment("cuda")
    cmd = "python -m tools.bench.train_bwd " + " ".join(argv if argv is not None else sys.argv[1:])
    raw["memset_gbs"], raw["peak_gbs"] = harness_sanity(timing), peak_hbm_gbs()
    print(f"harness sanity: 1 GiB memset at {raw['memset_gbs']:.0f} GB/s (HBM peak {raw['peak_gbs']:.0f})", flush=True)

    def late(kind, s):
        if time.perf_counter() - t_start < args.deadline_s:
            return False
        raw["skipped"].append(dict(kind=kind, shape=s))
        return True

    def save():
        text = render(raw, env, cmd.strip())
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        if args.json:
            args.json.write_text(json.dumps(dict(env=env, cmd=cmd.strip(), **raw), indent=1, default=str))
        return text

    for s in kshapes:
        if late("kernel", s):
            continue
        x, ctab, cu = kernel_inputs(s)
        ours = measure(lambda x=x, ctab=ctab: ours_kernel(x, ctab), [()], timing).median_ms
        fla_ms = None
        if have_fla:
            fla_tuning.retune()
            fla_fn = fla_kernel_fn(x, s, cu)
            fla_fn()  # tunes on this row's shape, untimed
            fla_ms = measure(fla_fn, [()], timing).median_ms
        raw["kernel"].append(dict(shape=s, fla_ms=fla_ms, cula_ms=ours, bytes=wy_bytes(s)))
        print(kernel_row(raw["kernel"][-1]), flush=True)
        save()
        del x
        torch.cuda.empty_cache()
    for s in eshapes:
        if late("e2e", s):
            continue
        x = e2e_inputs(s)
        ours_fn = e2e_fn("cula", x)
        ours = measure(ours_fn, [()], Timing(warmup=2, repeats=5, method="events")).median_ms
        fla_ms, diff = None, None
        if have_fla:
            fla_tuning.retune()
            fla_fn = e2e_fn("fla", x)
            fla_fn()  # tunes on this row's shape, untimed
            fla_ms = measure(fla_fn, [()], Timing(warmup=2, repeats=5, method="events")).median_ms
            diff = max(rel(a, b) for a, b in zip(ours_fn(), fla_fn(), strict=False))
        del x
        st = stage_times(s)
        raw["e2e"].append(dict(shape=s, fla_ms=fla_ms, cula_ms=ours, max_rel_diff=diff, stages=st))
        print(e2e_row(raw["e2e"][-1]), "|", stage_row(raw["e2e"][-1]), flush=True)
        save()
        torch.cuda.empty_cache()
    print(save())
    print(f"train_bwd: {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


def kernel_row(r, peak_gbs) -> str:
    s, fla_ms, ours = r["shape"], r["fla_ms"], r["cula_ms"]
    gbs = r["bytes"] / (ours * 1e-3) / 1e9
    bad = max(gbs, r["bytes"] / (fla_ms * 1e-3) / 1e9 if fla_ms else 0) > peak_gbs
    sp = f"{fla_ms / ours:.2f}x" if fla_ms else "n/a"
    return (f"| {shape_label(s)} | {H} | {s['HV']} | {fla_ms or float('nan'):.3f} | {ours:.3f} | {sp} | {gbs:.0f}"
            + (" **above HBM peak: not a valid row**" if bad else "") + " |")


def e2e_row(r) -> str:
    s, fla_ms, ours = r["shape"], r["fla_ms"], r["cula_ms"]
    sp = f"{fla_ms / ours:.2f}x" if fla_ms else "n/a"
    d = r["max_rel_diff"]
    return (f"| {shape_label(s)} | {H} | {s['HV']} | {fla_ms or float('nan'):.2f} | {ours:.2f} | {sp} | "
            f"{d if d is not None else float('nan'):.1e} |")


def stage_row(r) -> str:
    st = r["stages"]
    return (f"| {shape_label(r['shape'])} | {r['shape']['HV']} | " + " | ".join(f"{st[n]:.3f}" for n in STAGES)
            + f" | {sum(st.values()):.3f} |")


def _summary(rows) -> str:
    sp = [r["fla_ms"] / r["cula_ms"] for r in rows if r["fla_ms"]]
    if not sp:
        return ""
    return (f"speed-up over {len(sp)} rows: min {min(sp):.2f}x, mean {sum(sp) / len(sp):.2f}x, "
            f"geomean {math.exp(sum(map(math.log, sp)) / len(sp)):.2f}x, max {max(sp):.2f}x")


def render(raw, env, cmd) -> str:
    md = [f"# chunk_kda backward (cula-sm100) vs FLA 0.6.0 on {env.get('gpu', 'cuda')}", "",
          f"Command: `{cmd}`; torch {env.get('torch')}, CUDA {env.get('cuda')}. speed-up = FLA time / cula time. "
          f"Harness check: a 1 GiB memset ran at {raw['memset_gbs']:.0f} GB/s (HBM peak {raw['peak_gbs']:.0f}).", ""]
    if raw["kernel"]:
        md += ["## chunk_wy_dqkg vs FLA's chunk_kda_bwd_wy_dqkg_fused (autotuned)", "",
               "Median of do_bench. GB/s: a lower bound of the bytes either kernel must move, over cula's time; a "
               "row above the HBM peak (either kernel) did not time the work.", "", _summary(raw["kernel"]), "",
               "| shape | H | HV | FLA ms | cula ms | speed-up | cula GB/s (lower bound of bytes) |",
               "|---|---:|---:|---:|---:|---:|---:|", *(kernel_row(r, raw["peak_gbs"]) for r in raw["kernel"]), ""]
    if raw["e2e"]:
        md += ["## whole forward + backward of chunk_kda (both autotuned)", "",
               "Median of CUDA events over 5 calls after 2 warm-up calls; max rel. diff: the largest relative "
               "difference between cula's and FLA's gradients of (q, k, v, g, beta, A_log, dt_bias).", "",
               _summary(raw["e2e"]), "",
               "| shape | H | HV | FLA ms | cula ms | speed-up | max rel. diff of grads |",
               "|---|---:|---:|---:|---:|---:|---:|", *map(e2e_row, raw["e2e"]), "",
               "## where cula's backward spends its time", "",
               "ms per stage (CUDA events between the stages of one backward, median of 3 calls after 2); "
               "recompute = the forward's kernels less chunk_intra (Aqk / Akk come from the forward) and the "
               "output.", "",
               "| shape | HV | " + " | ".join(STAGES) + " | total |", "|---|---:|" + "---:|" * (len(STAGES) + 1),
               *map(stage_row, raw["e2e"]), ""]
    if raw["skipped"]:
        left = [f"{r['kind']} {shape_label(r['shape'])} HV={r['shape']['HV']}" for r in raw["skipped"]]
        md += ["Not run (past the deadline): " + "; ".join(left), ""]
    return "\n".join(md)


if __name__ == "__main__":
    raise SystemExit(main())
