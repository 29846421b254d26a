"""Sweep the streamed single-token decode's tiling on bf16 (or fp32) state pools: an experiment, not a tool.

    python experimental/stream_decode_sweep.py [--pool-dtype bf16|fp32] [--N 128] [--H 32 64]

Issue 21 asks bf16 pools at N = 128 to stream at 80% of the HBM bound; the dispatch's tiling reads 69-71% on the
H200 (docs/benchmarks/mtp_decode.md). The tiling is not an argument of any public op or launch function: it comes
from `cula_sm90.decode.configs.STREAM_TILINGS` / `STREAM_STAGES`, which this script overwrites in a child process
per candidate, each with its own kernel cache (`CULA_CACHE_DIR`): the cache keys do not contain the tiling. So
cula-sm90 must be installed from the tree (`pip install packages/cula-sm90`), not from a wheel with prebuilt kernels,
whose artifacts would be found first; the script refuses to run beside one.

Per candidate and cell: `kda_decode` (softplus gate and L2 norm in kernel, bf16 q/k/v/g/beta, K = V = 128,
HQK = HV = H, N requests on N slots) graph-timed as tools.bench.mtp_decode does (do_bench, 25 / 100 ms), the share of
the HBM bound (the pool read and written once; 4800 GB/s on an H200, 3352 on an H100), and the largest error of o and
of the pool against the reference backend on the same inputs (max |x - ref| / max |ref|).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (BV, VL, NW, stages) candidates by layout; the first of each is the dispatch's tiling for bf16 pools
CANDIDATES = {
    False: [(128, 4, 4, 2), (128, 8, 2, 2), (128, 8, 2, 3), (128, 16, 1, 2), (128, 4, 8, 2), (64, 8, 1, 3),
            (64, 4, 4, 3), (64, 8, 2, 4)],
    True: [(64, 4, 4, 2), (64, 4, 4, 4), (64, 2, 4, 2), (64, 4, 2, 3), (128, 4, 4, 2), (32, 4, 2, 4)],
}


def one(bv, vl, nw, stages, v_first, pool_name, N, heads):
    import torch

    sys.path.insert(0, str(ROOT))
    from cula_sm90.decode import configs
    from tools.bench import mtp_decode as md

    pool_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[pool_name]
    configs.STREAM_TILINGS[pool_dtype.itemsize, v_first] = (bv, vl, nw)
    configs.STREAM_STAGES[pool_dtype.itemsize] = stages
    bound = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.352e12
    md.POOL.update(dtype=pool_dtype, v_first=v_first)
    rows = []
    for H in heads:
        x = md.make_inputs(N, 1, H)
        pool0 = x["state_pool"].clone()
        os.environ["CULA_BACKEND"] = "reference"
        o_ref = md.cula_decode(x).float()
        pool_ref = x["state_pool"].float()
        x["state_pool"].copy_(pool0)
        os.environ["CULA_BACKEND"] = "sm90"
        o = md.cula_decode(x).float()
        err_o = float((o - o_ref).abs().max() / o_ref.abs().max())
        err_pool = float((x["state_pool"].float() - pool_ref).abs().max() / pool_ref.abs().max())
        ms = md.graph_ms(md.cula_decode, (x,), md.Timing(warmup=25, repeats=100, method="do_bench"))
        moved = 2 * N * H * 128 * 128 * pool_dtype.itemsize
        ctas = configs.stream_ctas_per_sm(128, pool_dtype.itemsize, v_first, stages, bv)
        rows.append(dict(tiling=[bv, vl, nw, stages], v_first=v_first, H=H, N=N, ms=ms,
                         hbm=moved / (ms * 1e-3) / bound, ctas_per_sm=ctas, err_o=err_o, err_pool=err_pool))
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--N", type=int, default=128)
    ap.add_argument("--H", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--one", type=int, nargs=5, metavar=("BV", "VL", "NW", "STAGES", "V_FIRST"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        bv, vl, nw, stages, v_first = a.one
        one(bv, vl, nw, stages, bool(v_first), a.pool_dtype, a.N, a.H)
        return 0
    import cula_sm90

    if (Path(cula_sm90.__file__).parent / "_aot").exists():
        print("cula-sm90 is installed with prebuilt kernels: install it from packages/cula-sm90 for this sweep")
        return 2
    print("| layout | BV x VL x NW, stages | CTAs/SM | H | ms | % of HBM | err o | err pool |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for v_first, candidates in CANDIDATES.items():
        for bv, vl, nw, stages in candidates:
            with tempfile.TemporaryDirectory() as cache:
                cmd = [sys.executable, __file__, "--pool-dtype", a.pool_dtype, "--N", str(a.N), "--H", *map(str, a.H),
                       "--one", str(bv), str(vl), str(nw), str(stages), str(int(v_first))]
                run = subprocess.run(cmd, env=dict(os.environ, CULA_CACHE_DIR=cache), capture_output=True, text=True)
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            if run.returncode or not lines:
                tail = (run.stderr.strip().splitlines() or ["?"])[-1]
                print(f"| {'V-first' if v_first else 'K-first'} | {bv} x {vl} x {nw}, {stages} | | | error: {tail} |")
                continue
            for r in json.loads(lines[0][len("RESULT "):]):
                print(f"| {'V-first' if v_first else 'K-first'} | {bv} x {vl} x {nw}, {stages} | {r['ctas_per_sm']} "
                      f"| {r['H']} | {r['ms']:.4f} | {100 * r['hbm']:.1f}% | {r['err_o']:.1e} | {r['err_pool']:.1e} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
