"""Benchmark of the fused chunk_intra + recompute_w_u kernel (chunk_intra_wu.py, through launch.chunk_intra_wu)
against the two-kernel path it replaced (launch.chunk_intra, then launch.recompute_w_u), and of the raw-gate kernel
(chunk_intra_wu_gate.py, launch.chunk_intra_wu_gate: the forward's gate stage) against the two
launches it replaces (launch.gate_cumsum, then launch.chunk_intra_wu), in one run on the same inputs.

    python -m tools.bench.intra_wu [--smoke] [--json FILE] > docs/benchmarks/intra_wu.md

Shapes: B = 2, T = 8192, HQK = 64, HV in (64, 128, 256), and varlen (B = 1, 8 sequences, 16384 tokens, one of
length 1) at HV = 128: train_fwd.py's per-kernel shapes. Inputs as train_fwd.py prepares its stages: L2-normalised
bf16 q / k, the chunk-local cumsum G of the softplus gate (launch.gate_cumsum), bf16 v, bf16 beta in (0, 1); the
gate rows take the raw fp32 g with A_log and dt_bias (FLA's softplus gate) instead of G.
Timing: median of `triton.testing.do_bench` through tools/bench/harness.py, after warm-up (the harness's options:
--warmup / --repeats, in ms). The markdown table goes to stdout, per-shape progress to stderr. The table also says
whether the outputs agree: the largest distance of each in bf16 ulps (0: bitwise); for the gate rows also whether
G is bitwise equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.harness import environment, measure, parse_args  # noqa: E402

K = 128
VARLEN = [4096, 512, 3000, 1, 2048, 777, 4000, 1950]  # train_fwd.py's: 8 sequences, 16384 tokens
SHAPES = [dict(B=2, T=8192, HV=hv) for hv in (64, 128, 256)] + [dict(B=1, T=sum(VARLEN), HV=128, varlen=True)]
SMOKE = [dict(B=2, T=1024, HV=64)]


def stage_inputs(B, T, HV, varlen=False, HQK=64, seed=0):
    """The two paths' common inputs (train_fwd.make_inputs then its stage preparation, without FLA)."""
    from cula_core.reference import l2norm, softplus_gate
    from cula_sm100.forward import launch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q, k = (l2norm(r(B, T, HQK, K)).bfloat16() for _ in range(2))
    v = r(B, T, HV, K).bfloat16()
    beta = torch.sigmoid(r(B, T, HV)).bfloat16()
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1)
    g, dt_bias = r(B, T, HV, K), 0.1 * r(HV * K)
    gate = softplus_gate(g, A_log, dt_bias).contiguous()
    cu = cu_cpu = None
    if varlen:
        cu_cpu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu_cpu.cuda()
    ctab, _ = launch.tables(B, T, cu, cu_cpu, q.device)
    G = launch.gate_cumsum(gate.reshape(-1, HV, K), None, None, ctab, gate="precomputed", lower_bound=None)
    return dict(q=q, k=k, v=v, G=G, beta=beta, ctab=ctab), dict(g=g.reshape(-1, HV, K), A_log=A_log, dt_bias=dt_bias)


def gate_two_kernels(q, k, v, g, A_log, dt_bias, beta, ctab):
    from cula_sm100.forward import launch

    G = launch.gate_cumsum(g, A_log, dt_bias, ctab, gate="softplus", lower_bound=None)
    return (G, *launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=K ** -0.5, beta_activation="none"))


def gate_fused(q, k, v, g, A_log, dt_bias, beta, ctab):
    from cula_sm100.forward import launch

    return launch.chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, gate="softplus", lower_bound=None,
                                      scale=K ** -0.5, beta_activation="none")


def two_kernels(q, k, v, G, beta, ctab):
    from cula_sm100.forward import launch

    Aqk, Akk = launch.chunk_intra(q, k, G, beta, ctab, scale=K ** -0.5, beta_activation="none")
    return (Aqk, Akk, *launch.recompute_w_u(k, v, G, beta, Akk, ctab, beta_activation="none"))


def fused(q, k, v, G, beta, ctab):
    from cula_sm100.forward import launch

    return launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=K ** -0.5, beta_activation="none")


def max_ulps(a, b) -> int:
    def line(x):
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return int((line(a) - line(b)).abs().max()) if a.numel() else 0


def agreement(ours, two) -> str:
    names = ("Aqk", "Akk", "w", "u", "kg")
    parts = [f"{n} {max_ulps(a, b)}" for n, a, b in zip(names, ours, two, strict=True)]
    return "max ulps: " + ", ".join(parts)


def render(rows, env, command) -> str:
    lines = ["# chunk_intra + recompute_w_u: fused kernel vs the two kernels (cula-sm100)", "",
             f"Device: {env.get('gpu', '?')} (capability {env.get('capability', '?')}), torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}. Command: `{command}`. Median of triton.testing.do_bench after warm-up.", "",
             "| B | T | HQK | HV | varlen | two kernels ms | fused ms | speed-up | outputs (fused vs two kernels) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    gate = ["", "Raw gate (softplus, fp32 g, A_log, dt_bias): gate_cumsum + chunk_intra_wu vs chunk_intra_wu_gate.",
            "", "| B | T | HQK | HV | varlen | gate_cumsum + chunk_intra_wu ms | chunk_intra_wu_gate ms | speed-up "
            "| outputs (fused vs two kernels) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        shape = f"| {r['B']} | {r['T']} | 64 | {r['HV']} | {'8 seqs' if r.get('varlen') else ''} "
        lines.append(shape + f"| {r['two_ms']:.3f} | {r['fused_ms']:.3f} | {r['two_ms'] / r['fused_ms']:.2f}x "
                     f"| {r['agree']} |")
        gate.append(shape + f"| {r['gate_two_ms']:.3f} | {r['gate_fused_ms']:.3f} "
                    f"| {r['gate_two_ms'] / r['gate_fused_ms']:.2f}x | {r['gate_agree']} |")
    return "\n".join(lines + gate) + "\n"


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)  # the harness's options: --smoke, --warmup, --repeats, --json
    if not torch.cuda.is_available():
        print("intra_wu: no CUDA device", file=sys.stderr)
        return 1
    env = environment("cuda")
    rows = []
    for s in SMOKE if args.smoke else SHAPES:
        x, raw = stage_inputs(**s)
        row = dict(s, agree=agreement(fused(**x), two_kernels(**x)))
        # both timed on the same inputs, one after the other, each after its own warm-up
        row["two_ms"] = measure(two_kernels, [x], args.timing).median_ms
        row["fused_ms"] = measure(fused, [x], args.timing).median_ms
        xg = dict(raw, **{n: x[n] for n in ("q", "k", "v", "beta", "ctab")})
        ours, two = gate_fused(**xg), gate_two_kernels(**xg)
        row["gate_agree"] = f"G bitwise: {torch.equal(ours[0], two[0])}; " + agreement(ours[1:], two[1:])
        row["gate_two_ms"] = measure(gate_two_kernels, [xg], args.timing).median_ms
        row["gate_fused_ms"] = measure(gate_fused, [xg], args.timing).median_ms
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        del x, raw, xg, ours, two
        torch.cuda.empty_cache()
    command = " ".join(["python -m tools.bench.intra_wu", *(argv if argv is not None else sys.argv[1:])])
    print(render(rows, env, command))  # the markdown alone on stdout: redirect it to docs/benchmarks/intra_wu.md
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
