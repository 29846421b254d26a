"""fwd_o: the output of one (chunk of 64, value head) per CTA, from the chunk-start state and the scores.

    o = scale * (q * exp(G)) @ h + Aqk @ v_new            (Aqk already holds scale and the causal mask)

GVA: q is read at head hv // (HV // HQK); G, h, Aqk, v_new at hv; o written in HV space.
Tiling: 128 threads (4 warps along the 64 rows), all of V = 128 per CTA so q * exp(G) is formed once;
[64 x 128] @ [128 x 128] then [64 x 64] @ [64 x 128] through mma.sync m16n8k16 (bf16 operands, qg rounded
to bf16 as FLA, fp32 accumulation), h and v_new read with ldmatrix.trans. Pipeline: cp.async q, h, Aqk,
v_new (rows past the chunk end zero), qg in place (8 channels per thread, 16-byte vectors), two GEMMs, o staged
through q's shared tile and stored in 16-byte rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import (chunk_block, copy_rows_g2s, g2s_tiled_copy, gemm_ss, head_rows,
                                          make_tiled_mma, smem_layout, store_acc_s, store_rows_s2g, token_layout,
                                          transposed, vec_copy)


class FwdO:
    BT = 64
    K = 128
    V = 128
    threads = 128

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, G_ptr: cute.Pointer, h_ptr: cute.Pointer, Aqk_ptr: cute.Pointer,
                 vnew_ptr: cute.Pointer, o_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        K, V, BT = self.K, self.V, self.BT
        mQ = cute.make_tensor(q_ptr, token_layout(TT, HQK, K))
        mG = cute.make_tensor(G_ptr, token_layout(TT, HV, K))
        # h [NC, HV, K, V] viewed as (NC * HV * K, 1, V): row k of (chunk c, head hv) is "token" (c HV + hv) K + k
        mH = cute.make_tensor(h_ptr, cute.make_layout((NC * HV * K, 1, V), stride=(V, V, 1)))
        mAqk = cute.make_tensor(Aqk_ptr, token_layout(TT, HV, BT))
        hv_v = token_layout(TT, HV, V)
        mVn = cute.make_tensor(vnew_ptr, hv_v)
        mO = cute.make_tensor(o_ptr, hv_v)
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(mQ, mG, mH, mAqk, mVn, mO, mT, HV, HV // HQK, scale).launch(
            grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mG: cute.Tensor, mH: cute.Tensor, mAqk: cute.Tensor, mVn: cute.Tensor,
               mO: cute.Tensor, mT: cute.Tensor, HV: cutlass.Int32, group: cutlass.Int32,
               scale: cutlass.Float32):
        K, V, BT = self.K, self.V, self.BT
        tidx, c, hv, t0, n = chunk_block(mT)
        hq = hv // group

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_layout(K, V), 128)
        sA = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BT), 128)
        sVn = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, V), 128)

        cp = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp, head_rows(mQ, t0, hq, BT), sQ, n, tidx)
        copy_rows_g2s(cp, head_rows(mH, (c * HV + hv) * K, 0, K), sH, K, tidx)
        copy_rows_g2s(g2s_tiled_copy(BT, self.threads), head_rows(mAqk, t0, hv, BT), sA, n, tidx)
        copy_rows_g2s(cp, head_rows(mVn, t0, hv, BT), sVn, n, tidx)
        cute.arch.cp_async_commit_group()
        # q * exp(G) in place, 8 channels per thread in 16-byte vectors. The G loads (to registers) are issued
        # before waiting for the cp.async copies, so their latency overlaps those copies' (session 4: with an
        # L2-norm pass of q placed between these loads and their use, fwd_o ran ~8% faster, H100)
        vb = vec_copy(K, self.threads)
        vf = vec_copy(K, self.threads, cutlass.Float32)
        tb = vb.get_slice(tidx)
        pG = vf.get_slice(tidx).partition_S(head_rows(mG, t0, hv, BT))
        pQs = tb.partition_S(sQ)
        pQd = tb.partition_D(sQ)
        coord = tb.partition_S(cute.make_identity_tensor((BT, K)))
        fg = cute.make_fragment_like(pG)
        for m in cutlass.range_constexpr(cute.size(pG.shape[1])):
            if coord[0, m, 0][0] < n:
                cute.copy(vf, pG[None, m, None], fg[None, m, None])
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        fq = cute.make_fragment_like(pQs[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(pG.shape[1])):
            if coord[0, m, 0][0] < n:
                cute.copy(vb, pQs[None, m, None], fq)
                fgm = fg[None, m, None]
                for e in cutlass.range_constexpr(8):
                    fq[e] = (fq[e].to(cutlass.Float32) * cute.math.exp(fgm[e].to(cutlass.Float32), fastmath=True)
                             ).to(cutlass.BFloat16)
                cute.copy(vb, fq, pQd[None, m, None])
        cute.arch.sync_threads()

        mma = make_tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BT, V)), cutlass.Float32)
        acc.fill(0.0)
        gemm_ss(mma, acc, sQ, transposed(sH, K, V), tidx, False, True)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] * scale
        gemm_ss(mma, acc, sA, transposed(sVn, BT, V), tidx, False, True)
        # o staged in q's tile (free once every warp is past the first GEMM), then 16-byte rows out
        cute.arch.sync_threads()
        store_acc_s(mma, acc, sQ, tidx)
        cute.arch.sync_threads()
        store_rows_s2g(sQ, head_rows(mO, t0, hv, BT), n, tidx, self.threads)
