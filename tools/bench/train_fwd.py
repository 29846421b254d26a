"""Benchmark of cula-sm100's chunk_kda training forward (bf16, K = V = 128, native GVA) against FLA 0.6.0's
chunk_kda forward with the same flags, plus per-kernel rows (chunk_intra, recompute_w_u) against FLA's.

    python -m tools.bench.train_fwd [--smoke] [--kernels-only] [--hv 64,128] [--delta-h-sweep]
                                    [--out docs/benchmarks/train_fwd.md] [--json FILE]

End to end (`chunk_kda`): B = 2, HQK = 64, HV in (64, 128, 256), T in (512 .. 32768), and varlen (B = 1, 8
sequences, 16384 tokens, one of length 1). Inputs as in training: bf16 q, k, v; raw gate (fp32) with
`use_gate_in_kernel=True` (softplus gate, A_log, dt_bias); `use_qk_l2norm_in_kernel=True`; beta bf16 in (0, 1);
no initial state, no final state. cula runs through the public op `cula_core.chunk_kda` with CULA_BACKEND=sm100
(validation, dispatch and the custom op included), FLA through `fla.ops.kda.chunk_kda` under no_grad.
Per-kernel rows (at T = 8192 and varlen) time the stages on the same prepared inputs (normalised q/k, the
chunk-local cumsum of the gate, our intermediates viewed in FLA's layout): ours `chunk_intra` and
`recompute_w_u` (the separate kernels, which the backward still runs) against FLA's `chunk_kda_fwd_intra` (which
runs its intra kernels *and* its recompute_w_u) and FLA's `recompute_w_u_fwd`; the `chunk_intra` row compares
ours with FLA's difference of the two (FLA's intra part alone), labelled as derived; the fused `chunk_intra_wu`
(G in) against `chunk_kda_fwd_intra`; the forward's stage `chunk_intra_wu_gate` (raw gate in: the gate, its chunk
cumsum, chunk_intra and recompute_w_u in one kernel, writing qg = q e^G in bf16 and only the last row of each chunk
of G) against FLA's `kda_gate_chunk_cumsum` + `chunk_kda_fwd_intra`; then `chunk_delta_h` against
`chunk_gated_delta_rule_fwd_h`, `fwd_o` (q and G in) and the forward's `fwd_o` from qg against `chunk_gla_fwd_o_gk`,
the gate alone against `kda_gate_chunk_cumsum` and the L2 norm of q against `l2norm_fwd` (the forward runs it on q
and on k). The "sum of the forward's stages" row adds the stages the forward launches. `--hv` keeps only the
listed value-head counts (FLA autotunes per HV).
FLA at its best (tools/bench/fla_tuning.py): no autotune choice read from disk, its kernels compiled in parallel
processes first (their choices, made with the GPU shared, dropped), then on every shape this process forgets every
choice (`fla_tuning.retune`) and calls each FLA function once, untimed, so that it tunes on that shape.
Timing: median of `triton.testing.do_bench` through tools/bench/harness.py, after warm-up. The errors column is
||cula - FLA|| / ||FLA|| of o on the timed inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import fla_tuning  # noqa: E402
from tools.bench.harness import Timing, add_do_bench_args, environment, measure  # noqa: E402

K = V = 128
HQK = 64
VARLEN = [4096, 512, 3000, 1, 2048, 777, 4000, 1950]  # 8 sequences, 16384 tokens
E2E = [dict(B=2, T=t, HV=hv) for hv in (64, 128, 256) for t in (512, 1024, 4096, 8192, 16384, 32768)
       if hv * t <= 128 * 32768]  # HV = 256 at T = 32768 needs > 80 GB for both implementations: trimmed
E2E += [dict(B=1, T=sum(VARLEN), HV=hv, varlen=True) for hv in (64, 128, 256)]
KERNEL_SHAPES = [dict(B=2, T=8192, HV=hv) for hv in (64, 128, 256)] + [dict(B=1, T=sum(VARLEN), HV=128, varlen=True)]
SMOKE_E2E = [dict(B=2, T=1024, HV=64), dict(B=2, T=1024, HV=128), dict(B=1, T=sum(VARLEN), HV=64, varlen=True)]
SMOKE_KERNELS = [dict(B=2, T=1024, HV=128)]


def make_inputs(B, T, HV, varlen=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    x = dict(q=r(B, T, HQK, K).bfloat16(), k=r(B, T, HQK, K).bfloat16(), v=r(B, T, HV, V).bfloat16(),
             g=r(B, T, HV, K), beta=torch.sigmoid(r(B, T, HV)).bfloat16(),
             A_log=torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1), dt_bias=0.1 * r(HV * K))
    if varlen:
        cu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()], dtype=torch.int32)
        x["cu_seqlens"], x["cu_seqlens_cpu"] = cu.cuda(), cu
        # FLA's int64 offsets, made once: FLA caches its chunk indices by the identity of this tensor
        x["fla_cu_seqlens"] = cu.long().cuda()
    return x


FLAGS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)


def cula_e2e(q, k, v, g, beta, A_log, dt_bias, cu_seqlens=None, cu_seqlens_cpu=None, fla_cu_seqlens=None):
    """cula's chunk_kda on make_inputs' tensors (fla_cu_seqlens, FLA's int64 copy of the offsets, is not used)."""
    import cula_core

    return cula_core.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                               cu_seqlens_cpu=cu_seqlens_cpu, **FLAGS)[0]


def fla_e2e(q, k, v, g, beta, A_log, dt_bias, cu_seqlens=None, cu_seqlens_cpu=None, fla_cu_seqlens=None):
    from fla.ops.kda import chunk_kda

    with torch.no_grad():
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=fla_cu_seqlens, **FLAGS)[0]


def stage_inputs(x):
    """Prepared inputs of the intra/w_u stages, for both: normalised q/k, G (ours: natural log, [TT, HV, K];
    FLA's: log2 units, [B, T, HV, K]), the chunk tables, and the Akk both stages take."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from cula_core.reference import l2norm, softplus_gate
    from cula_sm100.forward import launch

    B, T = x["q"].shape[:2]
    HV = x["v"].shape[2]
    q, k = (l2norm(x[n].float()).bfloat16() for n in ("q", "k"))
    gate = softplus_gate(x["g"], x["A_log"], x["dt_bias"]).contiguous()
    cu = x.get("cu_seqlens")
    ctab, _ = launch.tables(B, T, cu, x.get("cu_seqlens_cpu"), q.device)
    G = launch.gate_cumsum(gate.reshape(-1, HV, K), None, None, ctab, gate="precomputed", lower_bound=None)
    gk = chunk_local_cumsum(gate, chunk_size=64, scale=RCP_LN2, cu_seqlens=cu.long() if cu is not None else None)
    Aqk, Akk = launch.chunk_intra(q, k, G, x["beta"], ctab, scale=K ** -0.5, beta_activation="none")
    ctab, stab = launch.tables(B, T, cu, x.get("cu_seqlens_cpu"), q.device)
    w, u, kg = launch.recompute_w_u(k, x["v"], G, x["beta"], Akk, ctab, beta_activation="none")
    h, v_new, _ = launch.chunk_delta_h(w, u, kg, G, None, ctab, stab, output_final_state=False)
    qg = launch.chunk_intra_wu_gate(q, k, x["v"], x["g"].reshape(-1, HV, K), x["A_log"], x["dt_bias"], x["beta"],
                                    ctab, gate="softplus", lower_bound=None, scale=K ** -0.5, beta_activation="none",
                                    qg_out=True)[1]
    return dict(qg=qg, qraw=x["q"], kraw=x["k"],
                q=q, k=k, v=x["v"], beta=x["beta"], G=G, gk=gk, ctab=ctab, stab=stab, Akk=Akk, Aqk=Aqk, w=w, u=u,
                kg=kg, h=h, v_new=v_new, graw=x["g"].reshape(-1, HV, K), A_log=x["A_log"], dt_bias=x["dt_bias"],
                cu=cu.long() if cu is not None else None)


def kernel_fns(s):
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils.constant import RCP_LN2

    from cula_sm100.forward import launch

    scale = K ** -0.5
    B, T = s["q"].shape[:2]
    akk4 = s["Akk"].reshape(B, T, -1, 64)
    HV = akk4.shape[2]

    def fla4(x):  # ours [TT, HV, D] -> FLA's [B, T, HV, D] (same memory)
        return x.reshape(B, T, HV, -1)

    return {
        "intra": lambda: launch.chunk_intra(s["q"], s["k"], s["G"], s["beta"], s["ctab"], scale=scale,
                                            beta_activation="none"),
        "w_u": lambda: launch.recompute_w_u(s["k"], s["v"], s["G"], s["beta"], s["Akk"], s["ctab"],
                                            beta_activation="none"),
        "intra+w_u": lambda: launch.chunk_intra_wu(s["q"], s["k"], s["v"], s["G"], s["beta"], s["ctab"],
                                                   scale=scale, beta_activation="none"),
        "gate+intra+w_u": lambda: launch.chunk_intra_wu_gate(s["q"], s["k"], s["v"], s["graw"], s["A_log"],
                                                             s["dt_bias"], s["beta"], s["ctab"], gate="softplus",
                                                             lower_bound=None, scale=scale,
                                                             beta_activation="none", qg_out=True),
        "fwd_o[qg]": lambda: launch.fwd_o_qg(s["qg"], s["h"], s["Aqk"], s["v_new"], s["ctab"], scale=scale),
        "delta_h": lambda: launch.chunk_delta_h(s["w"], s["u"], s["kg"], s["G"], None, s["ctab"], s["stab"],
                                                output_final_state=False),
        "fwd_o": lambda: launch.fwd_o(s["q"], s["G"], s["h"], s["Aqk"], s["v_new"], s["ctab"], scale=scale),
        "gate": lambda: launch.gate_cumsum(s["graw"], s["A_log"], s["dt_bias"], s["ctab"], gate="softplus",
                                           lower_bound=None),
        "l2norm": lambda: launch.l2norm(s["q"]),
        "fla intra+w_u": lambda: chunk_kda_fwd_intra(q=s["q"], k=s["k"], v=s["v"], gk=s["gk"], beta=s["beta"],
                                                     scale=scale, cu_seqlens=s["cu"], chunk_size=64),
        "fla w_u": lambda: recompute_w_u_fwd(k=s["k"], v=s["v"], beta=s["beta"], A=akk4, gk=s["gk"],
                                             cu_seqlens=s["cu"]),
        # FLA's other stages, on our intermediates in its layout (values only feed the timing)
        "fla delta_h": lambda: chunk_gated_delta_rule_fwd_h(k=fla4(s["kg"]), w=fla4(s["w"]), u=fla4(s["u"]),
                                                            gk=s["gk"], cu_seqlens=s["cu"]),
        "fla fwd_o": lambda: chunk_gla_fwd_o_gk(q=s["q"], v=fla4(s["v_new"]), g=s["gk"], A=fla4(s["Aqk"]),
                                                h=s["h"].reshape(B, -1, HV, K, V), scale=scale, cu_seqlens=s["cu"]),
        "fla gate": lambda: kda_gate_chunk_cumsum(g=fla4(s["graw"]), A_log=s["A_log"], dt_bias=s["dt_bias"],
                                                  scale=RCP_LN2, chunk_size=64, cu_seqlens=s["cu"]),
        "fla l2norm": lambda: l2norm_fwd(s["q"]),
    }


def warm_one(HV, varlen):
    """One FLA forward per autotuning key (HV; fixed or varlen): compiles and autotunes its kernels into
    Triton's cache. Run in parallel processes by `warm_fla`."""
    x = make_inputs(1, sum(VARLEN), HV, varlen=True) if varlen else make_inputs(2, 4096, HV)
    fla_e2e(**x)
    torch.cuda.synchronize()


def warm_fla(shapes) -> None:
    """FLA's first call per autotuning key compiles ~a dozen configurations per kernel: minutes. Do it for every
    key in parallel processes (fla_tuning.compile_in_parallel, which drops the choices they made with the GPU
    shared), then compile cula's kernels."""
    import time

    t0 = time.perf_counter()
    keys = sorted({(s["HV"], bool(s.get("varlen"))) for s in shapes})
    seconds, bad = fla_tuning.compile_in_parallel("tools.bench.train_fwd", "warm_one", keys)
    x = make_inputs(1, 64, 64)
    cula_e2e(**x)  # compiles cula's kernels
    print(f"warm-up: {len(keys)} FLA processes in {seconds:.0f} s, then cula's compilation: "
          f"{time.perf_counter() - t0:.0f} s (failures: {bad})", flush=True)


SWEEP = [(1, 64), (2, 64), (2, 128), (4, 128), (2, 256)]  # FLA tunes per HV


def delta_h_sweep(timing):
    """chunk_delta_h at T = 8192 for (B, HV) in SWEEP, ours (N HV 4 CTAs of 128 threads, 4 per SM) both as clusters
    of the 4 V slices and as plain CTAs (the one launch.chunk_delta_h_cluster picks is marked) against FLA's: how
    the time grows with the number of CTAs (132 SMs x 4 = 528 run at once on an H100); w / u / kg random (the
    recurrence's cost does not depend on the values)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from cula_sm100.forward import launch

    def one(B, HV, T):
        gen = torch.Generator(device="cuda").manual_seed(B * HV)
        w, u, kg = (0.05 * torch.randn(B * T, HV, K, generator=gen, device="cuda").bfloat16() for _ in range(3))
        gate = -torch.rand(B, T, HV, K, generator=gen, device="cuda")
        G = chunk_local_cumsum(gate, chunk_size=64).reshape(B * T, HV, K).contiguous()
        gk = chunk_local_cumsum(gate, chunk_size=64, scale=RCP_LN2)
        ctab, stab = launch.tables(B, T, None, None, w.device)
        ours = {c: measure(lambda _, c=c: launch.chunk_delta_h(w, u, kg, G, None, ctab, stab, output_final_state=False,
                                                             cluster=c), [w], timing).median_ms for c in (True, False)}
        def fla_fwd_h(_=None):
            return chunk_gated_delta_rule_fwd_h(k=kg.reshape(B, T, HV, K), w=w.reshape(B, T, HV, K),
                                                u=u.reshape(B, T, HV, V), gk=gk)

        fla_tuning.retune()
        fla_fwd_h()  # tunes on this shape, untimed
        fla = measure(fla_fwd_h, [w], timing).median_ms
        live = launch.chunk_delta_h_cluster(B, HV)
        return [dict(kind=f"chunk_delta_h, {B * HV * 4} CTAs, {label}{' (dispatch)' if c == live else ''}", B=B, T=T,
                     HV=HV, cula_ms=ours[c], fla_ms=fla)
                for c, label in ((True, "clusters of 4"), (False, "no cluster"))]

    rows = []
    for B, HV in SWEEP:
        rows += one(B, HV, 8192)  # the tensors die with one()'s frame
        for r in rows[-2:]:
            print(r, flush=True)
        torch.cuda.empty_cache()
    return rows


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="three small shapes only (CI)")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    add_do_bench_args(ap)
    ap.add_argument("--kernels-only", action="store_true", help="only the per-kernel rows")
    ap.add_argument("--hv", type=str, help="only these HV (comma-separated), e.g. 64,128")
    ap.add_argument("--delta-h-sweep", action="store_true",
                    help="only chunk_delta_h (ours and FLA's) at T = 8192 over a range of CTA counts (B, HV)")
    ap.add_argument("--render", type=Path, help="only render a saved --json file as markdown (to --out)")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        text = render(saved["rows"], saved["env"])
        print(text)
        if args.out:
            args.out.write_text(text)
        return 0
    if not torch.cuda.is_available():
        print("train_fwd: no CUDA device", file=sys.stderr)
        return 1
    os.environ["CULA_BACKEND"] = "sm100"  # fail loudly rather than time the reference
    fla_tuning.prepare()  # before FLA is imported: no autotune choice from disk, FLA's own kernels
    timing = Timing(warmup=args.warmup, repeats=args.rep, method="auto")
    e2e, kshapes = (SMOKE_E2E, SMOKE_KERNELS) if args.smoke else (E2E, KERNEL_SHAPES)
    if args.kernels_only:
        e2e = []
    if args.hv:
        keep = {int(h) for h in args.hv.split(",")}
        e2e = [s for s in e2e if s["HV"] in keep]
        kshapes = [s for s in kshapes if s["HV"] in keep]
    rows = []
    env = environment("cuda")

    def save():
        if args.json:
            args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2, default=str))

    if args.delta_h_sweep:
        rows = delta_h_sweep(timing)
        save()
        print(render(rows, env))
        return 0
    warm_fla(e2e + kshapes)

    for s in e2e:
        x = make_inputs(**s)
        fla_tuning.retune()
        o_c, o_f = cula_e2e(**x), fla_e2e(**x)  # FLA's call tunes on this shape, untimed
        row = dict(kind="chunk_kda", **s, err=rel(o_c, o_f))
        del o_c
        row["cula_ms"] = measure(cula_e2e, [x], timing).median_ms
        row["fla_ms"] = measure(fla_e2e, [x], timing).median_ms
        rows.append(row)
        print(row, flush=True)
        del o_f
        save()
        del x
        torch.cuda.empty_cache()

    for s in kshapes:
        x = make_inputs(**s)
        st = stage_inputs(x)
        del x
        fns = kernel_fns(st)
        fla_tuning.retune()
        for name, fn in fns.items():
            if name.startswith("fla"):
                fn()  # tunes on this shape, untimed
        # the harness picks CUDA timing (do_bench) only when it sees a CUDA tensor among the inputs: hand it
        # one (the stage functions ignore it); with no tensor it would time the host alone, unsynchronised
        t = {name: measure(lambda _, fn=fn: fn(), [st["q"]], timing).median_ms for name, fn in fns.items()}
        base = dict(s)
        rows.append(dict(kind="chunk_intra (FLA: derived)", **base, cula_ms=t["intra"],
                         fla_ms=t["fla intra+w_u"] - t["fla w_u"]))
        rows.append(dict(kind="recompute_w_u", **base, cula_ms=t["w_u"], fla_ms=t["fla w_u"]))
        rows.append(dict(kind="chunk_intra_wu (the two fused; FLA: chunk_kda_fwd_intra)", **base,
                         cula_ms=t["intra+w_u"], fla_ms=t["fla intra+w_u"]))
        rows.append(dict(kind="chunk_intra_wu_gate, qg out (gate + the two fused; FLA: gate + chunk_kda_fwd_intra)",
                         **base, cula_ms=t["gate+intra+w_u"], fla_ms=t["fla gate"] + t["fla intra+w_u"]))
        rows.append(dict(kind="fwd_o from qg (FLA: chunk_gla_fwd_o_gk)", **base, cula_ms=t["fwd_o[qg]"],
                         fla_ms=t["fla fwd_o"]))
        live = ("l2norm", "l2norm", "gate+intra+w_u", "delta_h", "fwd_o[qg]")
        rows.append(dict(kind="sum of the forward's stages (l2norm twice)", **base, cula_ms=sum(t[x] for x in live),
                         fla_ms=2 * t["fla l2norm"] + t["fla gate"] + t["fla intra+w_u"] + t["fla delta_h"]
                         + t["fla fwd_o"]))
        for ours, theirs in (("delta_h", "chunk_delta_h"), ("fwd_o", "fwd_o"), ("gate", "gate + cumsum"),
                             ("l2norm", "l2norm (q)")):
            rows.append(dict(kind=theirs, **base, cula_ms=t[ours], fla_ms=t["fla " + ours.split("[")[0]]))
        for r in rows[-10:]:
            print(r, flush=True)
        print("stage ms:", {k_: round(v_, 3) for k_, v_ in t.items()}, flush=True)
        save()
        del st, fns
        torch.cuda.empty_cache()

    text = render(rows, env)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def render(rows, env) -> str:
    """The markdown table of the rows (also from a saved --json: `python -m tools.bench.train_fwd --render F`)."""
    head = ["op", "B", "T", "HQK", "HV", "varlen", "FLA ms", "cula ms", "speed-up", "o rel. diff vs FLA"]
    lines = [
        "# cula-sm100 chunk_kda training forward vs FLA 0.6.0",
        "",
        f"GPU: {env.get('gpu', '?')} (sm_{env.get('capability', '?').replace('.', '')}); torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, triton {env.get('triton', '?')}, "
        f"FLA {env.get('fla-core', env.get('flash-linear-attention', '?'))}, cula-sm100 {env.get('cula-sm100', '?')}.",
        "",
        "Command: `python -m tools.bench.train_fwd --out docs/benchmarks/train_fwd.md` (inputs, flags and timing: "
        "the module docstring). `speed-up` = FLA ms / cula ms.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    for r in rows:
        sp = r["fla_ms"] / r["cula_ms"] if r.get("fla_ms") and r.get("cula_ms") else None
        err = f"{r['err']:.1e}" if "err" in r else ""
        lines.append(f"| {r['kind']} | {r['B']} | {r['T']} | {HQK} | {r['HV']} | {'8 seqs' if r.get('varlen') else ''} "
                     f"| {r['fla_ms']:.3f} | {r['cula_ms']:.3f} | {sp:.2f}x | {err} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
