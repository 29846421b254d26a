"""Checks the cula-sm89 kernel source on the CPU: builds emu_main.cpp (the kernels under the host emulation of
emu_cuda.h), runs it on random inputs and compares o, the final state, w, u, Aqk and Akk with
cula_core.reference in fp64. A development aid for machines without a GPU (slow: each CUDA thread is a host
thread); the GPU tests in tests/sm89 are the real check.

    python packages/cula-sm89/emu/run_emu.py [--K 64] [--C 32] [--T 100] [--varlen] [--strong]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cula_core.reference import chunk_kda_reference, kda_gate, l2norm

HERE = Path(__file__).resolve().parent


def build(exe: Path) -> None:
    srcs = [HERE / "emu_main.cpp", HERE / "emu_cuda.h", *(HERE.parent / "csrc").glob("*")]
    if exe.exists() and exe.stat().st_mtime > max(s.stat().st_mtime for s in srcs):
        return
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", f"-I{HERE}", "-o", str(exe), str(HERE / "emu_main.cpp")],
                   check=True)


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(K=64, C=32, T=70, B=1, HQK=1, HV=2, varlen=False, strong=False, h0=True, tile=32,
          exe="/tmp/cula_sm89_emu"):
    """Runs the emulated kernels once; returns {name: relative error vs the fp64 reference}."""
    exe = Path(exe)
    build(exe)
    torch.manual_seed(0)
    cu = None
    if varlen:
        B = 1
        cu = torch.tensor([0, 5, 5, min(40, T), T], dtype=torch.int32)
    N = B if cu is None else len(cu) - 1
    q = l2norm(torch.randn(B, T, HQK, K))
    k = l2norm(torch.randn(B, T, HQK, K))
    v = torch.randn(B, T, HV, K)
    graw = torch.randn(B, T, HV, K)
    if strong:
        g = -torch.rand(B, T, HV, K) * 30  # up to -30 per token: spans far above 2^120 in 16 tokens
    else:
        g = kda_gate(graw, torch.randn(HV) * 0.5, torch.randn(HV * K)).float()
    beta = torch.sigmoid(torch.randn(B, T, HV))
    h0 = torch.randn(N, HV, K, K) if h0 else None
    scale = K ** -0.5
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for name, t in dict(q=q, k=k, v=v, g=g, beta=beta).items():
            t.contiguous().numpy().tofile(d / f"{name}.bin")
        if h0 is not None:
            h0.numpy().tofile(d / "h0.bin")
        if cu is not None:
            cu.float().numpy().tofile(d / "cu.bin")
        cfg = dict(B=B, T=T, HQK=HQK, HV=HV, K=K, C=C, N=N, varlen=int(cu is not None), h0=int(h0 is not None),
                   scale=scale, tile=tile)
        (d / "config.txt").write_text("".join(f"{kk} {vv}\n" for kk, vv in cfg.items()))
        subprocess.run([str(exe), str(d)], check=True)
        import numpy as np

        def out(name, shape):
            return torch.from_numpy(np.fromfile(d / f"{name}.out", dtype=np.float32)).reshape(shape)

        R = 1 if cu is not None else B
        slots = -(-T // C) + (N if cu is not None else 0)
        o = out("o", (B, T, HV, K))
        ht = out("ht", (N, HV, K, K))
        w = out("w", (R, HV, slots, C, K))
        u = out("u", (R, HV, slots, C, K))
        aqk = out("aqk", (R, HV, slots, C, C))
        akk = out("akk", (R, HV, slots, C, C))
    dd = torch.float64
    o_r, ht_r, inter = chunk_kda_reference(q.to(dd), k.to(dd), v.to(dd), g.to(dd), beta.to(dd), scale=scale,
                                           initial_state=None if h0 is None else h0.to(dd), output_final_state=True,
                                           cu_seqlens=cu, chunk_size=C, return_intermediates=True)
    errs = {"o": rel(o, o_r), "final_state": rel(ht, ht_r)}
    # our [R, HV, slot, C, D] buffers, gathered to the reference's token order [R, T, HV, D]
    starts = inter.chunk_token_start.tolist()
    bounds = cu.tolist() if cu is not None else [b * T for b in range(B + 1)]
    for name, ours, theirs in (("w", w, inter.w), ("u", u, inter.u), ("Aqk", aqk, inter.Aqk), ("Akk", akk, inter.Akk)):
        rows = []
        for r in range(R):
            for slot, t0 in enumerate(starts if cu is not None else range(0, T, C)):
                end = next(b for b in bounds if b > t0) if cu is not None else T
                n = min(C, end - t0)
                rows.append((ours[r, :, slot, :n].permute(1, 0, 2), theirs[r, t0:t0 + n]))
        errs[name] = rel(torch.cat([a for a, _ in rows]), torch.cat([b for _, b in rows]))
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--C", type=int, default=32)
    ap.add_argument("--T", type=int, default=70)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--HQK", type=int, default=1)
    ap.add_argument("--HV", type=int, default=2)
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--strong", action="store_true", help="decays strong enough for the pairwise diagonal path")
    ap.add_argument("--no-h0", action="store_true")
    ap.add_argument("--tile", type=int, default=32, choices=(16, 32), help="state columns per inter-chunk block")
    ap.add_argument("--exe", default="/tmp/cula_sm89_emu")
    a = ap.parse_args()
    errs = check(K=a.K, C=a.C, T=a.T, B=a.B, HQK=a.HQK, HV=a.HV, varlen=a.varlen, strong=a.strong, h0=not a.no_h0,
                 tile=a.tile, exe=a.exe)
    print(f"K={a.K} C={a.C} T={a.T} B={a.B} HQK={a.HQK} HV={a.HV} varlen={a.varlen} strong={a.strong} tile={a.tile}")
    for name, e in errs.items():
        print(f"  {name:12s} rel err {e:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
