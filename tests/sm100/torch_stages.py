"""PyTorch forms of the sm100 backward's stages (fp32, on the tensors' device): the oracles the kernels' tests compare
against, and the stand-ins with which the CPU test runs the live pipeline (launch.chunk_kda_backward).

  dav     dAqk = do @ v_new^T (causal), dv = Aqk^T @ do                         (kernel: chunk_bwd_dav)
  dhu     reverse state recurrence over each sequence's chunks: dh, dv += kg dh, dh0  (kernel: chunk_bwd_dhu)
  intra   backward of Aqk = scale S(q, k, G) and L = beta S(k, k, G) (strict): a vector-Jacobian product
          through the reference's own decayed-score routine (`cula_core.reference.chunk`), in slices of chunks
          (kernels: chunk_bwd_intra_tc, chunk_bwd_intra)
  finish  reverse chunk-local cumsum of dG; L2 norm, gate and beta activation backward by a vector-Jacobian
          product through `cula_core.reference` (dA_log, ddt_bias)                 (kernels: gate_bwd, l2norm_bwd)
Everything is batched over chunks and heads: tokens are gathered into chunks with index tables built once per set
of sequence bounds on the host.
"""

from __future__ import annotations

import functools
import itertools

import torch

from cula_core import reference as ref
from cula_core.reference.chunk import decayed_scores

BT = 64
BC = 16
# pairwise-decay elements held at once by the intra stage (its autograd keeps a few such tensors)
_INTRA_BUDGET = 1 << 25


@functools.lru_cache(maxsize=32)
def _host_tables(bounds: tuple[int, ...]):
    rows, rows_g, steps = [], [], []
    seq_chunks = []
    nc = 0
    for b0, b1 in itertools.pairwise(bounds):
        ids = []
        for t in range(b0, b1, BT):
            n = min(BT, b1 - t)
            rows.append([t + r if r < n else -1 for r in range(BT)])
            rows_g.append([t + min(r, n - 1) for r in range(BT)])  # G past the end repeats the last row
            ids.append(nc)
            nc += 1
        seq_chunks.append(ids)
    most = max([len(s) for s in seq_chunks] + [0])
    for s in range(most):  # step s of the reverse recurrence: each sequence's s-th chunk from its end
        steps.append([ids[len(ids) - 1 - s] if s < len(ids) else -1 for ids in seq_chunks])
    return rows, rows_g, steps, nc


class Chunks:
    """Gather / scatter between packed tokens [TT, H, D] and chunks [NC + 1, 64, H, D] (the extra chunk is
    all zeros: the target of absent rows and of sequences with no chunk at a recurrence step)."""

    def __init__(self, bounds: tuple[int, ...], device):
        rows, rows_g, steps, nc = _host_tables(tuple(bounds))
        TT = bounds[-1]
        self.TT, self.NC, self.N = TT, nc, len(bounds) - 1
        idx = torch.tensor([*rows, [-1] * BT], dtype=torch.long).reshape(-1, BT)
        self.mask = (idx >= 0).to(device)                                       # [NC + 1, 64]
        self.idx = torch.where(idx >= 0, idx, TT).to(device)
        self.idx_g = torch.tensor([*rows_g, [TT] * BT], dtype=torch.long).reshape(-1, BT).to(device)
        self.token_pos = torch.nonzero(idx.reshape(-1) >= 0).squeeze(1).to(device)  # [TT]: chunk rows in order
        st = torch.tensor(steps, dtype=torch.long).reshape(len(steps), self.N)
        self.steps = torch.where(st >= 0, st, nc).to(device)                    # [S, N]
        self.step_valid = (st >= 0).to(device)

    def chunk(self, x, *, g_rows=False):
        """[TT, H, D] -> [NC + 1, 64, H, D]; absent rows zero (or, with g_rows, the chunk's last G)."""
        pad = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return pad[self.idx_g if g_rows else self.idx]

    def unchunk(self, xc):
        """[NC + 1, 64, H, D] -> [TT, H, D]."""
        return xc.reshape(-1, *xc.shape[2:])[self.token_pos]


@functools.lru_cache(maxsize=32)
def chunks_for(bounds: tuple[int, ...], device) -> Chunks:
    """Chunks per (sequence bounds, device), cached: a training step re-uses its shapes, so the index tables
    are built and copied to the device once (no host-to-device copy on the hot path)."""
    return Chunks(bounds, device)


def bounds_of(B: int, T: int, cu_seqlens, cu_seqlens_cpu) -> tuple[int, ...]:
    if cu_seqlens is None:
        return tuple(b * T for b in range(B + 1))
    src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    return tuple(int(x) for x in src.tolist())


def dav(do, Aqk, v_new, ch: Chunks):
    """dAqk [NC+1, HV, 64, 64] fp32 (causal incl. diagonal) and dv [NC+1, 64, HV, V] fp32 from the output o."""
    doc = ch.chunk(do).float()
    dA = torch.einsum("cihv,cjhv->chij", doc, ch.chunk(v_new).float())
    dA = dA * torch.ones(BT, BT, dtype=torch.bool, device=do.device).tril()
    A = ch.chunk(Aqk).float()                                                   # [C, i, HV, j]
    dv = torch.einsum("cihj,cihv->cjhv", A, doc)
    return dA, dv


def dhu(qg, kg, w, G, do, dv, dht, ch: Chunks, *, scale, want_dh0):
    """Reverse state recurrence. qg = q exp(G) [TT, HV, K] (unscaled); kg, w [TT, HV, K]; dv [NC+1, 64, HV, V]
    (gradient of v_new through o). Returns dh [NC, HV, K, V] fp32 (gradient of each chunk's END state),
    dh0 [N, HV, K, V] fp32 or None, and dv [TT, HV, V] fp32 (total gradient of v_new)."""
    qgc, kgc, wc = ch.chunk(qg).float(), ch.chunk(kg).float(), ch.chunk(w).float()
    Gl = ch.chunk(G, g_rows=True)[:, -1].float()                                # [NC+1, HV, K]
    doc = ch.chunk(do).float()
    HV, K, V = kg.shape[1], kg.shape[2], do.shape[2]
    dhs = torch.zeros(ch.NC + 1, HV, K, V, device=do.device, dtype=torch.float32)
    b = dht.float().clone() if dht is not None else torch.zeros(ch.N, HV, K, V, device=do.device)
    dv = dv.clone()
    for s in range(ch.steps.shape[0]):
        c = ch.steps[s]
        ok = ch.step_valid[s].view(-1, 1, 1, 1)
        dhs[c] = b
        dvt = dv[c] + torch.einsum("nthk,nhkv->nthv", kgc[c], b)
        dv[c] = dvt
        nb = (torch.exp(Gl[c]).unsqueeze(-1) * b + scale * torch.einsum("nthk,nthv->nhkv", qgc[c], doc[c])
              - torch.einsum("nthk,nthv->nhkv", wc[c], dvt))
        b = torch.where(ok, nb, b)
    return dhs[:ch.NC], (b if want_dh0 else None), ch.unchunk(dv)


def intra(q, k, G, beta, dAqk, dL, ch: Chunks, *, scale):
    """Backward of Aqk = scale S(q, k) and L = beta_i S(k, k) (strictly lower), S the decayed scores.
    q, k [TT, HQK, K]; G [TT, HV, K]; beta [TT, HV] (activated); dAqk [NC+1, HV, 64, 64]; dL [TT, HV, 64].
    Returns dq, dk [TT, HQK, K] (summed over each group), dbeta [TT, HV], dG [TT, HV, K], all fp32."""
    HQK, HV = q.shape[1], G.shape[1]
    grp = HV // HQK

    def heads(x):  # [C, 64, H, D] -> [C, HV, 64, D]
        return x.repeat_interleave(grp, dim=2).permute(0, 2, 1, 3).float()

    qc, kc = heads(ch.chunk(q)), heads(ch.chunk(k))
    Gc = ch.chunk(G, g_rows=True).permute(0, 2, 1, 3).float()
    bc = ch.chunk(beta.unsqueeze(-1)).squeeze(-1).permute(0, 2, 1).float()     # [C, HV, 64]
    dLc = ch.chunk(dL).permute(0, 2, 1, 3).float()                             # [C, HV, i, j]
    strict = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril(-1)

    def scores(qx, kx, Gx, bx):
        Sq, Sk = decayed_scores((qx, kx), kx, Gx, BC)
        return scale * Sq, bx.unsqueeze(-1) * Sk * strict

    C = qc.shape[0]
    step = max(1, _INTRA_BUDGET // max(1, HV * BT * BC * q.shape[-1]))
    outs = []
    for s in range(0, C, step):
        sl = slice(s, s + step)
        _, vjp = torch.func.vjp(scores, qc[sl], kc[sl], Gc[sl], bc[sl])
        outs.append(vjp((dAqk[sl].float(), dLc[sl])))
    dq, dk, dG, db = (torch.cat(t) for t in zip(*outs, strict=True))

    def tokens(x):  # [C, HV, 64, D] -> [TT, HV, D]
        return ch.unchunk(x.permute(0, 2, 1, 3))

    TT = ch.TT
    dq = tokens(dq).reshape(TT, HQK, grp, -1).sum(2)
    dk = tokens(dk).reshape(TT, HQK, grp, -1).sum(2)
    return dq, dk, tokens(db.unsqueeze(-1)).squeeze(-1), tokens(dG)


def reverse_cumsum(dG, ch: Chunks):
    """Gradient of the raw log decay from that of its chunk-local cumsum: suffix sums within each chunk."""
    x = ch.chunk(dG)
    return ch.unchunk(x.flip(1).cumsum(1).flip(1))


def finish(dq, dk, dv, dbeta, dG, dh0, q, k, g, beta, A_log, dt_bias, initial_state, ch: Chunks, *, v_dtype,
           use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, summed=False):
    """From gradients of (normalised q/k [TT, HQK, K], v [TT, HV, V], activated beta [TT, HV], G, h0) to the
    op's gradients of its raw inputs, in their shapes and dtypes (None for absent inputs). With `summed`, dG
    is already the gradient of the raw log decay (chunk_bwd_intra ran the reverse cumsum)."""
    B, T, HQK, K = q.shape
    HV = g.shape[2]
    dld = (dG if summed else reverse_cumsum(dG, ch)).reshape(B, T, HV, K)
    raw = (q, k, g, beta, A_log, dt_bias)
    where = [i for i, t in enumerate(raw) if t is not None]

    def prep(*present):
        a = list(raw)
        for i, t in zip(where, present, strict=True):
            a[i] = t.float()
        qq, kk, gg, bb, al, db_ = a
        if use_qk_l2norm_in_kernel:
            qq, kk = ref.l2norm(qq), ref.l2norm(kk)
        ld = ref.log_decay(gg, al, db_, gate, lower_bound)
        return qq, kk, ld.float(), ref.activate_beta(bb, beta_activation)

    _, vjp = torch.func.vjp(prep, *(raw[i].float() for i in where))
    cot = (dq.reshape(B, T, HQK, K), dk.reshape(B, T, HQK, K), dld, dbeta.reshape(B, T, HV))
    grads = iter(vjp(cot))
    out = [next(grads).to(t.dtype) if t is not None else None for t in raw]
    dqo, dko, dgo, dbo, dAo, dto = out
    dvo = dv.reshape(B, T, HV, dv.shape[-1]).to(v_dtype)
    dh0o = dh0.to(initial_state.dtype) if initial_state is not None and dh0 is not None else None
    return dqo, dko, dvo, dgo, dbo, dAo, dto, dh0o
