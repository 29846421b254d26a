"""chunk_bwd_dav: the backward of the output's intra-chunk term, one (chunk of 64, value head) per CTA.

The forward's o = scale (q e^G) h + Aqk @ v_new (Aqk [64 x 64] causal, the diagonal included, scale already
in it). Its backward through the intra-chunk term:

    dAqk = (do @ v_new^T) masked to the causal part (diagonal included)   -> fp32 [TT, HV, 64]
    dv   = Aqk^T @ do                                                      -> bf16 [TT, HV, V]

(dv: the gradient of v_new through o; the reverse recurrence then adds kg @ dh.) FLA 0.6.0:
`chunk_kda_bwd_dAv`. dAqk goes to the intra-chunk backward, dv to chunk_bwd_dhu (bf16, as FLA stores it).

Tiling: 128 threads = 4 warps stacked along the 64 rows; mma.sync m16n8k16 (bf16 operands, fp32 accumulation:
`cula_core.cute_kernels.warp_mma.tiled_mma(4)`): [64 x 128] @ [64 x 128]^T for dAqk, [64 x 64]^T @ [64 x 128] for
dv (Aqk and do read with ldmatrix.trans). Shared memory 40 KB (do, v_new 16 KB each, Aqk 8 KB): several CTAs per SM.
Pipeline: one cp.async group of the three tiles (rows past the chunk end zero-filled, never read from global
memory), one barrier, the two GEMMs, stores from the accumulator fragments (rows past the end not stored).
Assumes V = 128, bf16 operands, chunks that never cross a sequence (the chunk table).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, tiled_mma, transposed

# tile sizes as module constants (names bound inside the kernel would be traced as dynamic)
_BT, _V = 64, 128


class ChunkBwdDav:
    threads = 128  # 4 warps along the chunk's rows

    @cute.jit
    def __call__(self, do_ptr: cute.Pointer, vn_ptr: cute.Pointer, A_ptr: cute.Pointer, dA_ptr: cute.Pointer,
                 dv_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32, NC: cutlass.Int32,
                 HV: cutlass.Int32, stream: cuda.CUstream):
        hv_v = cute.make_layout((TT, HV, _V), stride=(HV * _V, _V, 1))
        hv_a = cute.make_layout((TT, HV, _BT), stride=(HV * _BT, _BT, 1))
        self.kernel(cute.make_tensor(do_ptr, hv_v), cute.make_tensor(vn_ptr, hv_v), cute.make_tensor(A_ptr, hv_a),
                    cute.make_tensor(dA_ptr, hv_a), cute.make_tensor(dv_ptr, hv_v),
                    cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1))),
                    ).launch(grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mDo: cute.Tensor, mVn: cute.Tensor, mA: cute.Tensor, mDA: cute.Tensor, mDv: cute.Tensor,
               mT: cute.Tensor):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        c, hv, _ = cute.arch.block_idx()
        t0 = mT[c, 0]
        n = mT[c, 1]

        smem = cutlass.utils.SmemAllocator()
        sDo = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _V), 128)
        sVn = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _V), 128)
        sA = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _BT), 128)

        cp = g2s_tiled_copy(_V, self.threads)
        cp_a = g2s_tiled_copy(_BT, self.threads)
        copy_rows_g2s(cp, head_rows(mDo, t0, hv, _BT), sDo, n, tidx)
        copy_rows_g2s(cp, head_rows(mVn, t0, hv, _BT), sVn, n, tidx)
        copy_rows_g2s(cp_a, head_rows(mA, t0, hv, _BT), sA, n, tidx)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        mma = tiled_mma(4)
        thr = mma.get_slice(tidx)

        # ---- dAqk = do @ v_new^T, causal (diagonal included); columns past the end are zero (v_new rows zero)
        coord_a = thr.partition_C(cute.make_identity_tensor((_BT, _BT)))
        acc_a = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _BT)), f32)
        acc_a.fill(0.0)
        gemm(mma, acc_a, sDo, sVn, tidx, False, False)
        tDA = head_rows(mDA, t0, hv, _BT)
        for i in cutlass.range_constexpr(cute.size(acc_a)):
            r, col = coord_a[i]
            if r < n:
                x = f32(0.0)
                if r >= col:
                    x = acc_a[i]
                tDA[r, col] = x

        # ---- dv = Aqk^T @ do (Aqk rows past the end are zero, so they add nothing)
        coord = thr.partition_C(cute.make_identity_tensor((_BT, _V)))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((_BT, _V)), f32)
        acc.fill(0.0)
        gemm(mma, acc, transposed(sA, _BT, _BT), transposed(sDo, _BT, _V), tidx, True, True)
        tDv = head_rows(mDv, t0, hv, _BT)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, col = coord[i]
            if r < n:
                tDv[r, col] = acc[i].to(mDv.element_type)
