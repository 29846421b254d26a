"""Benchmark of cula-sm100's chunk_kda backward against FLA 0.6.0: the fused chunk_wy_dqkg kernel against FLA's
`chunk_kda_bwd_wy_dqkg_fused`, and the whole forward + backward of `chunk_kda`.

    python -m tools.bench.train_bwd [--smoke] [--out docs/benchmarks/train_bwd.md] [--json FILE] [--wy-variant v1,v2]

`--wy-variant` (default v1): the chunk_wy_dqkg kernels to time, comma-separated (v1: chunk_wy_dqkg.py, today's
default; v2: chunk_wy_dqkg_v2.py, opt-in): one cula column and one speed-up column each, all against the same FLA
time in one run, plus the largest relative difference of every later variant's outputs from the first's. The
whole forward + backward rows and the stage times run with the LAST variant listed (CULA_SM100_WY_DQKG).

Kernel rows: H = 32 q/k heads, HV in (32, 64), B = 2, T in (1024, 4096, 8192), plus varlen (B = 1, 8192 tokens)
with 10 and 20 sequences of uniform, random and skewed lengths, at HV = 32. The issue's grid (B in {1, 2},
T from 256) is trimmed to the device time this run had; the trimmed rows are the smaller ones. Both kernels get
the same inputs in their own conventions (ours: G in natural log, dq/dk summed per q/k head inside the kernel;
FLA: g in log2 units and dq/dk per value head; the FLA row includes the GVA sum FLA's caller does, a
`.view(...).sum()`, timed separately and shown). FLA's kernel is autotuned (Triton) before timing: its
configurations compile in parallel processes first (tools/bench/sm89_prefill.py's warm-up pattern), then the
timing process tunes alone.
Whole forward + backward rows: `cula_core.chunk_kda` (CULA_BACKEND=sm100) and `fla.ops.kda.chunk_kda` with
use_gate_in_kernel and use_qk_l2norm_in_kernel, then `.backward(do)`. FLA runs there with the first of its
autotune configurations per kernel (not tuned: autotuning all of FLA's forward and backward kernels takes
minutes of device time this run did not have), so those rows are indicative only. cula's backward still runs
four of its stages in PyTorch (docs/sm100_backward.md), which dominates them.
Timing: median of `triton.testing.do_bench` through tools/bench/harness.py, after warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.harness import Timing, environment, measure  # noqa: E402

H = 32
K = V = 128
TOKENS = 8192
# most telling rows first: a run cut short by its time limit still has them (the table is written row by row)
KERNEL_SHAPES = [dict(B=2, T=8192, HV=hv) for hv in (32, 64)]
KERNEL_SHAPES += [dict(B=1, T=TOKENS, HV=32, varlen=(kind, n)) for n in (10, 20)
                  for kind in ("uniform", "random", "skewed")]
KERNEL_SHAPES += [dict(B=2, T=t, HV=hv) for hv in (32, 64) for t in (1024, 4096)]
E2E_SHAPES = [dict(B=2, T=4096, HV=32), dict(B=1, T=TOKENS, HV=32, varlen=("random", 10))]
# --quick: the rows a short device slot affords (the most telling of each kind)
QUICK_KERNELS = [dict(B=2, T=8192, HV=32), dict(B=2, T=8192, HV=64), dict(B=1, T=TOKENS, HV=32, varlen=("random", 20)),
                 dict(B=2, T=1024, HV=32)]
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


# H100 SXM HBM3 peak; a row whose bytes / time exceeds it cannot have timed the kernel's work
HBM_PEAK_GBS = 3350.0


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
    """GB/s of a 1 GiB memset through the same harness: near HBM_PEAK_GBS or below it if the timer is sound."""
    buf = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    ms = measure(buf.zero_, [()], timing).median_ms
    return (1 << 30) / (ms * 1e-3) / 1e9


def ours_kernel(x, ctab, variant="v1"):
    from cula_sm100.backward import launch

    return launch.chunk_wy_dqkg(x["q"], x["k"], x["v"], x["v_new"], x["G"], x["beta"], x["A"], x["h"], x["do"],
                                x["dh"], x["dv"], ctab, scale=K ** -0.5, variant=variant)


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


def warm_one(hv: int):
    """Compile FLA's fused kernel's configurations for HV = hv (one process per HV, run in parallel)."""
    shape = dict(B=1, T=1024, HV=hv)
    x, _, cu = kernel_inputs(shape)
    fla_kernel_fn(x, shape, cu)()
    torch.cuda.synchronize()


def warm_fla(hvs) -> None:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                               f"from tools.bench.train_bwd import warm_one; warm_one({hv})"]) for hv in hvs]
    bad = [p.args for p in procs if p.wait() != 0]
    # the processes tuned with the GPU shared: drop their choices, so that this process tunes alone (on kernels
    # already compiled)
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    removed = 0
    for f in cache.rglob("*.autotune.json"):
        f.unlink()
        removed += 1
    print(f"FLA warm-up: {len(procs)} processes in {time.perf_counter() - t0:.0f} s ({removed} autotune results "
          f"dropped; failures: {bad})", flush=True)


def warm_e2e(eshapes) -> None:
    """Compile FLA's forward and backward kernels of the whole-op rows (one configuration each, as timed)."""
    sys.path.insert(0, str(ROOT / "tests" / "sm100"))
    from backward_cases import fla_one_config

    t0 = time.perf_counter()
    for s in eshapes:
        fn = e2e_fn("fla", e2e_inputs(s))
        fla_one_config()
        fn()
        torch.cuda.synchronize()
    print(f"FLA whole-op warm-up: {time.perf_counter() - t0:.0f} s", flush=True)


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


def stage_times(shape, reps=5):
    """Median ms of each stage of cula's backward (launch.chunk_kda_backward with CUDA events between stages):
    where the backward's time goes, to order the remaining work."""
    from cula_sm100.backward import launch

    x = e2e_inputs(shape)
    args = (x["do"], None, x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None, x["cu"],
            x["cu_cpu"])
    kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, gate="softplus", lower_bound=None,
              beta_activation="none")
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
    ap.add_argument("--quick", action="store_true", help="the trimmed grid of a short device slot")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    ap.add_argument("--no-e2e", action="store_true", help="kernel rows only")
    ap.add_argument("--warm-only", action="store_true",
                    help="only compile FLA's kernels of this grid (run while the GPU does something else, then the "
                         "timing run with --no-warm)")
    ap.add_argument("--no-warm", action="store_true", help="FLA's kernels are compiled already (--warm-only)")
    ap.add_argument("--wy-variant", default="v1",
                    help="chunk_wy_dqkg variants to time, comma-separated: v1 (default kernel), v2 (opt-in); the "
                         "whole fwd+bwd rows use the last one")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.wy_variant.split(",") if v.strip()]
    if not variants or any(v not in ("v1", "v2") for v in variants):
        ap.error(f"--wy-variant: expected v1 and/or v2, comma-separated, got {args.wy_variant!r}")
    if not torch.cuda.is_available():
        print("train_bwd: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm100"
    os.environ["CULA_SM100_WY_DQKG"] = variants[-1]  # the whole fwd+bwd rows and the stage times
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    kshapes = SMOKE_KERNELS if args.smoke else QUICK_KERNELS if args.quick else KERNEL_SHAPES
    eshapes = [] if args.no_e2e else (SMOKE_E2E if args.smoke else QUICK_E2E if args.quick else E2E_SHAPES)
    try:
        import fla  # noqa: F401
        have_fla = True
    except ImportError:
        have_fla = False
    if have_fla and not args.no_warm:
        warm_fla(sorted({s["HV"] for s in kshapes}))
    if args.warm_only:
        if have_fla:
            warm_e2e(eshapes)
        return 0
    rows, raw = [], {"kernel": [], "e2e": []}
    sanity = harness_sanity(timing)
    print(f"harness sanity: 1 GiB memset at {sanity:.0f} GB/s (HBM peak ~{HBM_PEAK_GBS:.0f})", flush=True)
    raw["memset_gbs"] = sanity
    vcols = "".join(f" cula {v} ms | speed-up {v} |" for v in variants)
    diff_col = f" max rel. diff {', '.join(variants[1:])} vs {variants[0]} |" if len(variants) > 1 else ""
    head = (f"| shape | H | HV | FLA ms |{vcols} cula {variants[-1]} GB/s (lower bound of bytes) |{diff_col}\n"
            "|---|---:|---:|---:|" + "---:|---:|" * len(variants) + "---:|" + ("---:|" if diff_col else ""))
    print(head, flush=True)
    for s in kshapes:
        x, ctab, cu = kernel_inputs(s)
        times = {v: measure(lambda x=x, ctab=ctab, v=v: ours_kernel(x, ctab, v), [()], timing).median_ms
                 for v in variants}
        ours = times[variants[-1]]
        fla_ms = None
        if have_fla:
            fla_ms = measure(fla_kernel_fn(x, s, cu), [()], timing).median_ms
        cells = "".join(f" {times[v]:.3f} | {f'{fla_ms / times[v]:.2f}x' if fla_ms else 'n/a'} |" for v in variants)
        nbytes = wy_bytes(s)
        gbs = [nbytes / (t * 1e-3) / 1e9 for t in (*times.values(), fla_ms) if t]
        bw = f"{gbs[len(variants) - 1]:.0f}" + (" **above HBM peak: not a valid row**" if max(gbs) > HBM_PEAK_GBS
                                                else "")
        diff = None
        if len(variants) > 1:  # the variants must agree: a fast wrong kernel is not a row
            first = ours_kernel(x, ctab, variants[0])
            diff = max(rel(a, b) for v in variants[1:] for a, b in zip(ours_kernel(x, ctab, v), first, strict=True))
        rows.append(f"| {shape_label(s)} | {H} | {s['HV']} | {fla_ms or float('nan'):.3f} |{cells} {bw} |"
                    + (f" {diff:.1e} |" if diff is not None else ""))
        raw["kernel"].append(dict(shape=s, fla_ms=fla_ms, cula_ms=ours, cula_ms_by_variant=times, bytes=nbytes,
                                  variant_rel_diff=diff))
        print(rows[-1], flush=True)
        if args.out:
            args.out.write_text("\n".join([head, *rows, ""]))
        del x
        torch.cuda.empty_cache()
    srows = []
    shead = ("| shape | HV | " + " | ".join(STAGES) + " | total |\n|---|---:|" + "---:|" * (len(STAGES) + 1))
    if eshapes:
        print(shead, flush=True)
    for s in eshapes:
        st = stage_times(s)
        srows.append(f"| {shape_label(s)} | {s['HV']} | " + " | ".join(f"{st[n]:.2f}" for n in STAGES)
                     + f" | {sum(st.values()):.2f} |")
        raw.setdefault("stages", []).append(dict(shape=s, **st))
        print(srows[-1], flush=True)
        torch.cuda.empty_cache()
    erows = []
    if eshapes:
        ehead = ("| shape | H | HV | FLA ms (untuned) | cula ms | speed-up | max rel. diff of grads |\n"
                 "|---|---:|---:|---:|---:|---:|---:|")
        print(ehead, flush=True)
        if have_fla:  # after the kernel rows: their tuned configuration stays cached
            sys.path.insert(0, str(ROOT / "tests" / "sm100"))
            from backward_cases import fla_one_config

            fla_one_config()
    for s in eshapes:
        x = e2e_inputs(s)
        ours_fn = e2e_fn("cula", x)
        ours = measure(ours_fn, [()], Timing(warmup=2, repeats=5, method="events")).median_ms
        fla_ms, diff = None, None
        if have_fla:
            fla_fn = e2e_fn("fla", x)
            fla_ms = measure(fla_fn, [()], Timing(warmup=2, repeats=5, method="events")).median_ms
            diff = max(rel(a, b) for a, b in zip(ours_fn(), fla_fn(), strict=False))
        sp = f"{fla_ms / ours:.2f}x" if fla_ms else "n/a"
        erows.append(f"| {shape_label(s)} | {H} | {s['HV']} | {fla_ms or float('nan'):.2f} | {ours:.2f} | {sp} | "
                     f"{diff if diff is not None else float('nan'):.1e} |")
        raw["e2e"].append(dict(shape=s, fla_ms=fla_ms, cula_ms=ours, max_rel_diff=diff))
        print(erows[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    env = environment("cuda")
    cmd = "python -m tools.bench.train_bwd " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [f"# chunk_kda backward (cula-sm100) vs FLA 0.6.0 on {env.get('gpu', 'cuda')}", "",
          f"Command: `{cmd.strip()}`; torch {env.get('torch')}, CUDA {env.get('cuda')}. Median of do_bench "
          "(kernel rows) / CUDA events over 5 calls after 2 warm-up calls (whole fwd+bwd rows). "
          "speed-up = FLA time / cula time. GB/s: a lower bound of the bytes either kernel must move over "
          f"cula's time; a row above the HBM peak (either kernel) did not time the work. Harness check: a 1 GiB "
          f"memset ran at {sanity:.0f} GB/s.", "",
          "## chunk_wy_dqkg vs FLA's chunk_kda_bwd_wy_dqkg_fused (autotuned)", "",
          f"cula variants: {', '.join(variants)} (v1 chunk_wy_dqkg.py, v2 chunk_wy_dqkg_v2.py); the whole fwd+bwd "
          f"rows and stage times below ran with {variants[-1]}.", "", head, *rows, ""]
    if erows:
        md += ["## whole forward + backward of chunk_kda (FLA with one configuration per kernel, untuned)", "",
               ehead, *erows, ""]
    if srows:
        md += ["## where cula's backward spends its time", "",
               "ms per stage, median of 5 calls; recompute = the forward's kernels.", "", shead, *srows, ""]
    text = "\n".join(md)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(dict(env=env, **raw), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
