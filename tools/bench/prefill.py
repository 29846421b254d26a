"""Benchmark of cula-sm90's KDA prefill (`cula.kda_prefill`, forced onto the sm90 backend) against FLA 0.6.0's
`chunk_kda` forward, on the same bf16 inputs, with the gate, q/k L2 norm and safe gate (lower_bound = -5) in
kernel for both.

    python -m tools.bench.prefill [--smoke] [--out docs/benchmarks/prefill.md] [--json FILE] [--keep-autotune]

Shapes (the issue's grid): fixed length H = 64, B in (1, 2), T in (512, 1024, 4096, 8192, 16384); varlen with
10 and 20 sequences of 4096 / 8192 / 16384 tokens in all, lengths uniform, random (a seeded random split) or
skewed (one sequence holds half the tokens), H = 64. K = V = 128, raw g ~ N(0, 1), beta in (0, 1), no initial
state, the final state returned. Timing: tools/bench/harness.py (`triton.testing.do_bench` median after
warm-up); cula is timed through the public op (validation, dispatch and the custom op included) with
`intracard_cp="auto"` and `cu_seqlens_cpu` given, FLA through `fla.ops.kda.chunk_kda` under `torch.no_grad`.
`speed-up` = FLA ms / cula ms; the error columns compare cula's (o, final state) with FLA's.

FLA autotunes each kernel on its first call per configuration (minutes): `warm_fla` compiles them in parallel
processes first and drops what they tuned on the shared GPU (this process then tunes alone); autotune results
already in Triton's cache (restored from .bench-cache/: an earlier run's) are kept; `--keep-autotune` keeps the
parallel processes' results too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.harness import Timing, compare, environment  # noqa: E402

K = 128
FIXED = [dict(B=b, T=t, H=64) for b in (1, 2) for t in (512, 1024, 4096, 8192, 16384)]
VARLEN = [dict(B=1, N=n, T=t, H=64, lens=kind) for n in (10, 20) for t in (4096, 8192, 16384)
          for kind in ("uniform", "random", "skewed")]
SMOKE = [dict(B=1, T=1024, H=64), dict(B=1, N=10, T=4096, H=64, lens="skewed")]


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


def make_inputs(shape, seed=0, device="cuda"):
    B, T, H = shape["B"], shape["T"], shape["H"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    kw = dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, H, K).bfloat16(),
              g=r(B, T, H, K).bfloat16(), beta=torch.rand(B, T, H, generator=gen, device=device).bfloat16(),
              A_log=torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=gen)),
              dt_bias=0.1 * r(H * K), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True,
              lower_bound=-5.0, output_final_state=True)
    if "N" in shape:
        lens = lengths(shape["N"], T, shape["lens"])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    return kw


def cula_prefill(**kw):
    import cula

    return cula.kda_prefill(**kw)


def fla_chunk_kda(**kw):
    from fla.ops.kda import chunk_kda

    kw = dict(kw)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = kw["cu_seqlens"].long()
        kw["cu_seqlens_cpu"] = kw["cu_seqlens_cpu"].long()
    with torch.no_grad():
        return chunk_kda(**kw)


def warm_one(H: int, varlen: bool) -> None:
    """One FLA call at (T=4096, H) fixed-length or varlen: compiles (and autotunes) into Triton's cache."""
    shape = dict(B=1, N=4, T=4096, H=H, lens="uniform") if varlen else dict(B=1, T=4096, H=H)
    fla_chunk_kda(**make_inputs(shape))
    torch.cuda.synchronize()


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def autotune_results() -> set[Path]:
    return set(triton_cache_dir().rglob("*.autotune.json"))


def warm_fla(keys, keep_autotune: bool = False, module: str = "tools.bench.prefill",
             timeout: float | None = None) -> None:
    """Compile FLA's kernels for each (H, varlen) in parallel processes, then drop the autotuning they did
    with the GPU shared, so that this process tunes alone on compiled kernels. Results that were in Triton's
    cache before (restored from .bench-cache/: an earlier run's, tuned alone) stay; `keep_autotune` keeps the
    parallel processes' results too (saves the tuning time, at the cost of configurations picked on a shared GPU).
    `timeout` (s): processes still running then are killed (what they compiled stays in the cache)."""
    t0 = time.perf_counter()
    before = autotune_results()
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                               f"from {module} import warm_one; warm_one({H}, {varlen})"])
             for H, varlen in sorted(keys)]
    def wait(p):
        try:
            return p.wait(timeout=None if timeout is None else max(1.0, t0 + timeout - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()

    bad = [p.args[-1] for p in procs if wait(p) != 0]
    removed = 0
    for f in [] if keep_autotune else autotune_results() - before:
        f.unlink()
        removed += 1
    print(f"FLA warm-up: {len(procs)} processes in {time.perf_counter() - t0:.0f} s ({len(before)} autotune results "
          f"restored, {removed} tuned in parallel dropped; failures: {bad})", flush=True)


def save_autotune(path: Path) -> None:
    """Triton's autotune results (FLA's, *.autotune.json) as a tar for .bench-cache/ (restore: tar -xf into
    ~/.triton/cache)."""
    import tarfile

    root = triton_cache_dir()
    files = sorted(autotune_results())
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(root)))
    print(f"saved {len(files)} autotune results to {path}", flush=True)


def profiled(fn, kw: dict, calls: int, cpu: bool = False):
    """torch.profiler over `calls` calls of fn(**kw) after three warm-up calls (CUDA activity; CPU too with `cpu`)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(**kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])) as prof:
        for _ in range(calls):
            fn(**kw)
        torch.cuda.synchronize()
    return prof


def profile_kernels(shape, calls: int = 10) -> None:
    """Mean CUDA time per call of each kernel of cula's prefill at one shape (torch.profiler)."""
    prof = profiled(cula_prefill, make_inputs(shape), calls)
    print(f"profile {shape}: per call")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        print(f"  {e.device_time_total / calls / 1000:8.3f} ms  {e.key[:90]}")


def label(shape) -> dict:
    out = {"B": shape["B"], "T": shape["T"], "H": shape["H"]}
    if "N" in shape:
        out.update(N=shape["N"], lens=shape["lens"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--keep-autotune", action="store_true")
    ap.add_argument("--no-fla", action="store_true", help="time cula alone")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--profile", metavar="B,T,H", help="per-kernel CUDA times of cula at one shape, then exit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm90"  # fail loudly rather than time the reference
    if args.profile:
        B, T, H = (int(x) for x in args.profile.split(","))
        profile_kernels(dict(B=B, T=T, H=H))
        return 0
    shapes = SMOKE if args.smoke else FIXED + VARLEN
    fla = None
    if not args.no_fla:
        try:
            import fla.ops.kda

            fla = fla_chunk_kda
            warm_fla({(s["H"], "N" in s) for s in shapes}, args.keep_autotune)
        except ImportError as exc:
            print(f"prefill: FLA not importable ({exc})", file=sys.stderr)
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    sections = []
    for name, group in (("fixed length", [s for s in shapes if "N" not in s]),
                        ("varlen", [s for s in shapes if "N" in s])):
        if not group:
            continue
        rep = compare(group, lambda s, seed, device: make_inputs(s, seed, device), cula_prefill, fla,
                      timing=timing, device="cuda", title=f"kda_prefill, {name}: FLA 0.6.0 chunk_kda vs cula-sm90")
        for row, s in zip(rep.rows, group, strict=True):
            row.shape = label(s)
        sections.append(rep)
        print(rep.markdown(), flush=True)
    env = environment("cuda")
    sp = [r.speedup for rep in sections for r in rep.rows if r.speedup is not None]
    lines = ["# cula-sm90 KDA prefill vs FLA 0.6.0 chunk_kda", "",
             f"GPU: {env.get('gpu', '?')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, triton "
             f"{env.get('triton', '?')}, FLA {env.get('fla-core', '?')}, cula-sm90 {env.get('cula-sm90', '?')}.", "",
             f"Command: `python -m tools.bench.prefill {' '.join(argv if argv is not None else sys.argv[1:])}` "
             "(inputs, timing and columns: the module docstring). `speed-up` = FLA ms / cula ms; errors: cula's (o, final state) vs FLA's "
             "(max abs, and max |diff| / max |FLA| over the two).", ""]
    if sp:
        mean = sum(sp) / len(sp)
        lines += [f"Mean speed-up {mean:.2f}x (min {min(sp):.2f}x, max {max(sp):.2f}x) over {len(sp)} shapes.", ""]
    report = "\n".join(lines) + "\n" + "\n".join(rep.markdown() for rep in sections)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    if args.json:
        import json

        args.json.write_text(json.dumps([rep.to_dict() for rep in sections], indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
