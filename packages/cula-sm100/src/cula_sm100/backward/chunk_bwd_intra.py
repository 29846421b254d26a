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
in fp32 with exp(G_id - G_jd) <= 1 (exact for any decay, no factorisation through a reference row that could
overflow). The row sums (dq, R) are registers; the column sums C_j go through a thread-private fp32 column of
shared memory. Shared memory ~98 KB (two CTAs per SM): k (bf16), G, C (fp32) [64 x 128], the lower triangles
of dAqk and dL (fp32, packed by rows); q is read per row from global memory (one use per row and head).
Pipeline per value head: plain coalesced loads (one row of 128 channels per step) into shared memory, one
barrier, the pair loop, the column-side stores. dbeta's sum over channels: warp shuffles, then the 4 warps'
partials through shared memory. Assumes K = 128, chunks that never cross a sequence.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import head_rows

_BT, _K = 64, 128
_TRI = _BT * (_BT + 1) // 2  # a packed lower triangle of 64 x 64


def _exp(x):
    return cute.math.exp(x, fastmath=True)


class ChunkBwdIntra:
    threads = _K  # thread = channel

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
        d, _, _ = cute.arch.thread_idx()
        c, hq, _ = cute.arch.block_idx()
        warp = d // 32
        t0 = mT[c, 0]
        n = mT[c, 1]

        smem = cutlass.utils.SmemAllocator()
        sK = smem.allocate_tensor(bf16, cute.make_layout((_BT, _K), stride=(_K, 1)), 16)
        sG = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_K, 1)), 16)
        sC = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_K, 1)), 16)
        # dSq and dL: lower triangles only, packed by rows (row i at i (i + 1) / 2): 16 KB less, 2 CTAs per SM
        sA = smem.allocate_tensor(f32, cute.make_layout((_TRI,)), 16)
        sL = smem.allocate_tensor(f32, cute.make_layout((_TRI,)), 16)
        sBeta = smem.allocate_tensor(f32, cute.make_layout((_BT,)), 16)
        sPart = smem.allocate_tensor(f32, cute.make_layout((_BT, 4), stride=(4, 1)), 16)

        tQ = head_rows(mQ, t0, hq, _BT)
        tK = head_rows(mK, t0, hq, _BT)
        tDq = head_rows(mDq, t0, hq, _BT)
        tDk = head_rows(mDk, t0, hq, _BT)
        for r in cutlass.range(n, unroll=4):  # rows past the chunk end are never read
            sK[r, d] = tK[r, d]

        for j in cutlass.range(group, unroll=1):
            hv = hq * group + j
            cute.arch.sync_threads()  # the previous value head's readers of sG, sA, sL, sC are done
            tG = head_rows(mG, t0, hv, _BT)
            tA = head_rows(mDA, t0, hv, _BT)
            tL = head_rows(mDL, t0, hv, _BT)
            tDg = head_rows(mDg, t0, hv, _BT)
            for r in cutlass.range(n, unroll=4):
                sG[r, d] = tG[r, d]
                sC[r, d] = f32(0.0)
            # dAqk and dL: two rows of 64 per step, the lower triangle kept; dSq = scale dAqk
            for r2 in cutlass.range(0, n, 2, unroll=2):
                r = r2 + d // _BT
                cc = d % _BT
                if r < n:
                    if cc <= r:
                        sA[r * (r + 1) // 2 + cc] = tA[r, cc] * scale
                        sL[r * (r + 1) // 2 + cc] = tL[r, cc]
            if d < n:
                sBeta[d] = head_rows(mBeta, t0, hv, _BT)[d, 0].to(f32)
            cute.arch.sync_threads()

            for i in cutlass.range(n, unroll=1):
                gi = sG[i, d]
                qi = tQ[i, d].to(f32)  # row i only: read from global memory (L1 / L2), not staged
                ki = sK[i, d].to(f32)
                bki = sBeta[i] * ki
                row = i * (i + 1) // 2
                aq = f32(0.0)
                ak = f32(0.0)
                # j = i .. 0: dL's diagonal is zero (strictly lower), dSq's is not
                for jj in cutlass.range(i + 1, unroll=4):
                    e = _exp(gi - sG[jj, d])
                    kj = sK[jj, d].to(f32)
                    a = sA[row + jj] * e
                    lv = sL[row + jj] * e
                    aq += a * kj
                    ak += lv * kj
                    sC[jj, d] = sC[jj, d] + a * qi + lv * bki
                dkr = sBeta[i] * ak
                tDq[i, d] = tDq[i, d] + aq
                tDk[i, d] = tDk[i, d] + dkr
                tDg[i, d] = tDg[i, d] + qi * aq + ki * dkr
                p = ki * ak  # dbeta_i: sum over channels of k_i R_i
                for s in cutlass.range_constexpr(5):
                    p += cute.arch.shuffle_sync_bfly(p, 1 << s)
                if d % 32 == 0:
                    sPart[i, warp] = p

            # the column side: C_j complete once every row i >= j has run (thread-private column: no barrier);
            # dG is then complete for this chunk: its reverse chunk-local cumsum (the gradient of the raw log
            # decay, from that of G = its cumsum) runs here, rows from last to first
            run = f32(0.0)
            for rr in cutlass.range(n, unroll=2):
                r = n - 1 - rr
                cc = sC[r, d]
                tDk[r, d] = tDk[r, d] + cc
                run += tDg[r, d] - sK[r, d].to(f32) * cc
                tDg[r, d] = run
            cute.arch.sync_threads()  # sPart complete
            if d < n:
                tDb = head_rows(mDb, t0, hv, _BT)
                tDb[d, 0] = tDb[d, 0] + ((sPart[d, 0] + sPart[d, 1]) + (sPart[d, 2] + sPart[d, 3]))
