"""chunk_bwd_intra: the backward of the intra-chunk decayed scores, one (chunk of 64, q/k head) per CTA, looping
over the value heads of the q/k head's group (native GVA: dq, dk summed in the kernel, as chunk_wy_dqkg).

The forward forms, per value head, with the decayed scores S(x)_ij = sum_d x_id k_jd exp(G_id - G_jd) (j <= i):

    Aqk = scale S(q)  (causal, diagonal included)        L = beta_i S(k)  (strictly lower)

Given dAqk (chunk_bwd_dav) and dL (chunk_wy_dqkg), with dSq = scale dAqk and E_ijd = exp(G_id - G_jd):

    dq_i  += sum_j dSq_ij k_j E_ij                    R_i = sum_{j<i} dL_ij k_j E_ij
    dk_i  += beta_i R_i + sum_{i' >= i} (dSq_i'i q_i' + beta_i' dL_i'i k_i') E_i'i      (the column side: C_i)
    dbeta_i += <k_i, R_i>
    dG_i  += q_i dq_i(this term) + beta_i k_i R_i - k_i C_i
(the G gradient: S depends on G only through G_i - G_j, so each score's row side gives x dx, its column side
-k dk). The results are ADDED to the dq, dk, dbeta, dG that chunk_wy_dqkg wrote (in place, fp32), each element
by the same thread every time: deterministic. dG, then complete, is replaced by its reverse chunk-local cumsum
(the gradient of the raw log decay: G is the chunk-local cumsum of it). FLA 0.6.0: `chunk_kda_bwd_intra` (and
the `chunk_local_cumsum(..., reverse=True)` after it).

Tiling: thread = channel d (128 threads = K); no tensor cores: each thread walks the chunk's pairs (i, j <= i)
in fp32 with exp(G_id - G_jd) <= 1 computed per pair (exact for any decay, no factorisation through a reference
row that could overflow). Rows are register-tiled by R = 4 (`rows`): per column j one load of G_j and k_j and one
read-modify-write of the thread's C_j serve 4 rows (their 4 contributions summed in registers), and the 4 rows
give 8 independent FMA chains (dq_i, R_i); dSq and dL are interleaved, one 8-byte broadcast load per (row,
column). Why: a loop over one row at a time issues 6 shared-memory accesses per pair and is bound by their issue;
this one issues 7 per 4 pairs (the measurements: docs/sm100_backward.md). Columns
0..i0 hold for the whole block (no masks); the up to 3 columns i0+1..i0+3 are a compile-time-masked triangle.
Row blocks run from last to first: column j takes contributions from rows i >= j only, so when block i0 has run
its own 4 columns are complete, and each row's dq, dk, dG is added to global memory once, the reverse cumsum of
dG running along (no second pass over dk, dG).
Tails (n not a multiple of 4, n = 1): the last block's padding rows get k = beta = dSq = dL = 0 and the last
valid row's G (every exp they meet is then <= 1), q from the last valid row (finite); they add exactly 0
to every column, and are never stored; no global row >= n is read.
Shared memory 98.5 KiB (two CTAs per SM): k (bf16), G, C (fp32) [64 x 128], the lower
triangle of (dSq, dL) (fp32 pairs, packed by rows); q is read per row from global memory (one use per row and
head), one row block ahead. Pipeline per value head: k (once) and G by cp.async (16 bytes a thread, every row in
flight), dAqk / dL 16 rows at a time (16 loads a thread in flight, branch-free stores) into the packed triangle,
one barrier, the blocked pair loop; each block loads the dq, dk, dG it adds to at its start and stores them at its
end. dbeta's sum over channels: warp shuffles, then the 4 warps' partials through shared memory. Assumes K = 128,
chunks that never cross a sequence.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows

_BT, _K = 64, 128
_TRI = _BT * (_BT + 1) // 2  # a packed lower triangle of 64 x 64


def _exp(x):
    return cute.math.exp(x, fastmath=True)


def _column(jj, r_lo: int, R: int, i0, base, d, sG, sK, sC, sAL, gi, qi, bki, aq, ak):
    """Column jj against the block's rows i0 + r, r_lo <= r < R (traced inline): one load of G_j, k_j and one
    read-modify-write of the thread's C_j for all of them; row i0 + r's (dSq, dL) pair is at base + r i0 +
    r (r + 1) / 2 + jj of the packed triangle (base = row i0's start)."""
    gj = sG[jj, d]
    kj = sK[jj, d].to(cutlass.Float32)
    cj = sC[jj, d]
    # compile-time loops over the rows: all the rows' exponentials and (dSq, dL) loads first, so the exp unit's
    # and shared memory's latencies overlap (written pair by pair, the SASS waits on each exp in turn)
    e = [_exp(gi[r] - gj) for r in range(r_lo, R)]  # per pair, <= 1: exact for any decay
    al = [(sAL[base + r * i0 + (r * (r + 1) // 2) + jj, 0], sAL[base + r * i0 + (r * (r + 1) // 2) + jj, 1])
          for r in range(r_lo, R)]
    for x in range(R - r_lo):  # R independent chains per accumulator
        r = r_lo + x
        a = al[x][0] * e[x]
        lv = al[x][1] * e[x]
        aq[r] += a * kj
        ak[r] += lv * kj
        cj += a * qi[r]  # two FMAs (not a product sum then an add: one instruction less per pair)
        cj += lv * bki[r]
    sC[jj, d] = cj


class ChunkBwdIntra:
    threads = _K  # thread = channel
    rows = 4  # rows per register block: per column, one sG / sK load and one sC read-modify-write for 4 rows

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, G_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 dA_ptr: cute.Pointer, dL_ptr: cute.Pointer, dq_ptr: cute.Pointer, dk_ptr: cute.Pointer,
                 db_ptr: cute.Pointer, dg_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        qk = cute.make_layout((TT, HQK, _K), stride=(HQK * _K, _K, 1))
        hv_k = cute.make_layout((TT, HV, _K), stride=(HV * _K, _K, 1))
        hv_a = cute.make_layout((TT, HV, _BT), stride=(HV * _BT, _BT, 1))
        hv_1 = cute.make_layout((TT, HV, 1), stride=(HV, 1, 1))
        self.kernel(cute.make_tensor(q_ptr, qk), cute.make_tensor(k_ptr, qk), cute.make_tensor(G_ptr, hv_k),
                    cute.make_tensor(beta_ptr, hv_1), cute.make_tensor(dA_ptr, hv_a), cute.make_tensor(dL_ptr, hv_a),
                    cute.make_tensor(dq_ptr, qk), cute.make_tensor(dk_ptr, qk), cute.make_tensor(db_ptr, hv_1),
                    cute.make_tensor(dg_ptr, hv_k),
                    cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1))),
                    HV // HQK, scale).launch(grid=[NC, HQK, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mDA: cute.Tensor,
               mDL: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDb: cute.Tensor, mDg: cute.Tensor,
               mT: cute.Tensor, group: cutlass.Int32, scale: cutlass.Float32):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        R = self.rows  # rows per register block (compile-time: the unrolled row loops)
        d, _, _ = cute.arch.thread_idx()
        c, hq, _ = cute.arch.block_idx()
        warp = d // 32
        t0 = mT[c, 0]
        n = mT[c, 1]
        nr = (n + R - 1) // R * R  # rows padded to whole row blocks (<= 64: 64 is a multiple of R)

        smem = cutlass.utils.SmemAllocator()
        sK = smem.allocate_tensor(bf16, cute.make_layout((_BT, _K), stride=(_K, 1)), 16)
        sG = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_K, 1)), 16)
        sC = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_K, 1)), 16)
        # (dSq, dL) interleaved: one 8-byte broadcast per (row, column); lower triangle only, packed by rows
        # (row i at i (i + 1) / 2): 16 KB less than two squares, which keeps two CTAs per SM
        # + a spare slot per thread (the target of its stores off the triangle: no two threads share one)
        sAL = smem.allocate_tensor(f32, cute.make_layout((_TRI + _K, 2), stride=(2, 1)), 16)
        sBeta = smem.allocate_tensor(f32, cute.make_layout((_BT,)), 16)
        sPart = smem.allocate_tensor(f32, cute.make_layout((_BT, 4), stride=(4, 1)), 16)

        gi = cute.make_rmem_tensor((R,), f32)
        qi = cute.make_rmem_tensor((R,), f32)
        ki = cute.make_rmem_tensor((R,), f32)
        bti = cute.make_rmem_tensor((R,), f32)
        bki = cute.make_rmem_tensor((R,), f32)
        aq = cute.make_rmem_tensor((R,), f32)
        ak = cute.make_rmem_tensor((R,), f32)
        qn = cute.make_rmem_tensor((R,), f32)  # q of the next row block (prefetched)
        oq = cute.make_rmem_tensor((R,), f32)  # dq, dk, dG of the block's rows before this kernel's addition
        ok = cute.make_rmem_tensor((R,), f32)
        og = cute.make_rmem_tensor((R,), f32)
        fa = cute.make_rmem_tensor((8,), f32)  # dAqk, dL of 8 load steps
        fl = cute.make_rmem_tensor((8,), f32)

        tQ = head_rows(mQ, t0, hq, _BT)
        tDq = head_rows(mDq, t0, hq, _BT)
        tDk = head_rows(mDk, t0, hq, _BT)
        # k and (per value head) G by cp.async, 16 bytes a thread, all rows in flight at once (the one-row kernel's
        # 4-byte loads, 4 in flight, left the load phase latency-bound); rows >= n are zero-filled, never read
        cp_k = g2s_tiled_copy(_K, self.threads)
        cp_g = g2s_tiled_copy(_K, self.threads, f32)
        copy_rows_g2s(cp_k, head_rows(mK, t0, hq, _BT), sK, n, d)  # padding rows: k = 0 (no contribution)

        for j in cutlass.range(group, unroll=1):
            hv = hq * group + j
            cute.arch.sync_threads()  # the previous value head's readers of sG, sAL, sC, sBeta are done
            tA = head_rows(mDA, t0, hv, _BT)
            tL = head_rows(mDL, t0, hv, _BT)
            tDg = head_rows(mDg, t0, hv, _BT)
            copy_rows_g2s(cp_g, head_rows(mG, t0, hv, _BT), sG, n, d)
            cute.arch.cp_async_commit_group()
            for r in cutlass.range(nr, unroll=4):
                sC[r, d] = f32(0.0)
            # dAqk and dL: two rows of 64 per step, the lower triangle kept; dSq = scale dAqk; padding rows 0
            # (with k = beta = 0 there, a padding row adds exactly 0 to every column sum). 16 rows at a time: the
            # 8 steps' loads first, unconditional (a padding row reads row n - 1: in bounds), then stores with no
            # branch (an element off the triangle goes to the thread's spare slot _TRI + d), so the compiler
            # cannot sink the loads into the stores' branches: 16 loads a thread in flight (with branches: 2)
            col = d % _BT
            for r16 in cutlass.range(0, nr, 16, unroll=1):
                for s in cutlass.range_constexpr(8):
                    rs = cutlass.min(r16 + 2 * s + d // _BT, n - 1)
                    fa[s] = tA[rs, col]
                    fl[s] = tL[rs, col]
                for s in cutlass.range_constexpr(8):
                    r = r16 + 2 * s + d // _BT
                    slot = cutlass.select_(col <= r, r * (r + 1) // 2 + col, _TRI + d)
                    slot = cutlass.select_(r < nr, slot, _TRI + d)
                    sAL[slot, 0] = cutlass.select_(r < n, fa[s] * scale, f32(0.0))
                    sAL[slot, 1] = cutlass.select_(r < n, fl[s], f32(0.0))
            if d < nr:
                if d < n:
                    sBeta[d] = head_rows(mBeta, t0, hv, _BT)[d, 0].to(f32)
                else:
                    sBeta[d] = f32(0.0)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            # padding rows take the last row's G (thread-private column from here on: no barrier needed): every
            # exp(G_i - G_j) they meet is then <= 1, finite
            for r in cutlass.range(n, nr, unroll=1):
                sG[r, d] = sG[n - 1, d]

            # row blocks from last to first: column j takes contributions from rows i >= j only, so once block
            # i0 has run, its own R columns are complete: each row's dq, dk, dG is then final for this value
            # head, written once, and dG's reverse chunk-local cumsum (the gradient of the raw log decay, from
            # that of G = its cumsum) runs along in the same pass (no second pass over dk, dG in global memory)
            run = f32(0.0)
            # q from global memory (one use per row and head: not staged), one block ahead, so its latency hides
            # behind a block's pair loop; a padding row reads the last row (finite; its dSq is 0): never past
            # the chunk. Rows clamped to [0, n - 1] (the chunk table has no empty chunk; guarded all the same)
            if n > 0:
                for r in cutlass.range_constexpr(R):
                    qn[r] = tQ[cutlass.max(cutlass.min(nr - R + r, n - 1), 0), d].to(f32)
            for b in cutlass.range(nr // R, unroll=1):
                i0 = nr - R - b * R
                for r in cutlass.range_constexpr(R):
                    i = i0 + r
                    rs = cutlass.min(i, n - 1)
                    gi[r] = sG[i, d]
                    qi[r] = qn[r]
                    qn[r] = tQ[cutlass.min(cutlass.max(i - R, 0), n - 1), d].to(f32)  # the next block's
                    # what this row adds to, loaded now (read back after the pair loop, latency hidden)
                    oq[r] = tDq[rs, d]
                    ok[r] = tDk[rs, d]
                    og[r] = tDg[rs, d]
                    ki[r] = sK[i, d].to(f32)
                    bti[r] = sBeta[i]
                    bki[r] = bti[r] * ki[r]
                    aq[r] = f32(0.0)
                    ak[r] = f32(0.0)
                base = i0 * (i0 + 1) // 2  # row i0 of the packed triangle; row i0 + r is at base + r i0 + r(r+1)/2
                # columns 0..i0: on or below the diagonal for all R rows (no masks). Per column: sG, sK and the
                # read-modify-write of sC once for R rows; 2 R independent FMA chains (aq, ak)
                for jj in cutlass.range(i0 + 1, unroll=4):
                    _column(jj, 0, R, i0, base, d, sG, sK, sC, sAL, gi, qi, bki, aq, ak)
                # columns i0 + 1 .. i0 + R - 1: only rows i0 + r with r >= m reach column i0 + m (compile-time mask)
                for m in cutlass.range_constexpr(1, R):
                    _column(i0 + m, m, R, i0, base, d, sG, sK, sC, sAL, gi, qi, bki, aq, ak)
                # the block's rows, last to first: row side and column side (C_i, thread-private: no barrier)
                for rr in cutlass.range_constexpr(R):
                    r = R - 1 - rr
                    i = i0 + r
                    dkr = bti[r] * ak[r]
                    cc = sC[i, d]
                    pb = ki[r] * ak[r]  # dbeta_i: sum over channels of k_i R_i
                    for s in cutlass.range_constexpr(5):
                        pb += cute.arch.shuffle_sync_bfly(pb, 1 << s)
                    if i < n:  # padding rows are never stored
                        tDq[i, d] = oq[r] + aq[r]
                        tDk[i, d] = (ok[r] + dkr) + cc
                        run += (og[r] + qi[r] * aq[r] + ki[r] * dkr) - ki[r] * cc
                        tDg[i, d] = run
                        if d % 32 == 0:
                            sPart[i, warp] = pb
            cute.arch.sync_threads()  # sPart complete
            if d < n:
                tDb = head_rows(mDb, t0, hv, _BT)
                tDb[d, 0] = tDb[d, 0] + ((sPart[d, 0] + sPart[d, 1]) + (sPart[d, 2] + sPart[d, 3]))
