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
    ap.add_argument("--exe", default="/tmp/cula_sm89_emu")
    a = ap.parse_args()
    exe = Path(a.exe)
    build(exe)
    torch.manual_seed(0)
    B, T, HQK, HV, K, C = a.B, a.T, a.HQK, a.HV, a.K, a.C
    cu = None
    if a.varlen:
        B = 1
        cu = torch.tensor([0, 5, 5, 40, T], dtype=torch.int32)
    N = B if cu is None else len(cu) - 1
    q = l2norm(torch.randn(B, T, HQK, K))
    k = l2norm(torch.randn(B, T, HQK, K))
    v = torch.randn(B, T, HV, K)
    graw = torch.randn(B, T, HV, K)
    if a.strong:
        g = -torch.rand(B, T, HV, K) * 30  # up to -30 per token: spans far above 2^120 in 16 tokens
    else:
        g = kda_gate(graw, torch.randn(HV) * 0.5, torch.randn(HV * K)).float()
    beta = torch.sigmoid(torch.randn(B, T, HV))
    h0 = None if a.no_h0 else torch.randn(N, HV, K, K)
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
                   scale=scale)
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
    print(f"K={K} C={C} T={T} B={B} HQK={HQK} HV={HV} varlen={cu is not None} strong={a.strong}")
    print(f"  o  rel err {rel(o, o_r):.3e}   final state {rel(ht, ht_r):.3e}")

    def tokens(x):  # [R, HV, slots, C, D] -> [R, slots * C, HV, D], in the reference's token order
        R_, H_, S_, C_, D_ = x.shape
        return x.permute(0, 2, 3, 1, 4).reshape(R_, S_ * C_, H_, D_)

    if cu is None:
        for name, ours, theirs in (("w", w, inter.w), ("u", u, inter.u), ("Aqk", aqk, inter.Aqk),
                                   ("Akk", akk, inter.Akk)):
            print(f"  {name:3s} rel err {rel(tokens(ours)[:, :T], theirs):.3e}")
    else:
        starts = inter.chunk_token_start.tolist()
        for name, ours, theirs in (("w", w, inter.w), ("u", u, inter.u), ("Aqk", aqk, inter.Aqk),
                                   ("Akk", akk, inter.Akk)):
            errs = []
            for slot, t0 in enumerate(starts):
                n = min(C, T - t0)
                bound = [int(x) for x in cu.tolist()]
                end = next(b for b in bound if b > t0)
                n = min(n, end - t0)
                errs.append(rel(ours[0, :, slot, :n].permute(1, 0, 2), theirs[0, t0:t0 + n]))
            print(f"  {name:3s} max rel err over chunks {max(errs):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
