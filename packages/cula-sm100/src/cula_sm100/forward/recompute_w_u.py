"""recompute_w_u: the WY factors of one (chunk of 64, value head) per CTA, and the key decayed to chunk end.

    w  = Akk @ (beta * k * exp(G))        u = Akk @ (beta * v)        kg = k * exp(G_last - G)

GVA: k is read at head hv // (HV // HQK); Akk, G, beta, v at hv; w, u, kg written in HV space.
Tiling: 128 threads (4 warps stacked along the chunk's 64 rows); each product is [64 x 64] @ [64 x 128]
through mma.sync m16n8k16 (bf16 operands, fp32 accumulation), the right operand read with ldmatrix.trans
(it is stored token-major). Pipeline: cp.async Akk, k, v (rows past the chunk end zero); each thread scales
8 channels of k and v in place (bf16, as FLA; G read as 16-byte vectors, all loads issued first) and writes kg;
two GEMMs, each result staged through the shared tile its GEMM is done with, then 16-byte stores of rows < n.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g, vec_copy
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, store_acc_smem, tiled_mma, transposed
from cula_sm100.forward.cute_utils import chunk_block, load_beta, token_layout


class RecomputeWU:
    BT = 64
    K = 128
    V = 128
    threads = 128

    def __init__(self, beta_activation: str):
        self.beta_activation = beta_activation

    @cute.jit
    def __call__(self, k_ptr: cute.Pointer, v_ptr: cute.Pointer, G_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 Akk_ptr: cute.Pointer, w_ptr: cute.Pointer, u_ptr: cute.Pointer, kg_ptr: cute.Pointer,
                 table_ptr: cute.Pointer, TT: cutlass.Int32, NC: cutlass.Int32, HQK: cutlass.Int32,
                 HV: cutlass.Int32, stream: cuda.CUstream):
        K, V, BT = self.K, self.V, self.BT
        mK = cute.make_tensor(k_ptr, token_layout(TT, HQK, K))
        hv_k = token_layout(TT, HV, K)
        hv_v = token_layout(TT, HV, V)
        mV = cute.make_tensor(v_ptr, hv_v)
        mG = cute.make_tensor(G_ptr, hv_k)
        mBeta = cute.make_tensor(beta_ptr, token_layout(TT, HV, 1))
        mAkk = cute.make_tensor(Akk_ptr, token_layout(TT, HV, BT))
        mW = cute.make_tensor(w_ptr, hv_k)
        mU = cute.make_tensor(u_ptr, hv_v)
        mKg = cute.make_tensor(kg_ptr, hv_k)
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(mK, mV, mG, mBeta, mAkk, mW, mU, mKg, mT, HV // HQK).launch(
            grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAkk: cute.Tensor,
               mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mT: cute.Tensor, group: cutlass.Int32):
        K, V, BT = self.K, self.V, self.BT
        tidx, _, hv, t0, n = chunk_block(mT)
        hq = hv // group

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, BT), 128)
        sK = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K), 128)
        sV = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, V), 128)
        sBeta = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT,)), 16)

        copy_rows_g2s(g2s_tiled_copy(BT, self.threads), head_rows(mAkk, t0, hv, BT), sA, n, tidx)
        cp = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp, head_rows(mK, t0, hq, BT), sK, n, tidx)
        copy_rows_g2s(cp, head_rows(mV, t0, hv, BT), sV, n, tidx)
        cute.arch.cp_async_commit_group()
        load_beta(sBeta, mBeta, t0, hv, n, tidx, self.beta_activation)

        scale_k_v(mG, mKg, sK, sV, sBeta, t0, hv, n, tidx, self.threads)  # waits for the copies itself
        cute.arch.sync_threads()
        wu_gemms(sA, sK, sV, mW, mU, t0, hv, n, tidx, self.threads)


@cute.jit
def scale_k_v(mG: cute.Tensor, mKg: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sBeta: cute.Tensor, t0, hv, n,
              tidx, threads: cutlass.Constexpr):
    """In place: sK = beta k exp(G), sV = beta v (bf16, as FLA); kg = k exp(G_last - G) straight to global
    memory. 8 channels per thread in 16-byte vectors; G read from global memory, all of the thread's loads
    issued before any use so their latencies overlap. Rows >= n of sK / sV stay as they are (zero).
    Call with the cp.async copies of sK / sV (and sBeta's stores) issued, not waited for: the G loads are issued
    first, then this waits for the copies and synchronises the CTA, so G's latency overlaps the copies'."""
    BT, K = 64, 128
    vb = vec_copy(K, threads)
    vf = vec_copy(K, threads, cutlass.Float32)
    tb = vb.get_slice(tidx)
    tG = head_rows(mG, t0, hv, BT)
    pG = vf.get_slice(tidx).partition_S(tG)
    pKs = tb.partition_S(sK)
    pVs = tb.partition_S(sV)
    pKd = tb.partition_D(sK)
    pVd = tb.partition_D(sV)
    gKg = tb.partition_D(head_rows(mKg, t0, hv, BT))
    coord = tb.partition_S(cute.make_identity_tensor((BT, K)))
    c0 = coord[0, 0, 0][1]
    glast = cute.make_rmem_tensor((8,), cutlass.Float32)
    for e in cutlass.range_constexpr(8):
        glast[e] = tG[n - 1, c0 + e].to(cutlass.Float32)
    fg = cute.make_fragment_like(pG)
    for m in cutlass.range_constexpr(cute.size(pG.shape[1])):
        if coord[0, m, 0][0] < n:
            cute.copy(vf, pG[None, m, None], fg[None, m, None])
    cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()
    fk = cute.make_fragment_like(pKs[None, 0, None])
    fv = cute.make_fragment_like(pKs[None, 0, None])
    fo = cute.make_fragment_like(pKs[None, 0, None])
    for m in cutlass.range_constexpr(cute.size(pG.shape[1])):
        row = coord[0, m, 0][0]
        if row < n:
            cute.copy(vb, pKs[None, m, None], fk)
            cute.copy(vb, pVs[None, m, None], fv)
            b = sBeta[row]
            fgm = fg[None, m, None]
            for e in cutlass.range_constexpr(8):
                g = fgm[e].to(cutlass.Float32)
                kk = fk[e].to(cutlass.Float32)
                fo[e] = (kk * cute.math.exp(glast[e] - g, fastmath=True)).to(cutlass.BFloat16)
                fk[e] = (b * kk * cute.math.exp(g, fastmath=True)).to(cutlass.BFloat16)
                fv[e] = (b * fv[e].to(cutlass.Float32)).to(cutlass.BFloat16)
            cute.copy(vb, fo, gKg[None, m, None])
            cute.copy(vb, fk, pKd[None, m, None])
            cute.copy(vb, fv, pVd[None, m, None])


@cute.jit
def wu_gemms(sA: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, t0, hv, n, tidx,
             threads: cutlass.Constexpr):
    """w = sA @ sK, u = sA @ sV (sA: Akk bf16 [64, 64]; sK, sV: [64, 128] token-major, read with ldmatrix.trans),
    4 warps along the rows. Each result is staged in the shared tile its GEMM no longer needs (w in sK, u in
    sV) and leaves in 16-byte rows < n. Call after a barrier that makes sA, sK, sV visible."""
    BT, K = 64, 128
    mma = tiled_mma(4)
    acc = cute.make_rmem_tensor(mma.get_slice(tidx).partition_shape_C((BT, K)), cutlass.Float32)
    acc.fill(0.0)
    gemm(mma, acc, sA, transposed(sK, BT, K), tidx, False, True)
    cute.arch.sync_threads()  # every warp is done reading sK
    store_acc_smem(mma, acc, sK, tidx)
    acc.fill(0.0)
    gemm(mma, acc, sA, transposed(sV, BT, K), tidx, False, True)
    cute.arch.sync_threads()  # w staged; every warp is done reading sV
    store_rows_s2g(sK, head_rows(mW, t0, hv, BT), n, tidx, threads)
    store_acc_smem(mma, acc, sV, tidx)
    cute.arch.sync_threads()
    store_rows_s2g(sV, head_rows(mU, t0, hv, BT), n, tidx, threads)
