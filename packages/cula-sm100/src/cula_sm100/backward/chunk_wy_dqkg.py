"""chunk_wy_dqkg: the fused backward of the WY representation and of the state terms, one (chunk of 64, q/k head)
per CTA, looping over the value heads of that q/k head's group (native GVA: dq, dk summed in the kernel).

Per value head hv of the group (h: state at the chunk start, dh: gradient of the state at the chunk END, dv:
gradient of v_new in total; A = Akk = (I + L)^-1; G natural-log chunk-local cumsum; beta post-activation):

    dq   += scale * (do @ h^T) * exp(G)
    dk_h  = (v_new @ dh^T) * exp(G_last - G)                       (state path of k)
    dw    = -(dv @ h^T)                                            (w enters v_new = u - w h)
    dA    = [dv @ v^T + dw @ (k exp(G))^T] * beta[col]             (gradient of A through u and w)
    dL    = -A^T (strict_lower(dA)) A^T       -> dA output (fp32, strictly lower, rows/cols past n zero)
    dvb   = A^T @ dv ;  dv2 = dvb * beta                           (dv output, bf16)
    dkgb  = A^T @ dw ;  dk += dk_h + dkgb * beta * exp(G)
    dbeta = rowsum(dvb * v) + rowsum(dkgb * k exp(G))
    dG    = q dq - k dk_h + beta k exp(G) dkgb, and on the chunk's last row also
            colsum(k dk_h) + exp(G_last) * rowsum_V(h * dh)        (dG: before the reverse cumsum)

This is FLA 0.6.0's `chunk_kda_bwd_kernel_wy_dqkg_fused` (its `A` is loaded transposed; its g is in log2
units) except that dq, dk are produced per q/k head, summed over the group's value heads inside the CTA.
Tiling and pipeline (chosen over 4 warps with dq / dk read-added-written in global memory per value head by
measurement: docs/sm100_backward.md):

  * 8 warps (256 threads) as a 4 (rows) x 2 (columns) grid of mma.sync m16n8k16 warps (rather than 4
    warps along the rows): twice the warps to hide latency and half the accumulator registers per product (a
    [64 x 128] fp32 tile is 32 registers per thread).
  * dq, dk accumulated over the group's value heads in REGISTERS (two fp32 fragments) and written once per CTA
    (not a fp32 read-add-write of global memory per value head). The same thread sums the value
    heads in a fixed order: bitwise deterministic, no atomics, no zero-fill before the launch.
  * dG accumulated in a register fragment within a value head and written once; dL, dv, dG, dq, dk all leave
    through shared memory in 16-byte stores (`cula_core.cute_kernels.copies.store_rows_s2g`); G arrives by
    16-byte cp.async into shared memory with the bf16 tiles.
  * Row / column sums (dbeta; the column sums of k dk_h for dG's last row) from the accumulator fragments:
    in-thread pairs, warp shuffles, then one slot per warp in shared memory summed in a fixed order.
  * Each GEMM walks its k-blocks in a runtime loop (unrolled by 2) with one k-block of operand fragments
    (`warp_mma.gemm(..., unroll_k=False)`): fully unrolled, ptxas hoists every ldmatrix and spills.

Shared memory ~209 KB (one CTA per SM; 8 warps x <= 255 registers fit it): q, k once; per value head h, dh (32 KB
each), do (later -dw), v_new (later k exp(G), later the dv staging), dv, v (16 KB each), A (8 KB), G fp32 [64 x 132]
(later the dG / dq / dk staging); the two 64 x 64 bf16 scratch tiles of the dL chain live over dh, dL's fp32 staging
over h (both dead by then). Pipeline per value head: cp.async of every tile in two groups (h, do, dv, G; then dh,
v_new, v, A: the second lands during the dq and dw products; rows past the chunk end zero-filled, never read from
global memory), then phases separated by barriers. Next step (not done, docs/sm100_backward.md): overlap the loads
with compute across value heads or CTAs (K-half tiles of h / dh in a two-stage pipeline, or <= 113 KB for two CTAs
per SM).
Assumes K = V = 128, bf16 operands, chunks that never cross a sequence.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g, vec_copy
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, tiled_mma, transposed

# tile sizes as module constants: names bound inside the kernel's runtime loop would be traced as dynamic
_BT, _K, _V = 64, 128, 128
_FS = _K + 4  # fp32 scratch row stride: 16-byte aligned rows for the vector stores
_THREADS = 256


def _exp(x):
    return cute.math.exp(x, fastmath=True)


class ChunkWyDqkg:
    """Host entry (`__call__`: the global views, grid [NC, HQK]) and the kernel; tile sizes are the module's."""
    threads = _THREADS  # 8 warps: 4 along the chunk's rows x 2 along the columns

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, vn_ptr: cute.Pointer,
                 G_ptr: cute.Pointer, beta_ptr: cute.Pointer, A_ptr: cute.Pointer, h_ptr: cute.Pointer,
                 do_ptr: cute.Pointer, dh_ptr: cute.Pointer, dv_ptr: cute.Pointer, dq_ptr: cute.Pointer,
                 dk_ptr: cute.Pointer, dv2_ptr: cute.Pointer, dg_ptr: cute.Pointer, db_ptr: cute.Pointer,
                 dA_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32, NC: cutlass.Int32,
                 HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32, stream: cuda.CUstream):
        K, V, BT = _K, _V, _BT
        qk = cute.make_layout((TT, HQK, K), stride=(HQK * K, K, 1))
        hv_k = cute.make_layout((TT, HV, K), stride=(HV * K, K, 1))
        hv_v = cute.make_layout((TT, HV, V), stride=(HV * V, V, 1))
        hv_a = cute.make_layout((TT, HV, BT), stride=(HV * BT, BT, 1))
        # states [NC, HV, K, V] viewed as (NC HV K, 1, V): head_rows then forms 64-bit offsets
        state = cute.make_layout((NC * HV * K, 1, V), stride=(V, V, 1))
        self.kernel(
            cute.make_tensor(q_ptr, qk), cute.make_tensor(k_ptr, qk), cute.make_tensor(v_ptr, hv_v),
            cute.make_tensor(vn_ptr, hv_v), cute.make_tensor(G_ptr, hv_k),
            cute.make_tensor(beta_ptr, cute.make_layout((TT, HV, 1), stride=(HV, 1, 1))),
            cute.make_tensor(A_ptr, hv_a), cute.make_tensor(h_ptr, state), cute.make_tensor(do_ptr, hv_v),
            cute.make_tensor(dh_ptr, state), cute.make_tensor(dv_ptr, hv_v), cute.make_tensor(dq_ptr, qk),
            cute.make_tensor(dk_ptr, qk), cute.make_tensor(dv2_ptr, hv_v), cute.make_tensor(dg_ptr, hv_k),
            cute.make_tensor(db_ptr, cute.make_layout((TT, HV, 1), stride=(HV, 1, 1))),
            cute.make_tensor(dA_ptr, hv_a), cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1))),
            HV, HV // HQK, scale,
        ).launch(grid=[NC, HQK, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mVn: cute.Tensor, mG: cute.Tensor,
               mBeta: cute.Tensor, mA: cute.Tensor, mH: cute.Tensor, mDo: cute.Tensor, mDh: cute.Tensor,
               mDv: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv2: cute.Tensor, mDg: cute.Tensor,
               mDb: cute.Tensor, mDA: cute.Tensor, mT: cute.Tensor, HV: cutlass.Int32, group: cutlass.Int32,
               scale: cutlass.Float32):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        c, hq, _ = cute.arch.block_idx()
        t0 = mT[c, 0]
        n = mT[c, 1]
        lane = tidx % 32
        wid = tidx // 32

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sK = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sH = smem.allocate_tensor(bf16, smem_tile_layout(_K, _V), 128)      # later: dL staging (fp32)
        sDh = smem.allocate_tensor(bf16, smem_tile_layout(_K, _V), 128)     # later: the two 64 x 64 scratch tiles
        sDo = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _V), 128)    # later: -dw
        sVn = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _V), 128)    # later: k exp(G), then dv staging
        sDv = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _V), 128)
        sV = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _V), 128)
        sA = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _BT), 128)
        sG = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_FS, 1)), 128)  # later: dG/dq/dk staging
        sBeta = smem.allocate_tensor(f32, cute.make_layout((_BT,)), 16)
        sHdh = smem.allocate_tensor(f32, cute.make_layout((_K,)), 16)                      # sum_v h dh per row
        sCol = smem.allocate_tensor(f32, cute.make_layout((8, _K), stride=(_K, 1)), 16)    # per-warp column sums
        sRow = smem.allocate_tensor(f32, cute.make_layout((8, _BT), stride=(_BT, 1)), 16)  # per-warp row sums
        sLast = smem.allocate_tensor(f32, cute.make_layout((_K,)), 16)
        # tiles over dead ones: h and dh are last read by the dw and dk_h GEMMs, both behind a barrier by then
        sT1 = cute.make_tensor(sDh.iterator, smem_tile_layout(_BT, _BT))
        sT2 = cute.make_tensor(sDh.iterator + _BT * _BT, smem_tile_layout(_BT, _BT))
        sDL = cute.make_tensor(cute.recast_ptr(sH.iterator, dtype=f32),
                               cute.make_layout((_BT, _BT), stride=(_BT + 4, 1)))

        cp = g2s_tiled_copy(_K, self.threads)
        cp_a = g2s_tiled_copy(_BT, self.threads)
        cp_g = g2s_tiled_copy(_K, self.threads, f32)
        copy_rows_g2s(cp, head_rows(mQ, t0, hq, _BT), sQ, n, tidx)
        copy_rows_g2s(cp, head_rows(mK, t0, hq, _BT), sK, n, tidx)
        cute.arch.cp_async_commit_group()

        mma = tiled_mma(4, 2)
        thr = mma.get_slice(tidx)
        coord = thr.partition_C(cute.make_identity_tensor((_BT, _K)))
        coord_a = thr.partition_C(cute.make_identity_tensor((_BT, _BT)))
        # the thread's elements of each shared tile in the accumulator's order: one base address and static
        # offsets, instead of an address per (row, column) kept live across the phases
        pG = thr.partition_C(sG)
        pQ = thr.partition_C(sQ)
        pK = thr.partition_C(sK)
        pV = thr.partition_C(sV)
        pDo = thr.partition_C(sDo)
        pVn = thr.partition_C(sVn)
        pT1 = thr.partition_C(sT1)
        pT2 = thr.partition_C(sT2)
        pDL = thr.partition_C(sDL)
        # the h.dh row sums read h and dh in 16-byte vectors
        vc = vec_copy(_V, _THREADS)
        thr_v = vc.get_slice(tidx)
        pHv = thr_v.partition_S(sH)
        pDhv = thr_v.partition_S(sDh)
        cHv = thr_v.partition_S(cute.make_identity_tensor((_K, _V)))
        fH = cute.make_fragment_like(pHv[None, 0, None])
        fDh = cute.make_fragment_like(pDhv[None, 0, None])
        acc = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _K)), f32)
        acc_a = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _BT)), f32)
        dq = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _K)), f32)   # summed over the group
        dk = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _K)), f32)   # summed over the group
        dg = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _K)), f32)   # this value head's dG
        dq.fill(0.0)
        dk.fill(0.0)
        # The m16n8k16 accumulator: values 4e..4e+3 of a thread are (row g, cols c, c+1), (row g+8, cols c, c+1)
        # of one 16 x 8 atom (g = lane / 4, c = 2 (lane % 4)); with 4 warps on 64 rows a thread has one atom row
        # (two rows) and its columns in every value: row sums are two scalars, column sums pair i with i + 2.
        assert cute.size(acc.shape[1]) == 1

        for j in cutlass.range(group, unroll=1):
            hv = hq * group + j
            cute.arch.sync_threads()  # the previous value head's readers of the shared tiles are done
            # two cp.async groups: what the dq and dw products read first, the rest lands while they run
            copy_rows_g2s(cp, head_rows(mH, (c * HV + hv) * _K, 0, _K), sH, _K, tidx)
            copy_rows_g2s(cp, head_rows(mDo, t0, hv, _BT), sDo, n, tidx)
            copy_rows_g2s(cp, head_rows(mDv, t0, hv, _BT), sDv, n, tidx)
            copy_rows_g2s(cp_g, head_rows(mG, t0, hv, _BT), sG, n, tidx)
            cute.arch.cp_async_commit_group()
            copy_rows_g2s(cp, head_rows(mDh, (c * HV + hv) * _K, 0, _K), sDh, _K, tidx)
            copy_rows_g2s(cp, head_rows(mVn, t0, hv, _BT), sVn, n, tidx)
            copy_rows_g2s(cp, head_rows(mV, t0, hv, _BT), sV, n, tidx)
            copy_rows_g2s(cp_a, head_rows(mA, t0, hv, _BT), sA, n, tidx)
            cute.arch.cp_async_commit_group()
            if tidx < _BT:
                b = f32(0.0)
                if tidx < n:
                    b = head_rows(mBeta, t0, hv, _BT)[tidx, 0].to(f32)
                sBeta[tidx] = b
            for e in cutlass.range_constexpr(4):  # per-warp partial sums start at zero (rows a warp never owns)
                sCol[(tidx + e * _THREADS) // _K, (tidx + e * _THREADS) % _K] = f32(0.0)
            for e in cutlass.range_constexpr(2):
                sRow[(tidx + e * _THREADS) // _BT, (tidx + e * _THREADS) % _BT] = f32(0.0)
            cute.arch.cp_async_wait_group(1)  # q, k and the first group (h, do, dv, G)
            cute.arch.sync_threads()

            # ---- dq += scale (do @ h^T) exp(G); dG = q dq_h
            acc.fill(0.0)
            gemm(mma, acc, sDo, sH, tidx, False, False, unroll_k=False)
            for i in cutlass.range_constexpr(cute.size(acc)):
                x = acc[i] * _exp(pG[i]) * scale  # rows past the end: do is zero there
                dq[i] = dq[i] + x
                dg[i] = pQ[i].to(f32) * x

            # ---- dw = -(dv @ h^T), kept in bf16 where do was
            acc.fill(0.0)
            gemm(mma, acc, sDv, sH, tidx, False, False, unroll_k=False)
            cute.arch.sync_threads()  # every warp is done reading do
            for i in cutlass.range_constexpr(cute.size(acc)):
                pDo[i] = (-acc[i]).to(bf16)
            cute.arch.cp_async_wait_group(0)  # the second group (dh, v_new, v, A)
            cute.arch.sync_threads()

            # ---- the decay's own gradient on the last row: exp(G_last) sum_v h dh. 16 threads per state row,
            # 8 consecutive columns each (16-byte shared loads; the swizzle keeps 8-column chunks contiguous),
            # then shuffles within the 16 lanes of the row
            for m in cutlass.range_constexpr(cute.size(pHv.shape[1])):
                cute.copy(vc, pHv[None, m, None], fH)
                cute.copy(vc, pDhv[None, m, None], fDh)
                hd = f32(0.0)
                for e in cutlass.range_constexpr(cute.size(fH)):
                    hd += fH[e].to(f32) * fDh[e].to(f32)
                for sh in cutlass.range_constexpr(4):
                    hd += cute.arch.shuffle_sync_bfly(hd, 1 << sh)
                if tidx % (_V // 8) == 0:
                    sHdh[cHv[0, m, 0][0]] = hd

            # ---- state path of k: dk_h = (v_new @ dh^T) exp(G_last - G); dG -= k dk_h; column sums of k dk_h
            acc.fill(0.0)
            gemm(mma, acc, sVn, sDh, tidx, False, False, unroll_k=False)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                kd = f32(0.0)
                if r < n:
                    x = acc[i] * _exp(sG[n - 1, col] - pG[i])
                    kd = pK[i].to(f32) * x
                    dk[i] = dk[i] + x
                    dg[i] = dg[i] - kd
                acc[i] = kd
            for i in cutlass.range_constexpr(cute.size(acc)):
                if i % 4 < 2:  # rows g and g + 8 of one column, then the 8 row groups of the warp (lane bits 2-4)
                    cs = acc[i] + acc[i + 2]
                    cs += cute.arch.shuffle_sync_bfly(cs, 4)
                    cs += cute.arch.shuffle_sync_bfly(cs, 8)
                    cs += cute.arch.shuffle_sync_bfly(cs, 16)
                    if lane < 4:
                        sCol[wid, coord[i][1]] = cs
            cute.arch.sync_threads()  # every warp is done reading v_new, h and dh; sCol, sHdh complete
            # k exp(G) replaces v_new (rows past the end: zero, as sK's)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                pVn[i] = (pK[i].to(f32) * _exp(pG[i])).to(bf16)
            if tidx < _K:
                cs8 = sHdh[tidx] * _exp(sG[n - 1, tidx])
                for w in cutlass.range_constexpr(8):
                    cs8 += sCol[w, tidx]
                sLast[tidx] = cs8  # read after the next barriers
            cute.arch.sync_threads()

            # ---- gradient of A: (dv @ v^T + dw @ kg^T) * beta[col], strictly lower, valid rows/cols
            acc_a.fill(0.0)
            gemm(mma, acc_a, sDv, sV, tidx, False, False, unroll_k=False)
            gemm(mma, acc_a, sDo, sVn, tidx, False, False, unroll_k=False)
            for i in cutlass.range_constexpr(cute.size(acc_a)):
                r, col = coord_a[i]
                x = f32(0.0)
                if r < n:
                    if r > col:
                        x = acc_a[i] * sBeta[col]
                pT1[i] = x.to(bf16)
            cute.arch.sync_threads()
            # X = dA @ A^T
            acc_a.fill(0.0)
            gemm(mma, acc_a, sT1, sA, tidx, False, False, unroll_k=False)
            for i in cutlass.range_constexpr(cute.size(acc_a)):
                r, col = coord_a[i]
                pT2[i] = acc_a[i].to(bf16)
            cute.arch.sync_threads()
            # dL = -A^T X, strictly lower (zeros past the end), staged over h for 16-byte stores
            acc_a.fill(0.0)
            gemm(mma, acc_a, transposed(sA, _BT, _BT), transposed(sT2, _BT, _BT), tidx, True, True, unroll_k=False)
            for i in cutlass.range_constexpr(cute.size(acc_a)):
                r, col = coord_a[i]
                x = f32(0.0)
                if r > col:
                    x = -acc_a[i]
                pDL[i] = x

            # ---- dvb = A^T @ dv: dv2 = beta dvb, staged where k exp(G) was (its last reader, the dA GEMM, is
            # behind two barriers); the dbeta row sums of dvb * v in two scalars (rows g and g + 8)
            acc.fill(0.0)
            gemm(mma, acc, transposed(sA, _BT, _BT), transposed(sDv, _BT, _V), tidx, True, True, unroll_k=False)
            rs0 = f32(0.0)
            rs1 = f32(0.0)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                pVn[i] = (acc[i] * sBeta[r]).to(bf16)
                if i % 4 < 2:
                    rs0 += acc[i] * pV[i].to(f32)
                else:
                    rs1 += acc[i] * pV[i].to(f32)
            cute.arch.sync_threads()  # dL and dv staged
            store_rows_s2g(sDL, head_rows(mDA, t0, hv, _BT), n, tidx, _THREADS)
            store_rows_s2g(sVn, head_rows(mDv2, t0, hv, _BT), n, tidx, _THREADS)

            # ---- dkgb = A^T @ dw: dk += beta exp(G) dkgb; dG += beta k exp(G) dkgb; dbeta += k exp(G) dkgb
            acc.fill(0.0)
            gemm(mma, acc, transposed(sA, _BT, _BT), transposed(sDo, _BT, _K), tidx, True, True, unroll_k=False)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                eg = _exp(pG[i])
                b = sBeta[r]
                kg = pK[i].to(f32) * eg      # zero past the end: sK rows are zero-filled
                if i % 4 < 2:
                    rs0 += acc[i] * kg
                else:
                    rs1 += acc[i] * kg
                dg[i] = dg[i] + kg * acc[i] * b
                dk[i] = dk[i] + acc[i] * eg * b
                if r == n - 1:
                    dg[i] = dg[i] + sLast[col]
            rs0 += cute.arch.shuffle_sync_bfly(rs0, 1)
            rs0 += cute.arch.shuffle_sync_bfly(rs0, 2)
            rs1 += cute.arch.shuffle_sync_bfly(rs1, 1)
            rs1 += cute.arch.shuffle_sync_bfly(rs1, 2)
            if lane % 4 == 0:
                sRow[wid, coord[0][0]] = rs0
                sRow[wid, coord[2][0]] = rs1
            cute.arch.sync_threads()  # sRow complete; every warp is done reading G, dL and dv staging
            if tidx < n:
                db = f32(0.0)
                for w in cutlass.range_constexpr(8):
                    db += sRow[w, tidx]
                head_rows(mDb, t0, hv, _BT)[tidx, 0] = db
            for i in cutlass.range_constexpr(cute.size(dg)):
                pG[i] = dg[i]
            cute.arch.sync_threads()
            store_rows_s2g(sG, head_rows(mDg, t0, hv, _BT), n, tidx, _THREADS)

        # ---- dq, dk: once per CTA, through shared memory in 16-byte stores
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(cute.size(dq)):
            pG[i] = dq[i]
        cute.arch.sync_threads()
        store_rows_s2g(sG, head_rows(mDq, t0, hq, _BT), n, tidx, _THREADS)
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(cute.size(dk)):
            pG[i] = dk[i]
        cute.arch.sync_threads()
        store_rows_s2g(sG, head_rows(mDk, t0, hq, _BT), n, tidx, _THREADS)
