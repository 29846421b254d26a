"""chunk_bwd_intra_tc (the tensor-core intra-chunk backward) on odd shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/sm100/chunk_bwd_intra_tc_memcheck_case.py

Chunk lengths of every residue mod 16 (the kernel's row blocks: 1 .. 15, 16, 17, 31, 33, 63, 64, 65 and
130 = 64 + 64 + 2), n = 1, empty sequences, GVA 1 and 2, mild, strong (middle-row references and some exact
diagonals) and extreme decay (the exact diagonal path). The
output tensors are views of larger buffers whose tails must stay
bitwise untouched (checked here too: a write past the last token fails even without the sanitizer).

Also the shared pieces of the kernel's tests (tests/sm100/test_chunk_bwd_intra_tc_{cpu,gpu}.py): `problem` builds
the inputs as tests/sm100/test_backward_gpu.py's intra test does, `fla_stage` runs FLA 0.6.0's intra stage on
them (also timed by tools/bench/bwd_intra.py), and `intra_fp64` is the oracle: the docstring
math of chunk_bwd_intra.py evaluated directly in fp64 (per-pair exp(G_i - G_j), no factorisation), batched over
chunks. The CPU test checks it against torch_stages.intra (the CUDA-core kernel's oracle)."""

from __future__ import annotations

import math
import os
import sys

import torch

BT = 64


def problem(lengths, HQK, HV, decay, *, B=1, T=1000, seed=0, device="cuda", tail=0):
    """Inputs of the intra backward: (args, base, ctab, ch, scale). lengths None: B sequences of T tokens, else
    varlen. G is the chunk-local cumsum of logsigmoid(randn) / decay (decay 0.25: exp(G_i - G_j) down to ~e^-200
    in a chunk; 0.02: ~e^-2500), or with decay "safe" of -5 sigmoid(2 randn) (the safe gate at lower_bound = -5:
    at most 5 nats a token). base = (dq, dk, dbeta, dG) the kernel adds to: views of buffers `tail` rows
    longer (the tails are the untouched-memory check)."""
    import torch_stages
    from cula_sm100.forward import launch as fwd

    if lengths is not None:
        B, T = 1, sum(lengths)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_cpu = torch.tensor(cu, dtype=torch.int32)
        cu_dev = cu_cpu.to(device)
    else:
        cu_cpu = cu_dev = None
    TT = B * T
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    ctab, _ = fwd.tables(B, T, cu_dev, cu_cpu, device)
    ch = torch_stages.Chunks(torch_stages.bounds_of(B, T, cu_dev, cu_cpu), device)
    unit = torch.nn.functional.normalize
    q, k = (unit(r(TT, HQK, 128), dim=-1).bfloat16() for _ in range(2))
    if decay == "safe":  # the safe gate's range, lower_bound = -5: g = -5 sigmoid(2 randn) in (-5, 0)
        g = -5.0 * torch.sigmoid(2.0 * r(TT, HV, 128))
    else:
        g = torch.nn.functional.logsigmoid(r(TT, HV, 128)) / decay
    G = ch.unchunk(ch.chunk(g).cumsum(1)).contiguous()
    beta = torch.rand(TT, HV, generator=gen, device=device)
    tril = torch.ones(BT, BT, device=device).tril()
    # dAqk causal and dL strictly lower, as chunk_bwd_dav and chunk_wy_dqkg write them
    dA = ch.unchunk(r(ch.NC + 1, BT, HV, BT) * tril[None, :, None, :]).contiguous()
    dL = ch.unchunk(r(ch.NC + 1, BT, HV, BT) * tril.tril(-1)[None, :, None, :]).contiguous()
    base = [r(TT + tail, HQK, 128)[:TT], r(TT + tail, HQK, 128)[:TT], r(TT + tail, HV)[:TT],
            torch.zeros(TT + tail, HV, 128, device=device)[:TT]]
    return (q, k, G, beta, dA, dL), base, ctab, ch, 128 ** -0.5


def intra_fp64(q, k, G, beta, dA, dL, ch, *, scale, pairs=64):
    """The intra backward in fp64 from its definition: dq, dk [TT, HQK, K] (summed over each group), dbeta
    [TT, HV], dG [TT, HV, K] reverse-cumsummed within each chunk: the kernel's additions to zero bases.
    dA is masked to j <= i and dL to j < i here (the kernel masks them the same way)."""
    HQK, HV = q.shape[1], G.shape[1]
    grp = HV // HQK
    qc = ch.chunk(q).double().repeat_interleave(grp, dim=2)          # [C, 64, HV, K]
    kc = ch.chunk(k).double().repeat_interleave(grp, dim=2)
    Gc = ch.chunk(G, g_rows=True).double()
    bc = ch.chunk(beta.unsqueeze(-1)).double()[..., 0]                # [C, 64, HV]
    tril = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    dSc = ch.chunk(dA).double() * scale * tril[None, :, None, :]      # [C, i, HV, j]
    dLc = ch.chunk(dL).double() * tril.tril(-1)[None, :, None, :]
    C = qc.shape[0]
    step = max(1, pairs // HV)
    out = []
    for s in range(0, C, step):
        sl = slice(s, s + step)
        diff = Gc[sl, :, None] - Gc[sl, None, :]                          # [c, i, j, HV, K]
        E = torch.exp(torch.where(tril[None, :, :, None, None], diff, -torch.inf))
        dq = torch.einsum("cihj,cjhd,cijhd->cihd", dSc[sl], kc[sl], E)
        R = torch.einsum("cihj,cjhd,cijhd->cihd", dLc[sl], kc[sl], E)
        Cc = (torch.einsum("cihj,cihd,cijhd->cjhd", dSc[sl], qc[sl], E)
              + torch.einsum("cihj,cih,cihd,cijhd->cjhd", dLc[sl], bc[sl], kc[sl], E))
        b = bc[sl].unsqueeze(-1)
        dG = qc[sl] * dq + b * kc[sl] * R - kc[sl] * Cc
        out.append((dq, b * R + Cc, (kc[sl] * R).sum(-1), dG.flip(1).cumsum(1).flip(1)))
    dq, dk, db, dG = (torch.cat(t) for t in zip(*out, strict=True))
    TT = ch.TT
    return (ch.unchunk(dq).reshape(TT, HQK, grp, -1).sum(2), ch.unchunk(dk).reshape(TT, HQK, grp, -1).sum(2),
            ch.unchunk(db.unsqueeze(-1)).squeeze(-1), ch.unchunk(dG))


def fla_stage(args, base, B, lengths, scale):
    """FLA 0.6.0's intra stage on the same inputs, as its chunk_kda_bwd runs it: per-value-head dq / dk in and
    out ([B, T, HV, K]; the base dq / dk split evenly over the group), g in log2 units, dAqk with the scale in
    it, then the GVA sum and the reverse chunk cumsum of dg. Returns a callable giving (dq, dk, dbeta, dG) [B, T,
    ...] (bases included), the bench's timed unit and the GPU test's FLA comparison."""
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices

    q, k, G, beta, dA, dL = args
    H, HV = q.shape[1], G.shape[1]
    grp = HV // H

    def b(x):
        return x.reshape(B, -1, *x.shape[1:])

    cu = None
    idx = None
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.long)
        idx = prepare_chunk_indices(cu, 64)
    g2 = b(G / math.log(2))
    dq_v = b(base[0]).repeat_interleave(grp, dim=2) / grp
    dk_v = b(base[1]).repeat_interleave(grp, dim=2) / grp
    dAqk = b(dA * scale)
    bq, bk, bb, bA, bL, db_, dg_ = b(q), b(k), b(beta), dAqk, b(dL), b(base[2]), b(base[3])

    def run():
        dq, dk, db, dg = chunk_kda_bwd_intra(q=bq, k=bk, g=g2, beta=bb, dAqk=bA, dAkk=bL, dq=dq_v, dk=dk_v, db=db_,
                                             dg=dg_, cu_seqlens=cu, chunk_indices=idx, chunk_size=64)
        if grp > 1:
            dq = dq.view(*dq.shape[:2], H, grp, dq.shape[-1]).sum(dim=3)
            dk = dk.view(*dk.shape[:2], H, grp, dk.shape[-1]).sum(dim=3)
        return dq, dk, db, chunk_local_cumsum(dg, chunk_size=64, reverse=True, cu_seqlens=cu, chunk_indices=idx)

    return run


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cula_sm100.backward import launch

    tail = 64
    lengths = [1, 0, *range(2, 18), 31, 33, 63, 64, 0, 65, 130, 1]  # every residue mod 16, n = 1, empty sequences
    runs = 0
    for HQK, HV, decay in ((1, 1, 8.0), (1, 2, 0.02), (2, 2, 0.25)):
        args, base, ctab, _ch, scale = problem(lengths, HQK, HV, decay, seed=3, tail=tail)
        outs = [b.clone() for b in base]
        bufs = [torch.cat([o, torch.full((tail, *o.shape[1:]), 7.0, device="cuda")]) for o in outs]
        views = [b[:o.shape[0]] for b, o in zip(bufs, outs, strict=True)]
        launch.chunk_bwd_intra(*args, *views, ctab, scale=scale, tc=True)
        torch.cuda.synchronize()
        for name, b, o in zip(("dq", "dk", "dbeta", "dG"), bufs, outs, strict=True):
            assert torch.isfinite(b[:o.shape[0]]).all(), f"{name}: non-finite output"
            assert (b[o.shape[0]:] == 7.0).all(), f"{name}: written past the last token"
        runs += 1
    print(f"chunk_bwd_intra_tc memcheck case: {runs} launches done")


if __name__ == "__main__":
    main()
