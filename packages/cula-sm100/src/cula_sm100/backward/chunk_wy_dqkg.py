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
units) except that dq, dk are produced per q/k head: the group's value heads run one after another in the
CTA and every element of dq/dk is read-added-written by the same thread each time (the MMA fragment map
does not change), so the sum has a fixed order and is bitwise deterministic, with no atomics. dq and dk must
be zeroed before the launch.

Tiling: 128 threads = 4 warps stacked along the 64 rows; every product is a warp-level mma.sync m16n8k16
(bf16 operands, fp32 accumulation: `cute_utils.make_tiled_mma(4)`), [64 x 128] @ [128 x 128]^T for the state
terms, [64 x 64] @ [64 x 128] for the A^T products, [64 x 64] x 3 for dL. Operands stored token-major
are read with ldmatrix.trans. Shared memory ~200 KB (one CTA per SM): q, k once; per value head h, dh
(32 KB each), do, v_new, dv, v (16 KB each), A, two 64 x 64 bf16 scratch tiles and a 64 x 129 fp32
scratch for the row/column sums. After their GEMMs, the do tile is reused for -dw and the v_new tile
for k exp(G) (same shape, so the same swizzled layout).
Pipeline per value head: cp.async of all tiles (rows past the chunk end zero-filled, never read from
global memory), then phases separated by barriers; G is read from global memory (fp32, L2-resident) at
the elements a thread owns. Assumes K = V = 128, bf16 operands, chunks that never cross a sequence.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import (copy_rows_g2s, g2s_tiled_copy, gemm_ss, head_rows, make_tiled_mma,
                                          smem_layout, transposed)


# tile sizes as module constants: names bound inside the kernel's runtime loop would be traced as dynamic
_BT, _K, _V = 64, 128, 128


def _exp(x):
    return cute.math.exp(x, fastmath=True)


class ChunkWyDqkg:
    threads = 128  # 4 warps along the chunk's rows (tile sizes: _BT, _K, _V above)

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

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(bf16, smem_layout(_BT, _K), 128)
        sK = smem.allocate_tensor(bf16, smem_layout(_BT, _K), 128)
        sH = smem.allocate_tensor(bf16, smem_layout(_K, _V), 128)
        sDh = smem.allocate_tensor(bf16, smem_layout(_K, _V), 128)
        sDo = smem.allocate_tensor(bf16, smem_layout(_BT, _V), 128)   # later: -dw
        sVn = smem.allocate_tensor(bf16, smem_layout(_BT, _V), 128)   # later: k exp(G)
        sDv = smem.allocate_tensor(bf16, smem_layout(_BT, _V), 128)
        sV = smem.allocate_tensor(bf16, smem_layout(_BT, _V), 128)
        sA = smem.allocate_tensor(bf16, smem_layout(_BT, _BT), 128)
        sT1 = smem.allocate_tensor(bf16, smem_layout(_BT, _BT), 128)
        sT2 = smem.allocate_tensor(bf16, smem_layout(_BT, _BT), 128)
        # fp32 scratch for row / column sums; odd row stride keeps both walks conflict-free
        sF = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_K + 1, 1)), 16)
        sBeta = smem.allocate_tensor(f32, cute.make_layout((_BT,)), 16)
        sLast = smem.allocate_tensor(f32, cute.make_layout((_K,)), 16)

        cp = g2s_tiled_copy(_K, self.threads)
        cp_a = g2s_tiled_copy(_BT, self.threads)
        copy_rows_g2s(cp, head_rows(mQ, t0, hq, _BT), sQ, n, tidx)
        copy_rows_g2s(cp, head_rows(mK, t0, hq, _BT), sK, n, tidx)
        cute.arch.cp_async_commit_group()

        mma = make_tiled_mma(4)
        thr = mma.get_slice(tidx)
        coord = thr.partition_C(cute.make_identity_tensor((_BT, _K)))
        coord_a = thr.partition_C(cute.make_identity_tensor((_BT, _BT)))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _K)), f32)
        acc_a = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _BT)), f32)

        tDq = head_rows(mDq, t0, hq, _BT)
        tDk = head_rows(mDk, t0, hq, _BT)

        for j in cutlass.range(group, unroll=1):
            hv = hq * group + j
            cute.arch.sync_threads()  # the previous value head's readers of the shared tiles are done
            copy_rows_g2s(cp, head_rows(mH, (c * HV + hv) * _K, 0, _K), sH, _K, tidx)
            copy_rows_g2s(cp, head_rows(mDh, (c * HV + hv) * _K, 0, _K), sDh, _K, tidx)
            copy_rows_g2s(cp, head_rows(mDo, t0, hv, _BT), sDo, n, tidx)
            copy_rows_g2s(cp, head_rows(mVn, t0, hv, _BT), sVn, n, tidx)
            copy_rows_g2s(cp, head_rows(mDv, t0, hv, _BT), sDv, n, tidx)
            copy_rows_g2s(cp, head_rows(mV, t0, hv, _BT), sV, n, tidx)
            copy_rows_g2s(cp_a, head_rows(mA, t0, hv, _BT), sA, n, tidx)
            cute.arch.cp_async_commit_group()
            if tidx < _BT:
                b = f32(0.0)
                if tidx < n:
                    b = head_rows(mBeta, t0, hv, _BT)[tidx, 0].to(f32)
                sBeta[tidx] = b
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            tG = head_rows(mG, t0, hv, _BT)
            tDg = head_rows(mDg, t0, hv, _BT)

            # ---- the decay's own gradient on the last row: exp(G_last) * sum_v h dh (thread = channel)
            dgk = f32(0.0)
            for vv in cutlass.range(_V, unroll=8):
                dgk += sH[tidx, vv].to(f32) * sDh[tidx, vv].to(f32)
            dgk = dgk * _exp(tG[n - 1, tidx].to(f32))

            # ---- dq = scale (do @ h^T) exp(G); dG = q dq
            acc.fill(0.0)
            gemm_ss(mma, acc, sDo, sH, tidx, False, False)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                if r < n:
                    x = acc[i] * _exp(tG[r, col].to(f32)) * scale
                    tDq[r, col] = tDq[r, col] + x
                    tDg[r, col] = sQ[r, col].to(f32) * x

            # ---- dw = -(dv @ h^T), kept in bf16 where do was
            acc.fill(0.0)
            gemm_ss(mma, acc, sDv, sH, tidx, False, False)
            cute.arch.sync_threads()  # every warp is done reading do
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                sDo[r, col] = (-acc[i]).to(bf16)

            # ---- state path of k: dk_h = (v_new @ dh^T) exp(G_last - G); dG -= k dk_h; colsum via sF
            acc.fill(0.0)
            gemm_ss(mma, acc, sVn, sDh, tidx, False, False)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                kd = f32(0.0)
                if r < n:
                    x = acc[i] * _exp(tG[n - 1, col].to(f32) - tG[r, col].to(f32))
                    kd = sK[r, col].to(f32) * x
                    tDk[r, col] = tDk[r, col] + x
                    tDg[r, col] = tDg[r, col] - kd
                sF[r, col] = kd
            cute.arch.sync_threads()  # sF complete; every warp is done reading v_new and dw's GEMM inputs
            colsum = f32(0.0)
            for r2 in cutlass.range(n, unroll=1):
                colsum += sF[r2, tidx]
            sLast[tidx] = colsum + dgk
            # k exp(G) replaces v_new (thread = channel); rows past the end stay zero
            for r3 in cutlass.range_constexpr(_BT):
                kg = f32(0.0)
                if r3 < n:
                    kg = sK[r3, tidx].to(f32) * _exp(tG[r3, tidx].to(f32))
                sVn[r3, tidx] = kg.to(bf16)
            cute.arch.sync_threads()

            # ---- gradient of A: (dv @ v^T + dw @ kg^T) * beta[col], strictly lower, valid rows/cols
            acc_a.fill(0.0)
            gemm_ss(mma, acc_a, sDv, sV, tidx, False, False)
            gemm_ss(mma, acc_a, sDo, sVn, tidx, False, False)
            for i in cutlass.range_constexpr(cute.size(acc_a)):
                r, col = coord_a[i]
                x = f32(0.0)
                if r < n:
                    if r > col:
                        x = acc_a[i] * sBeta[col]
                sT1[r, col] = x.to(bf16)
            cute.arch.sync_threads()
            # X = dA @ A^T
            acc_a.fill(0.0)
            gemm_ss(mma, acc_a, sT1, sA, tidx, False, False)
            for i in cutlass.range_constexpr(cute.size(acc_a)):
                r, col = coord_a[i]
                sT2[r, col] = acc_a[i].to(bf16)
            cute.arch.sync_threads()
            # dL = -A^T X, strictly lower; rows < n stored, every column (zeros past the end)
            acc_a.fill(0.0)
            gemm_ss(mma, acc_a, transposed(sA, _BT, _BT), transposed(sT2, _BT, _BT), tidx, True, True)
            tDA = head_rows(mDA, t0, hv, _BT)
            for i in cutlass.range_constexpr(cute.size(acc_a)):
                r, col = coord_a[i]
                if r < n:
                    x = f32(0.0)
                    if r > col:
                        x = -acc_a[i]
                    tDA[r, col] = x

            # ---- dvb = A^T @ dv: dv2 = beta dvb; dbeta partial dvb * v into sF
            acc.fill(0.0)
            gemm_ss(mma, acc, transposed(sA, _BT, _BT), transposed(sDv, _BT, _V), tidx, True, True)
            tDv2 = head_rows(mDv2, t0, hv, _BT)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                if r < n:
                    tDv2[r, col] = (acc[i] * sBeta[r]).to(mDv2.element_type)
                sF[r, col] = acc[i] * sV[r, col].to(f32)

            # ---- dkgb = A^T @ dw: dk += beta exp(G) dkgb; dG += beta k exp(G) dkgb; dbeta += k exp(G) dkgb
            acc.fill(0.0)
            gemm_ss(mma, acc, transposed(sA, _BT, _BT), transposed(sDo, _BT, _K), tidx, True, True)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, col = coord[i]
                if r < n:
                    eg = _exp(tG[r, col].to(f32))
                    b = sBeta[r]
                    kg = sK[r, col].to(f32) * eg
                    sF[r, col] = sF[r, col] + acc[i] * kg
                    tDg[r, col] = tDg[r, col] + kg * acc[i] * b
                    tDk[r, col] = tDk[r, col] + acc[i] * eg * b
            cute.arch.sync_threads()  # sF and this head's dG stores complete

            if tidx < n:
                db = f32(0.0)
                for cc in cutlass.range(_K, unroll=8):
                    db += sF[tidx, cc]
                head_rows(mDb, t0, hv, _BT)[tidx, 0] = db
            tDg[n - 1, tidx] = tDg[n - 1, tidx] + sLast[tidx]
