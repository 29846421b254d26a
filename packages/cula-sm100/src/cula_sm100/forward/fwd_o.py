"""fwd_o: the output of one (chunk of 64, value head) per CTA, from the chunk-start state and the scores.

    o = scale * (q * exp(G)) @ h + Aqk @ v_new            (Aqk already holds scale and the causal mask)

GVA: q is read at head hv // (HV // HQK); G, h, Aqk, v_new at hv; o written in HV space.
Tiling: 128 threads (4 warps along the 64 rows), all of V = 128 per CTA so q * exp(G) is formed once;
[64 x 128] @ [128 x 128] then [64 x 64] @ [64 x 128] through mma.sync m16n8k16 (bf16 operands, qg rounded
to bf16 as FLA, fp32 accumulation), h and v_new read with ldmatrix.trans. Pipeline: cp.async q, h, Aqk,
v_new (rows past the chunk end zero), qg in place (8 channels per thread, 16-byte vectors), two GEMMs, o staged
through q's shared tile and stored in 16-byte rows.

qg_in (compile-time flag; launch.fwd_o_qg, the forward's stage through the qg path, forward(intermediates=False)):
q_ptr carries qg [TT, HV, K] bf16 = bf16(q e^G), made by chunk_intra_wu_gate with qg_out with this kernel's own expression (cute_utils.scale_by_exp), and is cp.async'ed at head hv straight into sQ;
G_ptr is not read, and neither the G loads nor the exp pass run (one barrier after the copies instead of two).
Everything else is the same code, so o is bitwise the flag-off kernel's on the q and G that made qg. Why: the G read
(fp32, 1.07 GB at B = 2, T = 8192, HV = 128) and q's (0.27 GB) become qg's 0.54 GB.
qg_in launches with min_blocks_per_mp = 3 (what its shared memory allows anyway; left unbounded, ptxas spills)
and a carveout of 100. Static resources: docs/kernel_report.md; measurements: docs/benchmarks/train_fwd.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g, vec_copy
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, store_acc_smem, tiled_mma, transposed
from cula_sm100.forward.cute_utils import chunk_block, scale_by_exp, token_layout


class FwdO:
    BT = 64
    K = 128
    V = 128
    threads = 128
    QG_IN_MIN_CTAS = 3  # qg_in's launch bound (see __call__)

    def __init__(self, qg_in: bool = False):
        # True: q_ptr is qg [TT, HV, K] bf16 (q e^G, chunk_intra_wu_gate's qg_out), loaded straight into sQ at the
        # value head; G_ptr is not read (see the module docstring)
        self.qg_in = qg_in

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, G_ptr: cute.Pointer, h_ptr: cute.Pointer, Aqk_ptr: cute.Pointer,
                 vnew_ptr: cute.Pointer, o_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        K, V, BT = self.K, self.V, self.BT
        mQ = cute.make_tensor(q_ptr, token_layout(TT, HV if self.qg_in else HQK, K))
        mG = cute.make_tensor(G_ptr, token_layout(TT, HV, K))
        # h [NC, HV, K, V] viewed as (NC * HV * K, 1, V): row k of (chunk c, head hv) is "token" (c HV + hv) K + k
        mH = cute.make_tensor(h_ptr, cute.make_layout((NC * HV * K, 1, V), stride=(V, V, 1)))
        mAqk = cute.make_tensor(Aqk_ptr, token_layout(TT, HV, BT))
        hv_v = token_layout(TT, HV, V)
        mVn = cute.make_tensor(vnew_ptr, hv_v)
        mO = cute.make_tensor(o_ptr, hv_v)
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        launch = dict(grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)
        if cutlass.const_expr(self.qg_in):
            # unbounded, ptxas gives this variant 96 registers and spills 12 B; bounded by the 3 CTAs per SM that its
            # 73 KiB of shared memory allow anyway, it takes 140 and spills nothing (the carveout as the other
            # bounded kernels: a bound > 1 without it makes the DSL query the device). No bound on the plain
            # kernel: its PTX stays as it was
            launch["min_blocks_per_mp"] = self.QG_IN_MIN_CTAS
            launch["preferred_smem_carveout"] = 100
        self.kernel(mQ, mG, mH, mAqk, mVn, mO, mT, HV, HV // HQK, scale).launch(**launch)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mG: cute.Tensor, mH: cute.Tensor, mAqk: cute.Tensor, mVn: cute.Tensor,
               mO: cute.Tensor, mT: cute.Tensor, HV: cutlass.Int32, group: cutlass.Int32,
               scale: cutlass.Float32):
        K, V, BT = self.K, self.V, self.BT
        tidx, c, hv, t0, n = chunk_block(mT)
        hq = hv if self.qg_in else hv // group  # qg_in: qg is in HV space

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K), 128)
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(K, V), 128)
        sA = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, BT), 128)
        sVn = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, V), 128)

        cp = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp, head_rows(mQ, t0, hq, BT), sQ, n, tidx)
        copy_rows_g2s(cp, head_rows(mH, (c * HV + hv) * K, 0, K), sH, K, tidx)
        copy_rows_g2s(g2s_tiled_copy(BT, self.threads), head_rows(mAqk, t0, hv, BT), sA, n, tidx)
        copy_rows_g2s(cp, head_rows(mVn, t0, hv, BT), sVn, n, tidx)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.qg_in):
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
        else:
            self.qg_in_place(mG, sQ, tidx, hv, t0, n)
        self.gemms_and_store(sQ, sH, sA, sVn, mO, tidx, hv, t0, n, scale)

    @cute.jit
    def qg_in_place(self, mG: cute.Tensor, sQ: cute.Tensor, tidx, hv, t0, n):
        """After the cp.async copies were issued: sQ = bf16(q e^G) for rows < n, then a barrier."""
        K, BT = self.K, self.BT
        # q * exp(G) in place, 8 channels per thread in 16-byte vectors. The G loads (to registers) are issued
        # before waiting for the cp.async copies, so their latency overlaps those copies'
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
                scale_by_exp(fq, fg[None, m, None])
                cute.copy(vb, fq, pQd[None, m, None])
        cute.arch.sync_threads()

    @cute.jit
    def gemms_and_store(self, sQ: cute.Tensor, sH: cute.Tensor, sA: cute.Tensor, sVn: cute.Tensor, mO: cute.Tensor,
                        tidx, hv, t0, n, scale: cutlass.Float32):
        """o = scale qg @ h + Aqk @ v_new from the shared tiles (qg in sQ), staged in sQ, rows < n stored."""
        K, V, BT = self.K, self.V, self.BT
        mma = tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BT, V)), cutlass.Float32)
        acc.fill(0.0)
        gemm(mma, acc, sQ, transposed(sH, K, V), tidx, False, True)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] * scale
        gemm(mma, acc, sA, transposed(sVn, BT, V), tidx, False, True)
        # o staged in q's tile (free once every warp is past the first GEMM), then 16-byte rows out
        cute.arch.sync_threads()
        store_acc_smem(mma, acc, sQ, tidx)
        cute.arch.sync_threads()
        store_rows_s2g(sQ, head_rows(mO, t0, hv, BT), n, tidx, self.threads)
