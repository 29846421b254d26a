"""First-call time of each public op in a fresh process: `import cula` plus the op's first call, synchronised.

    python -m tools.bench.first_call                      # table on stdout, docs/benchmarks/first_call.md
    python -m tools.bench.first_call --cache-dir /tmp/c   # a given CuTe DSL kernel cache (default: a new empty one)

Each op runs in its own subprocess that first imports torch and builds its inputs on the GPU (torch's import and
CUDA's initialisation are not ours), then times `import cula` and the first call until the GPU is done. With an
empty kernel cache and no ahead-of-time artifacts this is the JIT cost; with the wheel's artifacts (or a warm
cache: `--runs 2` times a second round on the same cache) it is the load cost. The table names the card.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One small call per op, on the configuration a KDA layer of Kimi Linear's shape uses (bf16, K = V = 128, in-kernel
# gate with A_log / dt_bias and q/k L2 norm).
_CHILD = r'''
import json, sys, time, torch
op = sys.argv[1]
dev, bf = "cuda", torch.bfloat16
H, K, B, T, N, P = 4, 128, 1, 256, 4, 8
torch.manual_seed(0)
def r(*s, dtype=bf, grad=False):
    return torch.randn(*s, device=dev, dtype=dtype).mul_(0.1).requires_grad_(grad)
gate = dict(A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H * K, device=dev), use_qk_l2norm_in_kernel=True)
if op in ("kda_prefill", "chunk_kda"):
    grad = op == "chunk_kda"
    args = [r(B, T, H, K, grad=grad) for _ in range(3)] + [r(B, T, H, K, grad=grad), r(B, T, H, grad=grad).sigmoid()]
else:
    t = 1 if op == "kda_decode" else 4
    args = [r(N, t, H, K) for _ in range(3)] + [r(N, t, H, K), r(N, t, H).sigmoid(),
            torch.zeros(P, H, K, K, device=dev), torch.arange(N, dtype=torch.int32, device=dev)]
torch.cuda.synchronize()
t0 = time.perf_counter()
import cula
t1 = time.perf_counter()
if op in ("kda_prefill", "chunk_kda"):
    out = getattr(cula, op)(*args, use_gate_in_kernel=True, **gate)
    if op == "chunk_kda":
        out[0].float().sum().backward()
elif op == "kda_decode_mtp_kvbuffer+flush":
    o, buf = cula.kda_decode_mtp_kvbuffer(*args, **gate)
    cula.kda_flush_kvbuffer(args[5], args[6], buf, 2)
else:
    getattr(cula, op)(*args, **gate)
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t2 - t1}))
'''

OPS = ("kda_prefill", "chunk_kda", "kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer+flush")


def run_op(op: str, cache_dir: str) -> dict:
    env = dict(os.environ, CULA_CACHE_DIR=cache_dir, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _CHILD, op], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", help="CuTe DSL kernel cache to use (default: a new empty folder)")
    ap.add_argument("--runs", type=int, default=2, help="rounds over the ops on the same cache (2: cold, then warm)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "first_call.md"))
    args = ap.parse_args(argv)
    import torch

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    cache = args.cache_dir or tempfile.mkdtemp(prefix="cula-first-call-")
    rows = []
    for rnd in range(args.runs):
        for op in OPS:
            res = run_op(op, cache)
            rows.append((rnd + 1, op, res))
            print(rnd + 1, op, res, flush=True)
    from cula_core import cute_runtime

    shipped = sum(a.origin == "shipped" for a in cute_runtime.listing())
    source = (f"the installed wheels ship {shipped} ahead-of-time kernels, so round 1 loads them (a kernel outside "
              "that set compiles just in time)" if shipped else
              "the installed wheels ship no ahead-of-time kernels, so round 1 is the JIT cost")
    lines = ["# First call of each public op in a fresh process", "",
             f"Card: {card}. `python -m tools.bench.first_call` (docstring: what is timed). Round 1 starts from an "
             f"empty kernel cache: {source}; round 2 reuses that cache (the load cost).", "",
             "| round | op | import cula (s) | first call (s) | total (s) |", "| --- | --- | --- | --- | --- |"]
    for rnd, op, res in rows:
        if "error" in res:
            lines.append(f"| {rnd} | {op} | error: {res['error']} | | |")
        else:
            lines.append(f"| {rnd} | {op} | {res['import_s']:.3f} | {res['first_call_s']:.3f} | "
                         f"{res['import_s'] + res['first_call_s']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
