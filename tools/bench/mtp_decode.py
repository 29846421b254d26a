"""Benchmark of cula-sm90's multi-token-prediction decode against FLA 0.6.0, on the H100.

    python -m tools.bench.mtp_decode [--smoke] [--tilings] [--out docs/benchmarks/mtp_decode.md] [--json FILE]
    python -m tools.bench.mtp_decode --dispatch [--sections growth,decode,chain] [--json FILE] [--out FILE]
    python -m tools.bench.mtp_decode --static [--out FILE]     # no GPU: SASS of the chunk verify variants by T
    python -m tools.bench.mtp_decode --first-call [--out FILE] # each decode family's first call (compiles)
    python -m tools.bench.mtp_decode --pool-forms [--out FILE]  # T = 1 decode on every pool form, % of the HBM bound
    python -m tools.bench.mtp_decode --stream-thresholds [--out FILE]  # T = 1: dispatch's pick vs recurrent kernel

Inputs: K = V = 128, HQK = HV in (32, 64), bf16 q/k/v/g/beta (raw g, gate and L2 norm in kernel, softplus gate
with A_log and dt_bias), fp32 state pool [P, HV, K, V] (`--pool-dtype bf16`: a bf16 pool, both sides; `--v-first`:
[P, HV, V, K] pools, `state_v_first=True` on both sides), every request live, accept length m = T.

Tables:
  1. the speculative-decoding chain "verify T draft tokens + commit the state after m = T of them":
     cula = `kda_decode_mtp_kvbuffer` + `kda_flush_kvbuffer`, the verify run once per variant (the sm90 kernel
     `cula_sm90.decode.ops.kda_decode_mtp_kvbuffer` with `verify_variant` named), the flush a public op;
     FLA = `fused_recurrent_kda_fwd` writing the T per-token states into pool slots
     (`ssm_state_indices [N, T]`, slot 0 of each request its live state, as serving engines call it) + the
     index-copy commit of the accepted one. N in (1, 2, 4, 8, 16, 32, 64, 128), T in (2, 3, 4, 6).
     Also: cula's verify kernel alone, the per-token-states recurrent kernel (the drop-in of FLA's path), and
     the bytes of the KVBuffer vs the T per-token states.
  2. single-token decode (T = 1): `kda_decode` vs `fused_recurrent_kda_fwd` with `ssm_state_indices [N]`
     (in place), and at N = 128 the fraction of the HBM bound (state read + write at the peak bandwidth).
  3. host cost of one launch of a compiled kernel: the backend call (a TVM-FFI launch through
     cula_core.cute_runtime) vs the whole public op, in microseconds per call (wall clock of
     back-to-back calls at N = 1, T = 1: the host is the bottleneck there).
Timing: device time per call, from 20 calls captured in one CUDA graph and replayed under `triton.testing.do_bench`
(median after warm-up, L2 flushed between replays); the eager columns time Python calls through the harness
(tools/bench/harness.py; host cost included; cula's: the public ops, with the dispatch's pick).
`--tilings` / `--only-tilings` add / run only the sweep over the recurrent kernel's tilings that the dispatch table
(cula_sm90.decode.configs.recurrent_tiling) comes from, beside the dispatch's pick (at T = 1 the streamed kernel where
it serves the batch: configs.streams): T = 1 decode and the T = 4 verify on the recurrent kernel,
each tiling named through the `tiling` keyword of the sm90 kernels (cula_sm90.decode.ops), on the pools that
`--pool-dtype` / `--v-first` set.
Table 1 times every verify variant (recurrent, chunk SIMT, chunk tensor cores); `cula ms` is the best of them.
`--dispatch` times only what the dispatch tables pick, graph-timed: the verify alone per variant (growth in T,
beside FLA's chain and ours), T = 1 decode, the chain grid (in that order, the JSON written after every row).
Errors: max |o_cula - o_FLA| / max |o_FLA| on the first call of each cell (bf16 outputs).
`--pool-forms` times only `kda_decode` at T = 1 (the dispatch's pick, named in the `kernel` column: the streamed
kernel, or the recurrent one below the pool form's threshold, configs.streams) on every pool form a serving engine
keeps (fp32 / bf16, [K, V] / V-first), H in (32, 64), N in (128, 512), graph-timed, as the fraction of the HBM
bound (state read + write in the pool's dtype, the per-token vectors and o); at N = 128 also three passes over the
requests' state bytes (read + write, same timing), the ceilings the kernel is held against: a device copy into
another tensor, an in-place pass (torch's `mul_`), and a persistent in-place pass laid out as the streamed kernel
(`persistent_pass_hbm_pct`: as many programs as its CTAs, each walking items of one state slice's bytes; no math),
and the errors of o and of the pool against cula_core's reference run in fp64 on the same inputs.
`--stream-thresholds` times `kda_decode` at T = 1 by the dispatch's pick against the recurrent kernel at its T = 1
tiling (named through the sm90 op's `tiling`) on every pool form, over request-heads N * H from 512 to 32768
(STREAM_CELLS), graph-timed: the measurement behind configs.STREAM_MIN_HEADS.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.harness import Timing, add_do_bench_args, environment, errors, measure, peak_hbm_gbs  # noqa: E402

NS = (1, 2, 4, 8, 16, 32, 64, 128)
TS = (2, 3, 4, 6)
HS = (32, 64)
K = V = 128


def make_inputs(N, T, H, seed=0, device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device)

    bf = torch.bfloat16
    return dict(q=r(N, T, H, K).to(bf), k=r(N, T, H, K).to(bf), v=r(N, T, H, V).to(bf), g=r(N, T, H, K).to(bf),
                beta=torch.sigmoid(r(N, T, H)).to(bf),
                A_log=torch.log(torch.rand(H, generator=gen) * 15 + 1).to(device),
                dt_bias=r(H * K, scale=0.5), state_pool=r(N, H, K, V, scale=0.1).to(POOL["dtype"]),
                cache_idx=torch.randperm(N, generator=gen).to(torch.int32).to(device))


#: the pools of every row (set from --pool-dtype / --v-first): dtype, and the V-first layout (K = V here, so a
#: pool's shape is the same in both layouts; only the flag tells the ops how to index it)
POOL = {"dtype": torch.float32, "v_first": False}


def _op_args(x):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state_pool"], x["cache_idx"])


def _layout():
    return {"state_v_first": True} if POOL["v_first"] else {}


def cula_chain(x, m):
    import cula_core

    o, buf = cula_core.kda_decode_mtp_kvbuffer(*_op_args(x), A_log=x["A_log"], dt_bias=x["dt_bias"],
                                                use_qk_l2norm_in_kernel=True, **_layout())
    cula_core.kda_flush_kvbuffer(x["state_pool"], x["cache_idx"], buf, m, **_layout())
    return o


def cula_states(x):
    import cula_core

    return cula_core.kda_decode_mtp(*_op_args(x), A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True,
                                    output_per_token_states=True, **_layout())[0]


def cula_decode(x):
    import cula_core

    return cula_core.kda_decode(*_op_args(x), A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True,
                                **_layout())


VERIFY_VARIANTS = ("recurrent", "chunk_simt", "chunk_tc")  # the ones the dispatch tables pick from


def _kernel_flags():
    """The flags of the sm90 kernels (the calling convention of docs/backends.md) for make_inputs' rows."""
    return dict(scale=K ** -0.5, lower_bound=None, use_qk_l2norm_in_kernel=True, **_layout())


def named_verify(x, variant=None, tiling=None):
    """(o, KVBuffer) of the verify kernel named by `variant` / `tiling` (cula_sm90.decode.ops' keywords; None: the
    dispatch's pick): the sm90 kernel called directly, without core's validation and backend selection."""
    from cula_sm90.decode.ops import kda_decode_mtp_kvbuffer

    return kda_decode_mtp_kvbuffer(*_op_args(x), x["A_log"], x["dt_bias"], tiling=tiling, verify_variant=variant,
                                   **_kernel_flags())


def verify_variant_o(x, variant):
    return named_verify(x, variant)[0]


def chain_variant(x, m, variant):
    """cula's chain with the verify kernel `variant` and the public flush."""
    import cula_core

    o, buf = named_verify(x, variant)
    cula_core.kda_flush_kvbuffer(x["state_pool"], x["cache_idx"], buf, m, **_layout())
    return o


def decode_at_tiling(x, tiling):
    """T = 1 decode on the recurrent kernel at `tiling` (the sm90 kernel with its `tiling` keyword)."""
    from cula_sm90.decode.ops import kda_decode

    return kda_decode(*_op_args(x), x["A_log"], x["dt_bias"], tiling=tiling, **_kernel_flags())


def verify_at_tiling(x, tiling):
    """The verify on the recurrent kernel at `tiling` (a tiling names the recurrent verify, whatever N)."""
    return named_verify(x, tiling=tiling)[0]


def fla_setup(x, T):
    """FLA's pool: each request's live state in slot indices[n, 0] (= its cache_idx), its other T - 1 tokens'
    states in scratch slots after the N live ones."""
    N = x["q"].shape[0]
    pool = torch.empty(N * T, *x["state_pool"].shape[1:], device="cuda", dtype=x["state_pool"].dtype)
    pool[:N] = x["state_pool"]
    idx = torch.empty(N, T, device="cuda", dtype=torch.int32)
    idx[:, 0] = x["cache_idx"]
    idx[:, 1:] = N + torch.arange(N * (T - 1), device="cuda", dtype=torch.int32).view(N, T - 1)
    return pool, idx


def chain_case(N, T, H):
    """One chain cell's inputs: cula's (x), FLA's (xf, its pool and indices) and FLA's outputs (the reference of
    the error column) from a first call on a copy of the pool."""
    x = make_inputs(N, T, H, seed=N + T)
    pool, idx = fla_setup(x, T)
    xf = dict(x)
    return x, xf, pool, idx, fla_chain(xf, pool.clone(), idx, T)


def fla_chain(x, pool, idx, m):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                                   initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, **_layout())
    if m > 1:  # commit: the accepted token's state into the request's live slot
        pool.index_copy_(0, idx[:, 0].long(), pool[idx[:, m - 1].long()])
    return o


def fla_decode(x, pool):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                                   initial_state=pool, inplace_final_state=True, ssm_state_indices=x["cache_idx"],
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, **_layout())[0]


def hbm_pct(nbytes: float, ms: float) -> float:
    """`nbytes` moved in `ms` milliseconds, as % of the HBM bound (peak_hbm_gbs)."""
    return nbytes / (ms * 1e-3) / 1e9 / peak_hbm_gbs() * 100


def pass_hbm_pct(src, ms: float) -> float:
    """A pass that reads and writes `src`'s bytes once in `ms` milliseconds, as % of the HBM bound."""
    return hbm_pct(2 * src.numel() * src.element_size(), ms)


def copy_hbm_pct(src, timing) -> float:
    """The practical ceiling of a pass over `src`'s bytes: a device copy of them (read + write) in graph_ms's
    timing, as % of the HBM bound."""
    dst = torch.empty_like(src)
    ms = graph_ms(dst.copy_, (src,), timing)
    return pass_hbm_pct(src, ms)


def inplace_hbm_pct(src, timing) -> float:
    """An in-place pass over `src`'s bytes (read + write the same memory, torch's `mul_`) in graph_ms's timing, as %
    of the HBM bound."""
    ms = graph_ms(src.mul_, (0.5,), timing)
    return pass_hbm_pct(src, ms)


@functools.cache
def _persistent_pass_kernel():
    """The Triton kernel of persistent_pass_hbm_pct (built on first use: triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scale_items(x_ptr, items, ITEM: tl.constexpr, PROGRAMS: tl.constexpr):
        for it in tl.range(tl.program_id(0), items, PROGRAMS, num_stages=3):
            offs = it.to(tl.int64) * ITEM + tl.arange(0, ITEM)
            x = tl.load(x_ptr + offs)
            tl.store(x_ptr + offs, (x.to(tl.float32) * 0.5).to(x.dtype))

    return scale_items


def persistent_pass_hbm_pct(src, item_elems: int, programs: int, timing) -> float:
    """A persistent in-place pass over `src`'s bytes with the streamed decode's work layout and no math: `programs`
    Triton programs (the kernel's CTAs on the device), program p scaling items p, p + programs, ... of `item_elems`
    contiguous elements (a state slice) in place, 4 warps, the next item's loads software-pipelined (3 stages); in
    graph_ms's timing, as % of the HBM bound."""
    kernel = _persistent_pass_kernel()
    items = src.numel() // item_elems
    if items * item_elems != src.numel():
        raise ValueError(f"persistent_pass_hbm_pct: {src.numel()} elements are not whole items of {item_elems}")

    def run():
        kernel[(programs,)](src, items, ITEM=item_elems, PROGRAMS=programs, num_warps=4)

    ms = graph_ms(run, (), timing)
    return pass_hbm_pct(src, ms)


def graph_ms(fn, args, timing, reps=20):
    """Device time of one call: `reps` calls captured in one CUDA graph (after a warm-up call on a side stream),
    the graph replayed under do_bench; ms per call. Serving engines run decode steps this way, so this is the
    time without the host's share."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(*args)
    # do_bench directly: the harness picks its timer from the inputs' device, and a replay takes none
    import triton.testing

    ms = triton.testing.do_bench(g.replay, warmup=timing.warmup, rep=timing.repeats, return_mode="median") / reps
    del g
    return ms


def host_overhead(reps=2000):
    """µs per call of back-to-back launches at N = 1, T = 1, H = 32 (host bound)."""
    import cula_core  # noqa: F401
    from cula_sm90.decode import launch

    x = make_inputs(1, 1, 32, seed=5)
    cula_decode(x)
    torch.cuda.synchronize()
    from cula_sm90.decode.ops import kda_decode

    def direct():
        kda_decode(*_op_args(x), x["A_log"], x["dt_bias"], **_kernel_flags())

    def wall(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e6

    out = {}
    out["public op (validation + dispatch + custom op + launch)"] = wall(lambda: cula_decode(x))
    out["backend kernel (cula_core.cute_runtime TVM-FFI launch)"] = wall(direct)
    return out


def tiling_sweep(timing, hs, ns=(1, 16, 128), cases=((1, decode_at_tiling), (4, verify_at_tiling)), tilings=None):
    """Device ms of the recurrent kernel per tiling: plain decode (T = 1) and verify (T = 4), and of the dispatch's
    pick (`dispatch`: tiling None; at T = 1 the streamed kernel where configs.streams serves the batch); `cases`: (T,
    fn(x, tiling)); `tilings`: a subset of configs.TILINGS (default all)."""
    from cula_sm90.decode import configs

    timing = Timing(warmup=10, repeats=40, method=timing.method)  # many cells: shorter runs than the tables'

    out = []
    with torch.no_grad():
        for H in hs:
            for N in ns:
                for T, fn in cases:
                    x = make_inputs(N, T, H, seed=N)
                    row = dict(H=H, N=N, T=T, dispatch=graph_ms(fn, (x, None), timing))  # the dispatch's pick
                    for tiling in tilings or configs.TILINGS:
                        row[tiling] = graph_ms(fn, (x, tiling), timing)
                    out.append(row)
                    print(row, flush=True)
                    del x
    return out


def first_call_report(H: int = 32) -> str:
    """Wall time of the first call of each decode family in this process (compiling and loading every kernel
    the dispatch can pick for it: launch.family_kernels), then of the second call, synchronised. Must run
    before any other cula call in the process; CuTe DSL keeps no compiled kernel across processes."""
    import cula_core

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    x1, x4 = make_inputs(8, 1, H, seed=1), make_inputs(8, 4, H, seed=4)
    buf = []
    rows = [("kda_decode (T = 1)", lambda: cula_decode(x1)),
            ("kda_decode_mtp (T = 4)", lambda: cula_core.kda_decode_mtp(*_op_args(x4), A_log=x4["A_log"],
                                                                      dt_bias=x4["dt_bias"],
                                                                      use_qk_l2norm_in_kernel=True)),
            ("kda_decode_mtp_kvbuffer (T = 4)", lambda: buf.append(cula_core.kda_decode_mtp_kvbuffer(
                *_op_args(x4), A_log=x4["A_log"], dt_bias=x4["dt_bias"], use_qk_l2norm_in_kernel=True)[1])),
            ("kda_flush_kvbuffer (T = 4)", lambda: cula_core.kda_flush_kvbuffer(x4["state_pool"], x4["cache_idx"],
                                                                               buf[-1], 2))]
    lines = ["", f"### First call of each family (wall seconds, H = {H}, N = 8; GPU: {torch.cuda.get_device_name()})",
             "", "| op | first call s | second call s |", "|---|---:|---:|"]
    for name, fn in rows:
        first = timed(fn)
        lines.append(f"| {name} | {first:.2f} | {timed(fn):.5f} |")
    return "\n".join(lines) + "\n"


STATIC_VARIANTS = ("chunk_simt", "chunk_tc")


def static_report(ts=(2, 4, 6, 8), variants=STATIC_VARIANTS) -> str:
    """No GPU: each chunk verify variant compiled for sm_90a at each T (K = V = 128, the benchmark's dtypes and gate)
    and read with tools.kernel_report.analyse: registers, shared memory, CTAs per SM and the SASS the CTA runs (all
    loops are unrolled, so the static counts are what each thread issues, branches aside). The T = 6 / T = 2 ratio of
    the instruction total is the static view of the growth goal. Must run before cutlass is imported."""
    import tempfile

    if "cutlass" in sys.modules:
        raise SystemExit("--static must set CUTE_DSL_KEEP before cutlass is imported")
    dump = tempfile.mkdtemp(prefix="mtp_static_")
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,ptx", CUTE_DSL_DUMP_DIR=dump)
    from cula_core import cute_runtime
    from cula_sm90.decode import configs, launch
    from tools.kernel_report import analyse

    bf = torch.bfloat16
    rows = {}
    for v in variants:
        for T in ts:
            compiled = cute_runtime.compile_kernel(launch.VERIFY, launch.verify_config(
                T, K, V, bf, bf, bf, True, True, False, True, v == configs.VERIFY_CHUNK_TC))
            rows[v, T] = analyse(f"{v}[T={T}]", "decode", compiled, "sm_90a", Path(dump))
    w = lambda t: " ".join(f"{n}x{b}" for b, n in sorted(t.items())) or "-"
    lines = ["", "## Static view of the verify chain (sm_90a, K = V = 128, no GPU)", "",
             "`python -m tools.bench.mtp_decode --static`: cubins read with tools.kernel_report.analyse; SASS counts "
             "are static (every loop here is unrolled: what each thread issues, branches aside; the padded-slot branch "
             "is counted too); widths as bits x count.",
             "", "| variant | T | regs | spills (st/ld) | smem KiB | CTAs/SM | SASS | BAR | HMMA | MUFU | SHFL "
             "| LDS | STS | STG |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for (v, T), r in rows.items():
        lines.append(f"| {v} | {T} | {r.regs} | {r.spill_stores}/{r.spill_loads} | "
                     f"{(r.dynamic_smem or 0) / 1024:.1f} | {r.ctas_per_sm} | {r.sass_total} | {r.mix.get('BAR', 0)} | "
                     f"{r.mix.get('HMMA', 0)} | {r.mix.get('MUFU', 0)} | {r.mix.get('SHFL', 0)} | {w(r.lds)} | "
                     f"{w(r.sts)} | {w(r.stg)} |")
    lines.append("")
    for v in variants:
        if (v, 2) in rows and (v, 6) in rows:
            lines.append(f"{v}: SASS instructions T = 6 / T = 2: {rows[v, 6].sass_total / rows[v, 2].sass_total:.2f}x; "
                         f"BAR {rows[v, 2].mix.get('BAR', 0)} -> {rows[v, 6].mix.get('BAR', 0)}.")
    return "\n".join(lines) + "\n"


def _emit(report: str, out: Path | None) -> int:
    """Print a markdown report and, with --out, write it there."""
    print(report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--static", action="store_true",
                    help="no GPU: compile every chunk verify variant at T = 2, 4, 6, 8 and report its SASS (the chain)")
    ap.add_argument("--smoke", action="store_true", help="two cells only (CI)")
    ap.add_argument("--first-call", action="store_true",
                    help="only the wall time of each decode family's first call in a fresh process (compiles)")
    ap.add_argument("--tilings", action="store_true", help="also time every tiling of the recurrent kernel")
    ap.add_argument("--only-tilings", action="store_true", help="only the tiling sweep")
    ap.add_argument("--quick", action="store_true", help="H = 64, T in (2, 6), N in (1, 128): device times only")
    ap.add_argument("--dispatch", action="store_true",
                    help="only graph-timed runs with the dispatch tables: chain grid, verify growth, T = 1 decode")
    ap.add_argument("--sections", default="growth,decode,chain",
                    help="with --dispatch: which of growth, decode, chain to run (in that order)")
    ap.add_argument("--pool-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="state pool dtype of every row (bf16: the HBM bound halves)")
    ap.add_argument("--v-first", action="store_true", help="V-first pools [P, HV, V, K] (state_v_first=True)")
    ap.add_argument("--pool-forms", action="store_true",
                    help="only T = 1 decode on every pool form (fp32 / bf16, K-first / V-first), %% of the HBM bound")
    ap.add_argument("--stream-thresholds", action="store_true",
                    help="only T = 1 decode by the dispatch's pick against the recurrent kernel, every pool form")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the raw numbers here (as it goes)")
    add_do_bench_args(ap)
    args = ap.parse_args(argv)
    POOL.update(dtype=torch.bfloat16 if args.pool_dtype == "bf16" else torch.float32, v_first=args.v_first)
    if args.static:
        return _emit(static_report(), args.out)
    if not torch.cuda.is_available():
        print("mtp_decode: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm90"  # fail loudly rather than time the reference
    if args.first_call:
        return _emit(first_call_report(), args.out)
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    if args.pool_forms:
        raw = {"pool_forms": pool_forms_run(timing)}
        if args.json:
            args.json.write_text(json.dumps(raw, indent=2, default=str))
        return _emit(render_pool_forms(raw["pool_forms"], environment("cuda"), peak_hbm_gbs()), args.out)
    if args.stream_thresholds:
        raw = {"stream_thresholds": stream_thresholds_run(timing)}
        if args.json:
            args.json.write_text(json.dumps(raw, indent=2, default=str))
        return _emit(render_stream_thresholds(raw["stream_thresholds"], environment("cuda")), args.out)
    ns, ts, hs = ((1, 64), (4,), (32,)) if args.smoke else (NS, TS, HS)
    if args.quick:
        ns, ts, hs = (1, 128), (2, 6), (64,)
    rows, dec = [], []
    raw = {"chain": rows, "decode": dec}

    def dump():
        if args.json:
            args.json.write_text(json.dumps(raw, indent=2, default=str))

    def sweep():
        quick = ((32, 4, 4, 0), (32, 2, 4, 0), (32, 2, 4, 1))
        rows = (tiling_sweep(timing, (64,), (1, 128), ((1, decode_at_tiling),), quick) if args.quick
                else tiling_sweep(timing, hs))
        raw["tilings"] = [{("x".join(map(str, k)) if isinstance(k, tuple) else k): v for k, v in r.items()}
                          for r in rows]
        dump()

    if args.dispatch:
        def keep(d):
            raw["dispatch"] = d
            dump()

        raw["dispatch"] = dispatch_run(timing, hs, ns, ts, sections=tuple(args.sections.split(",")), dump=keep)
        dump()
        return _emit(render_dispatch(raw["dispatch"], environment("cuda")), args.out)
    if args.only_tilings:
        sweep()
        print(render_tilings(raw["tilings"]))
        return 0

    with torch.no_grad():
        for H in hs:
            for T in ts:
                for N in ns:
                    x, xf, pool, idx, ref = chain_case(N, T, H)
                    err = max(errors(chain_variant(dict(x, state_pool=x["state_pool"].clone()), T, v).float(),
                                     ref.float())[1] for v in VERIFY_VARIANTS)
                    row = dict(N=N, T=T, H=H, err=err)
                    row["fla"] = graph_ms(fla_chain, (xf, pool, idx, T), timing)
                    # every verify variant: the chain with it and the verify alone; cula = the best chain
                    row["chain_v"] = {v: graph_ms(chain_variant, (x, T, v), timing) for v in VERIFY_VARIANTS}
                    row["verify_v"] = {v: graph_ms(verify_variant_o, (x, v), timing) for v in VERIFY_VARIANTS}
                    row["best"] = min(VERIFY_VARIANTS, key=lambda v: row["chain_v"][v])
                    row["cula"] = row["chain_v"][row["best"]]
                    row["verify"] = row["verify_v"][row["best"]]
                    row["states"] = graph_ms(cula_states, (x,), timing)
                    if not args.quick:  # eager: what a caller of the public ops gets (the dispatch's pick)
                        row["cula_eager"] = measure(cula_chain, [(x, T)], timing).median_ms
                        row["fla_eager"] = measure(fla_chain, [(xf, pool, idx, T)], timing).median_ms
                    row["buf_ratio"] = (K * V) / (2 * K + V)  # per token and head: T K V vs T (2K + V) floats
                    rows.append(row)
                    print(row, flush=True)
                    dump()
                    del x, pool, idx, xf
                    torch.cuda.empty_cache()
            for N in ns:
                row, x, xf, pool = decode_row(N, H, timing)
                if not args.quick:
                    row["cula_eager"] = measure(cula_decode, [(x,)], timing).median_ms
                    row["fla_eager"] = measure(fla_decode, [(xf, pool)], timing).median_ms
                row["copy_hbm_pct"] = copy_hbm_pct(x["state_pool"].clone(), timing)
                dec.append(row)
                print(row, flush=True)
                dump()
                del x, pool, xf
                torch.cuda.empty_cache()
    raw["host_us"] = host_overhead()
    print(raw["host_us"], flush=True)
    dump()
    if args.tilings or args.quick:
        try:  # after the tables: a failure here must not cost them
            sweep()
        except Exception as exc:
            print(f"tiling sweep failed: {exc!r}", flush=True)
    report = render(raw, environment("cuda"), peak_hbm_gbs())
    if raw.get("tilings"):
        report += render_tilings(raw["tilings"])
    return _emit(report, args.out)


POOL_FORMS = ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True))


def decode_bytes(N, H, pool_dtype):
    """Bytes a T = 1 decode of N requests moves at least: the state read and written in the pool's dtype, the bf16
    per-token vectors (q, k, g: K each; v: V; beta) and the bf16 output."""
    return 2 * N * H * K * V * pool_dtype.itemsize + N * H * (3 * K + V + 1) * 2 + N * H * V * 2


def pool_form_row(dtype, v_first, H, N) -> dict:
    """A T = 1 row's pool form, shape and the kernel the dispatch picks for it (configs.streams)."""
    from cula_sm90.decode import configs

    streamed = configs.streams(configs.MODE_FINAL, 1, N, H, v_first, dtype.itemsize)
    return dict(pool=str(dtype).replace("torch.", ""), v_first=v_first, H=H, N=N,
                kernel="streamed" if streamed else "recurrent")


def stream_layout(dtype, v_first, sm_count: int) -> tuple[int, int]:
    """(elements of one state slice, CTAs launched on a device of `sm_count` SMs when there are at least that many
    items) of the streamed decode on a pool form (K = V = 128)."""
    from cula_sm90.decode import configs

    block_v = configs.stream_tiling(V, dtype.itemsize, v_first)[0]
    stages = configs.stream_stages(dtype.itemsize, v_first)
    per_sm = configs.stream_ctas_per_sm(K, dtype.itemsize, v_first, stages, block_v)
    return K * block_v, per_sm * sm_count


def pool_forms_run(timing, hs=HS, ns=(128, 512), check_n=128):
    """`--pool-forms`: one row per (pool dtype, layout, H, N)."""
    from cula_core import cute_runtime

    rows = []
    for dtype, v_first in POOL_FORMS:
        POOL.update(dtype=dtype, v_first=v_first)
        for H in hs:
            for N in ns:
                x = make_inputs(N, 1, H, seed=N)
                row = pool_form_row(dtype, v_first, H, N)
                if N == check_n:
                    ours = dict(x, state_pool=x["state_pool"].clone())
                    ref = {name: t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                           for name, t in x.items()}
                    o = cula_decode(ours)
                    os.environ["CULA_BACKEND"] = "reference"
                    try:
                        o_ref = cula_decode(ref)
                    finally:
                        os.environ["CULA_BACKEND"] = "sm90"
                    row["err_o"] = errors(o.double(), o_ref)[1]
                    row["err_pool"] = errors(ours["state_pool"].double(), ref["state_pool"])[1]
                row["ms"] = graph_ms(cula_decode, (x,), timing)
                row["hbm_pct"] = hbm_pct(decode_bytes(N, H, dtype), row["ms"])
                if N == check_n:  # the ceilings for the requests' state bytes
                    state = torch.rand(N * H * K * V, device="cuda").to(dtype)
                    row["copy_hbm_pct"] = copy_hbm_pct(state, timing)
                    row["inplace_hbm_pct"] = inplace_hbm_pct(state, timing)
                    layout = stream_layout(dtype, v_first, cute_runtime.sm_count(state.device.index))
                    row["persistent_hbm_pct"] = persistent_pass_hbm_pct(state, *layout, timing)
                rows.append(row)
                print(row, flush=True)
                del x
                torch.cuda.empty_cache()
    return rows


def render_pool_forms(rows, env, peak) -> str:
    lines = [f"GPU: {env.get('gpu', '?')}; HBM bound taken at {peak:.0f} GB/s. K = V = 128, HQK = HV = H, bf16 "
             "q/k/v/g/beta, softplus gate and L2 norm in kernel.", "",
             "| pool | layout | H | N | kernel | ms | % of HBM bound | state copy % of HBM bound | in-place pass % | "
             "persistent in-place pass % | err o | err pool |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = (f"{r['err_o']:.1e} | {r['err_pool']:.1e}" if "err_o" in r else "- | -")
        ceilings = " | ".join(f"{r[key]:.1f}%" if key in r else "-"
                              for key in ("copy_hbm_pct", "inplace_hbm_pct", "persistent_hbm_pct"))
        lines.append(f"| {r['pool']} | {'V-first' if r['v_first'] else 'K-first'} | {r['H']} | {r['N']} | "
                     f"{r['kernel']} | {r['ms']:.4f} | {r['hbm_pct']:.1f}% | {ceilings} | {err} |")
    return "\n".join(lines) + "\n"


#: (H, N) cells of `--stream-thresholds`: two per request-head count N * H from 512 to 16384, then 32768
STREAM_CELLS = ((32, 16), (64, 8), (32, 32), (64, 16), (64, 32), (32, 64), (64, 64), (32, 128), (64, 128),
                (32, 256), (64, 256), (32, 512), (64, 512))


def stream_thresholds_run(timing, cells=STREAM_CELLS):
    """`--stream-thresholds`: one row per (pool dtype, layout, H, N): `kda_decode` at T = 1 by the dispatch's pick
    and by the recurrent kernel at its T = 1 tiling, on the same inputs."""
    from cula_sm90.decode import configs

    rows = []
    for dtype, v_first in POOL_FORMS:
        POOL.update(dtype=dtype, v_first=v_first)
        for H, N in cells:
            x = make_inputs(N, 1, H, seed=N)
            tiling = configs.recurrent_tiling(N, 1, H, configs.MODE_FINAL)
            row = dict(pool_form_row(dtype, v_first, H, N), tiling=tiling, dispatch=graph_ms(cula_decode, (x,), timing),
                       recurrent=graph_ms(decode_at_tiling, (x, tiling), timing))
            rows.append(row)
            print(row, flush=True)
            del x
            torch.cuda.empty_cache()
    return rows


def render_stream_thresholds(rows, env) -> str:
    lines = [f"GPU: {env.get('gpu', '?')}. K = V = 128, HQK = HV = H, bf16 q/k/v/g/beta, softplus gate and L2 norm "
             "in kernel; device ms. `recurrent / dispatch` above 1: the dispatch's pick is faster.", "",
             "| pool | layout | H | N | N * H | dispatch's kernel | dispatch ms | recurrent tiling | recurrent ms | "
             "recurrent / dispatch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tiling = "x".join(map(str, r["tiling"]))
        lines.append(f"| {r['pool']} | {'V-first' if r['v_first'] else 'K-first'} | {r['H']} | {r['N']} | "
                     f"{r['H'] * r['N']} | {r['kernel']} | {r['dispatch']:.4f} | {tiling} | {r['recurrent']:.4f} | "
                     f"{r['recurrent'] / r['dispatch']:.2f} |")
    return "\n".join(lines) + "\n"


def decode_row(N, H, timing):
    """One T = 1 decode cell, graph-timed: cula and FLA on the same inputs, the error between their outputs, and each
    one's share of the HBM bound (state read + write, the per-token vectors and o). Returns (row, x, xf, pool), the
    inputs for whatever else the caller times on them."""
    x = make_inputs(N, 1, H, seed=N)
    pool = x["state_pool"].clone()
    xf = dict(x)
    _, err = errors(cula_decode(dict(x, state_pool=x["state_pool"].clone())).float(),
                    fla_decode(xf, pool.clone()).float())
    row = dict(H=H, N=N, err=err, cula=graph_ms(cula_decode, (x,), timing),
               fla=graph_ms(fla_decode, (xf, pool), timing))
    bytes_moved = decode_bytes(N, H, POOL["dtype"])
    row["hbm_pct"] = hbm_pct(bytes_moved, row["cula"])
    row["fla_hbm_pct"] = hbm_pct(bytes_moved, row["fla"])
    return row, x, xf, pool


def dispatch_run(timing, hs=HS, ns=NS, ts=TS, growth_ts=(2, 3, 4, 6, 8), growth_ns=(1, 16, 128),
                 sections=("growth", "decode", "chain"), dump=None):
    """Device (graph) times with the dispatch tables as they are, section by section (the cheapest and the least
    measured first; `dump(out)` after every row, so a run cut short keeps what it measured):
      growth: the verify alone per variant at H = 64, T in growth_ts, N in growth_ns (the T = 6 / T = 2 goal),
              with FLA's chain and ours (the dispatch's) beside it;
      decode: T = 1 decode (the tiling the dispatch picks) against FLA;
      chain:  verify + commit (each verify call going to the variant `configs.verify_variant` picks) against
              FLA's chain on the issue's grid."""
    from cula_sm90.decode import configs

    out = {"chain": [], "growth": [], "decode": []}

    def keep(kind, row):
        out[kind].append(row)
        print(row, flush=True)
        if dump is not None:
            dump(out)

    with torch.no_grad():
        for T in (growth_ts if "growth" in sections else ()):
            for N in growth_ns:
                x, xf, pool, idx, ref = chain_case(N, T, 64)
                row = dict(H=64, T=T, N=N, **{v: graph_ms(verify_variant_o, (x, v), timing) for v in VERIFY_VARIANTS})
                row["fla_chain"] = graph_ms(fla_chain, (xf, pool, idx, T), timing)
                row["chain"] = graph_ms(cula_chain, (x, T), timing)
                keep("growth", row)
                del x, xf, pool, idx
        for H in (hs if "decode" in sections else ()):
            for N in ns:
                row, x, xf, pool = decode_row(N, H, timing)
                row["tiling"] = configs.recurrent_tiling(N, 1, H)
                keep("decode", row)
                del x, pool, xf
        for H in (hs if "chain" in sections else ()):
            for T in ts:
                for N in ns:
                    x, xf, pool, idx, ref = chain_case(N, T, H)
                    _, err = errors(cula_chain(dict(x, state_pool=x["state_pool"].clone()), T).float(), ref.float())
                    keep("chain", dict(H=H, T=T, N=N, err=err, variant=configs.verify_variant(N, T, H),
                                       fla=graph_ms(fla_chain, (xf, pool, idx, T), timing),
                                       cula=graph_ms(cula_chain, (x, T), timing)))
                    del x, pool, idx, xf
    return out


def render_dispatch(d, env) -> str:
    lines = ["", "## With the dispatch tables (final run)", "",
             f"GPU: {env.get('gpu', '?')}. Device time (20 calls in one CUDA graph, replayed; median). `variant`: the "
             "verify kernel `configs.verify_variant` picks for the cell.", "",
             "| H | T | N | FLA ms | cula ms | speed-up | variant | max rel err (o) |",
             "|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in d["chain"]:
        lines.append(f"| {r['H']} | {r['T']} | {r['N']} | {r['fla']:.4f} | {r['cula']:.4f} | {_x(r['fla'], r['cula'])}"
                     f" | {r['variant']} | {r['err']:.1e} |")
    if d["chain"]:
        sp = [r["fla"] / r["cula"] for r in d["chain"]]
        lines += ["", f"chain speed-up: min {min(sp):.2f}x, max {max(sp):.2f}x; at T >= 4: min "
                      f"{min(r['fla'] / r['cula'] for r in d['chain'] if r['T'] >= 4):.2f}x."]
    gv = [v for v in VERIFY_VARIANTS if d["growth"] and v in d["growth"][0]]
    lines += ["", "### Verify alone, per variant (H = 64; ms), with the chains", "",
              "| T | N | " + " | ".join(gv) + " | FLA chain | chain (dispatch) | speed-up |",
              "|---:|---:|" + "---:|" * (len(gv) + 3)]
    for r in d["growth"]:
        lines.append(f"| {r['T']} | {r['N']} | " + " | ".join(f"{r[v]:.4f}" for v in gv)
                     + f" | {r['fla_chain']:.4f} | {r['chain']:.4f} | {_x(r['fla_chain'], r['chain'])} |")
    for v in gv:
        g = [(b[v] / a[v], a["N"]) for a in d["growth"] for b in d["growth"]
             if a["T"] == 2 and b["T"] == 6 and a["N"] == b["N"]]
        if g:
            lines.append("")
            lines.append(f"{v}: T = 6 over T = 2 " + ", ".join(f"{x:.2f}x (N = {n})" for x, n in g) + ".")
    lines += ["", "### Single-token decode (T = 1)", "",
              "| H | N | tiling | FLA ms | cula ms | speed-up | cula % of HBM bound | FLA % of HBM bound "
              "| max rel err |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["decode"]:
        lines.append(f"| {r['H']} | {r['N']} | {'x'.join(map(str, r['tiling']))} | {r['fla']:.4f} | {r['cula']:.4f} "
                     f"| {_x(r['fla'], r['cula'])} | {r['hbm_pct']:.0f}% | {r['fla_hbm_pct']:.0f}% | {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def render_tilings(rows) -> str:
    keys = [k for k in rows[0] if "x" in k]
    pool = f"{str(POOL['dtype']).replace('torch.', '')} {'V-first' if POOL['v_first'] else 'K-first'} pools"
    lines = ["", f"## Recurrent kernel per tiling ({pool}; device ms; tiling = BV x lanes along V x warps x "
             "warp-local)", "",
             "| H | N | T | dispatch | " + " | ".join(keys) + " | best tiling |", "|" + "---:|" * (len(keys) + 5)]
    for r in rows:
        best = min(keys, key=lambda k: r[k])
        lines.append(f"| {r['H']} | {r['N']} | {r['T']} | {r['dispatch']:.4f} | "
                     + " | ".join(f"{r[k]:.4f}" for k in keys) + f" | {best} |")
    return "\n".join(lines) + "\n"


def _x(a, b):
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def render(raw, env, peak) -> str:
    rows, dec = raw["chain"], raw["decode"]
    lines = [
        "# cula-sm90 MTP decode vs FLA 0.6.0",
        "",
        f"GPU: {env.get('gpu', '?')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"triton {env.get('triton', '?')}, "
        f"FLA {env.get('fla-core', env.get('flash-linear-attention', '?'))}, cula-sm90 {env.get('cula-sm90', '?')}. "
        f"HBM peak taken as {peak:.0f} GB/s.",
        "",
        "Command: `python -m tools.bench.mtp_decode --out docs/benchmarks/mtp_decode.md` (inputs, timing and the "
        "FLA chain: the module docstring). K = V = 128, bf16 inputs, fp32 state, m = T.",
        "",
        "## Verify + commit (m = T)",
        "",
        "Device time per chain, each captured 20 times in one CUDA graph and replayed (as serving engines run "
        "decode). `speed-up` = FLA chain ms / cula chain ms. `verify` = cula's verify alone; `per-token states` = "
        "cula's recurrent kernel writing the T states (FLA's output, without its commit). `eager` columns: the "
        "chains called from Python, host overhead included (cula: through the public ops with the dispatch's "
        "verify, validation and torch custom-op dispatch included). Buffer: the KVBuffer holds "
        f"{(2 * K + V)} floats per token and head against {K * V} for a state: "
        f"{K * V / (2 * K + V):.0f}x fewer bytes.",
        "",
        "| H | T | N | FLA ms | cula ms | speed-up | best verify | chain: recurrent / chunk SIMT / chunk TC ms "
        "| verify: recurrent / chunk SIMT / chunk TC ms | per-token states ms | FLA eager ms | cula eager ms "
        "| eager speed-up | max rel err (o) |",
        "|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ch = " / ".join(f"{r['chain_v'][v]:.4f}" for v in VERIFY_VARIANTS)
        ve = " / ".join(f"{r['verify_v'][v]:.4f}" for v in VERIFY_VARIANTS)
        lines.append(f"| {r['H']} | {r['T']} | {r['N']} | {r['fla']:.4f} | {r['cula']:.4f} | {_x(r['fla'], r['cula'])} "
                     f"| {r['best']} | {ch} | {ve} | {r['states']:.4f} | {r.get('fla_eager', 0):.4f} "
                     f"| {r.get('cula_eager', 0):.4f} | {_x(r.get('fla_eager'), r.get('cula_eager'))} "
                     f"| {r['err']:.1e} |")
    if rows:
        sp = [r["fla"] / r["cula"] for r in rows]
        lines += ["", f"chain speed-up: min {min(sp):.2f}x, max {max(sp):.2f}x; at T >= 4: min "
                      f"{min(r['fla'] / r['cula'] for r in rows if r['T'] >= 4):.2f}x."]
        for v in VERIFY_VARIANTS:
            grow = []
            for H in sorted({r["H"] for r in rows}):
                for N in sorted({r["N"] for r in rows}):
                    a = [r for r in rows if r["H"] == H and r["N"] == N and r["T"] == 2]
                    b = [r for r in rows if r["H"] == H and r["N"] == N and r["T"] == 6]
                    if a and b:
                        grow.append((b[0]["verify_v"][v] / a[0]["verify_v"][v], H, N))
            if grow:
                lines += [f"verify time T = 6 over T = 2, {v}: {min(grow)[0]:.2f}x to {max(grow)[0]:.2f}x "
                          f"(largest at H = {max(grow)[1]}, N = {max(grow)[2]}).", ""]
    lines += ["", "## Single-token decode (T = 1)", "",
              "Device time (CUDA graph, as above); eager: called from Python.", "",
              "| H | N | FLA ms | cula ms | speed-up | cula % of HBM bound | FLA % of HBM bound "
              "| state copy % of HBM bound | FLA eager ms | cula eager ms | max rel err (o) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in dec:
        lines.append(f"| {r['H']} | {r['N']} | {r['fla']:.4f} | {r['cula']:.4f} | {_x(r['fla'], r['cula'])} | "
                     f"{r['hbm_pct']:.0f}% | {r['fla_hbm_pct']:.0f}% | {r.get('copy_hbm_pct', 0):.0f}% "
                     f"| {r.get('fla_eager', 0):.4f} "
                     f"| {r.get('cula_eager', 0):.4f} "
                     f"| {r['err']:.1e} |")
    host = raw.get("host_us")
    if host:
        lines += ["", "## Host cost of one call (µs, N = 1, T = 1, H = 32, back-to-back)", "",
                  "| path | µs per call |", "|---|---:|"]
        for k, v in host.items():
            lines.append(f"| {k} | {v if isinstance(v, bool) else f'{v:.1f}'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
