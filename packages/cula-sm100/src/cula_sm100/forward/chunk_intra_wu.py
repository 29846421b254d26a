"""chunk_intra_wu: chunk_intra and recompute_w_u fused, one (chunk of 64, value head) per CTA.

    Aqk, Akk   exactly as chunk_intra.py (same arithmetic, same order: bitwise the same bf16 outputs)
    w  = Akk @ (beta k e^G)    u = Akk @ (beta v)    kg = k e^(G_last - G)     (as recompute_w_u.py)

Why: recompute_w_u re-reads from HBM what chunk_intra already holds in shared memory (k, G, beta, Akk: ~900 B of
its ~1.7 KB per token and value head); here it reads only v besides chunk_intra's own inputs.
GVA: q / k at head hv // (HV // HQK); G, beta, v at hv; every output in HV space. Rows past the chunk end are
never written.

Tiling: chunk_intra's (8 warps, 2 CTAs per SM, 128 registers per thread by the launch bound); the w / u GEMMs
split by warp group: warps 0-3 compute w, warps 4-7 u, each [64 x 64] @ [64 x 128] through mma.sync m16n8k16
with 4 warps along the rows, in two 64-column halves (32 accumulator registers; the right operand token-major,
read with ldmatrix.trans). The operand is the bf16-rounded Akk, as recompute_w_u reads it from global memory.

Shared memory (107.25 KiB: 2 CTAs per SM fit in the 228 KiB of an H100 / B200 SM; the limit is ~112 KiB):
  sQ 16 KiB, sK 16 KiB, sG 34 KiB (fp32 rows of 136), region R 41 KiB, beta. Lifetimes:
  * R: the decayed keys of the score GEMMs (40 KiB), then, once they are done, three pieces: bk = beta k e^G
    (bf16 [64, 128], the w GEMM's right operand), L / the solve's off-diagonal blocks (fp32, rows of 68) and Aqk
    (bf16 [64, 64], stored straight from the accumulators: chunk_intra keeps it in fp32 and rounds it at the end;
    the same value). Aqk in bf16 is what makes room for bk next to L (chunk_intra's fp32 Aqk took 16.3 KiB);
  * sG: G until bk, kg and the per-step decays are computed from it; the decays until the fp32 diagonal
    sub-blocks; then the solve's scratch (8.3 KiB) and, after the solve, the staging of u for its stores;
  * sK: k until the fp32 diagonal sub-blocks; then v (cp.async issued right after them, so its latency hides
    under the solve), scaled by beta in place;
  * sQ: q until the fp32 sub-blocks; then Akk in bf16 (the output's staging and the w / u GEMMs' left operand);
  * R's L piece, after the solve: the staging of w.
Pipeline: cp.async q, k, G; B of the scores, scores (chunk_intra); then, with G still intact, bk (into R) and kg
(16-byte stores to global memory) computed as recompute_w_u's scale_k_v does, from 16-byte vectors of k and G;
then the per-step decays, the fp32 sub-blocks, cp.async v, the solve, the bf16 stagings; stores of Aqk / Akk
while the two warp groups run the w / u GEMMs, then the stores of w and u.

The accumulators leave before the decays are computed, not after, which keeps the kernel free of spills
(registers and shared memory per architecture: docs/kernel_report.md).
Host side: launch.intra_wu_kernel (compiled per beta dtype and activation) and launch.chunk_intra_wu (the backward's
recompute; the forward runs chunk_intra_wu_gate). Outputs equal chunk_intra + recompute_w_u's bitwise (timings:
docs/benchmarks/intra_wu.md). chunk_intra.py and recompute_w_u.py stay: the backward's
recompute runs recompute_w_u alone when the forward's Aqk / Akk came with it, and the tests use the pair as this
kernel's oracle.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.chunk_intra import ChunkIntra
from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g, vec_copy
from cula_core.cute_kernels.warp_mma import (gemm, ldmatrix_copy_B, smem_tile_layout, store_acc_smem, tiled_mma,
                                             transposed)
from cula_sm100.forward.cute_utils import chunk_block, load_beta, LOG2E, token_layout


class ChunkIntraWU(ChunkIntra):
    """chunk_intra's tiling and helpers (build_slice, build_keys, store4 / load4), recompute_w_u's work added."""
    V = 128
    BK_BYTES = 64 * 128 * 2          # bk = beta k e^G, bf16 [BT, K], at the start of R
    L_BYTES = 64 * 68 * 4            # L, fp32 rows of L_STRIDE floats, after bk
    AQK_BYTES = 64 * 64 * 2          # Aqk, bf16 [BT, BT], after L (1024-aligned: 33 KiB into R)
    R_BYTES = BK_BYTES + L_BYTES + AQK_BYTES  # 41 KiB >= the score GEMMs' 10 blocks of decayed keys (40 KiB)
    # G's loads in a cp.async group of their own, waited for before q / k's, so fill_G runs while q / k are in flight
    # (the raw-gate subclass, whose fill_G computes the gate); False: one group, fill_G after every load
    G_FIRST = False

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, G_ptr: cute.Pointer,
                 beta_ptr: cute.Pointer, Aqk_ptr: cute.Pointer, Akk_ptr: cute.Pointer, w_ptr: cute.Pointer,
                 u_ptr: cute.Pointer, kg_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        mQ, mK, mV, mBeta, mAqk, mAkk, mW, mU, mKg, mT = self.io_tensors(
            q_ptr, k_ptr, v_ptr, beta_ptr, Aqk_ptr, Akk_ptr, w_ptr, u_ptr, kg_ptr, table_ptr, TT, NC, HQK, HV)
        mG = cute.make_tensor(G_ptr, token_layout(TT, HV, self.K))
        self.kernel(mQ, mK, mV, mG, mBeta, mAqk, mAkk, mW, mU, mKg, mT, HV // HQK, scale).launch(
            grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=self.MIN_CTAS,
            preferred_smem_carveout=100)

    @cute.jit
    def io_tensors(self, q_ptr, k_ptr, v_ptr, beta_ptr, Aqk_ptr, Akk_ptr, w_ptr, u_ptr, kg_ptr, table_ptr, TT, NC,
                   HQK, HV):
        """The global tensors of every input and output but the gate's: (q, k, v, beta, Aqk, Akk, w, u, kg, chunk
        table)."""
        K, V, BT = self.K, self.V, self.BT
        hq_k = token_layout(TT, HQK, K)
        hv_k = token_layout(TT, HV, K)
        hv_v = token_layout(TT, HV, V)
        hv_bt = token_layout(TT, HV, BT)
        return (cute.make_tensor(q_ptr, hq_k), cute.make_tensor(k_ptr, hq_k), cute.make_tensor(v_ptr, hv_v),
                cute.make_tensor(beta_ptr, token_layout(TT, HV, 1)), cute.make_tensor(Aqk_ptr, hv_bt),
                cute.make_tensor(Akk_ptr, hv_bt), cute.make_tensor(w_ptr, hv_k), cute.make_tensor(u_ptr, hv_v),
                cute.make_tensor(kg_ptr, hv_k),
                cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1))))

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mAqk: cute.Tensor, mAkk: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor,
               mT: cute.Tensor, group: cutlass.Int32, scale: cutlass.Float32):
        self.run((mG,), mQ, mK, mV, mBeta, mAqk, mAkk, mW, mU, mKg, mT, group, scale)

    @cute.jit
    def run(self, gate_in, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor, mAqk: cute.Tensor,
            mAkk: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mT: cute.Tensor, group, scale):
        """The kernel's body; `gate_in` is what the G hooks (load_G, fill_G, store_G) read: here (G,)."""
        K, BT = self.K, self.BT
        tidx, _, hv, t0, n = chunk_block(mT)
        wid = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        hq = hv // group

        smem = cutlass.utils.SmemAllocator()  # 107.25 KiB
        sQ = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K), 1024)
        sK = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K), 1024)
        # G rows padded by 8 floats (conflict-free A-fragment reads, as chunk_intra); 1024-aligned because u is
        # staged here (a swizzled bf16 tile) at the end
        sG = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT, K), stride=(self.G_STRIDE, 1)), 1024)
        r_raw = smem.allocate(self.R_BYTES, 1024)
        sBeta = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT,)), 16)

        if cutlass.const_expr(self.G_FIRST):
            self.load_G(gate_in, sG, r_raw, tidx, hv, t0, n)
            cute.arch.cp_async_commit_group()
        cp_bf16 = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp_bf16, head_rows(mQ, t0, hq, BT), sQ, n, tidx)
        copy_rows_g2s(cp_bf16, head_rows(mK, t0, hq, BT), sK, n, tidx)
        if cutlass.const_expr(not self.G_FIRST):
            self.load_G(gate_in, sG, r_raw, tidx, hv, t0, n)
        cute.arch.cp_async_commit_group()
        load_beta(sBeta, mBeta, t0, hv, n, tidx, self.beta_activation)
        cute.arch.cp_async_wait_group(1 if self.G_FIRST else 0)
        cute.arch.sync_threads()
        self.fill_G(gate_in, sG, r_raw, tidx, hv, n)
        if cutlass.const_expr(self.G_FIRST):
            cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self.store_G(gate_in, sQ, sG, tidx, hv, t0, n)
        self.fused_body(sQ, sK, sG, r_raw, sBeta, mV, mAqk, mAkk, mW, mU, mKg, tidx, wid, lane, hv, t0, n, scale)

    @cute.jit
    def load_G(self, gate_in, sG: cute.Tensor, r_raw: cute.Pointer, tidx, hv, t0, n):
        """Issue the cp.async of G's rows < n into sG (R is free until fused_body)."""
        mG, = gate_in
        copy_rows_g2s(g2s_tiled_copy(self.K, self.threads, cutlass.Float32), head_rows(mG, t0, hv, self.BT), sG, n,
                      tidx)

    @cute.jit
    def fill_G(self, gate_in, sG: cute.Tensor, r_raw: cute.Pointer, tidx, hv, n):
        """After the loads landed: rows past the chunk end repeat the last valid G (their q/k are zero): exponents
        stay <= 0. Thread = (channel, row parity); row n - 1 is never written here."""
        ch = tidx % self.K
        par = tidx // self.K
        for rr in cutlass.range_constexpr(self.BT // 2):
            r = 2 * rr + par
            if r >= n:
                sG[r, ch] = sG[n - 1, ch]

    @cute.jit
    def store_G(self, gate_in, sQ: cute.Tensor, sG: cute.Tensor, tidx, hv, t0, n):
        """After the barrier that follows fill_G (q in sQ and G in sG complete, both still intact): nothing here (G
        came from global memory)."""
        pass

    @cute.jit
    def fused_body(self, sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor, r_raw: cute.Pointer,
                   sBeta: cute.Tensor, mV: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor, mW: cute.Tensor,
                   mU: cute.Tensor, mKg: cute.Tensor, tidx, wid, lane, hv, t0, n, scale: cutlass.Float32):
        """Everything after the loads (sQ / sK: q / k rows, zero past the chunk end; sG: G, rows past the end
        repeating the last valid one; sBeta: activated beta). The score / solve steps are chunk_intra's
        scores_and_solve step for step; the differences are marked "fused"."""
        K, BT, BC = self.K, self.BT, self.BC
        w = wid // 2
        s = wid % 2
        r0 = w * BC
        sY = cute.make_tensor(cute.recast_ptr(r_raw, dtype=cutlass.BFloat16), smem_tile_layout(self.Y_BLOCKS * BC, K))
        r_bf16 = cute.recast_ptr(r_raw, dtype=cutlass.BFloat16)
        r_f32 = cute.recast_ptr(r_raw, dtype=cutlass.Float32)
        # fused: R after the score GEMMs = bk | L | Aqk (bf16)
        sBk = cute.make_tensor(r_bf16, smem_tile_layout(BT, K))
        sL = cute.make_tensor(r_f32 + self.BK_BYTES // 4, cute.make_layout((BT, BT), stride=(self.L_STRIDE, 1)))
        sAqk = cute.make_tensor(r_bf16 + (self.BK_BYTES + self.L_BYTES) // 2, smem_tile_layout(BT, BT))
        sD = cute.make_tensor(sG.iterator, cute.make_layout((4, BC, BC), stride=(BC * self.D_STRIDE, self.D_STRIDE, 1)))
        sTmp = cute.make_tensor(sG.iterator + 4 * BC * self.D_STRIDE,
                                cute.make_layout((BC, 3 * BC), stride=(self.TMP_STRIDE, 1)))

        # ---- decay span of the row block: the diagonal block's GEMM takes all 16 columns when mild
        span = cutlass.Float32(0.0)
        for e in cutlass.range_constexpr(4):
            span = cute.arch.fmax(span, sG[r0, lane * 4 + e] - sG[r0 + BC - 1, lane * 4 + e])
        for sh in cutlass.range_constexpr(5):
            span = cute.arch.fmax(span, cute.arch.shuffle_sync_bfly(span, 1 << sh))
        mild = span * LOG2E < 100.0
        half_rows = BC // 2
        lo = half_rows
        hi = half_rows
        if mild:
            lo = 0
            hi = BC

        # ---- B of the scores: the pair's decayed keys k_j exp2(G_ref - G_j)
        gref = cute.make_rmem_tensor((4,), cutlass.Float32)
        gdia = cute.make_rmem_tensor((4,), cutlass.Float32)
        self.load4(sG, r0, lane, gref)
        self.load4(sG, r0 + lo, lane, gdia)
        for e in cutlass.range_constexpr(4):
            gref[e] = gref[e] * LOG2E
            gdia[e] = gdia[e] * LOG2E
        gv = cute.make_rmem_tensor((4,), cutlass.Float32)
        kv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        yv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        yb0 = w * (w + 1) // 2
        gsel = cute.make_rmem_tensor((4,), cutlass.Float32)
        for it in cutlass.range(2, unroll=1):
            nt = s + 2 * it
            if nt <= w:
                rows = hi
                for e in cutlass.range_constexpr(4):
                    gsel[e] = gdia[e]
                if nt < w:
                    rows = BC
                    for e in cutlass.range_constexpr(4):
                        gsel[e] = gref[e]
                self.build_keys(sG, sK, cute.local_tile(sY, (BC, K), (yb0 + nt, 0)), nt * BC, gsel, rows, lane,
                                gv, kv, yv)
        sX = sQ
        if s == 1:
            sX = sK
        cute.arch.sync_threads()

        # ---- scores by warp-level MMA (chunk_intra's loop)
        mma = tiled_mma(1)
        thr = mma.get_slice(lane)
        rA = cute.make_rmem_tensor(thr.partition_shape_A((BC, K)), cutlass.BFloat16)
        rAd = cute.make_rmem_tensor(thr.partition_shape_A((BC, K)), cutlass.BFloat16)
        cA = thr.partition_A(cute.make_identity_tensor((BC, K)))
        cB = ldmatrix_copy_B(mma, cutlass.BFloat16, False)
        tB = cB.get_slice(lane)
        rB = thr.make_fragment_B(thr.partition_B(cute.local_tile(sY, (BC, K), (0, 0))))
        rBv = tB.retile(rB)
        accs = [cute.make_rmem_tensor(thr.partition_shape_C((BC, BC)), cutlass.Float32) for _ in range(4)]
        for nt in cutlass.range_constexpr(4):
            accs[nt].fill(0.0)
        for kb in cutlass.range_constexpr(K // 16):
            self.build_slice(rA[None, None, kb], rAd[None, None, kb], cA[None, None, kb], sX, sG, r0, lo, mild)
            for nt in cutlass.range_constexpr(4):
                sBp = tB.partition_S(cute.local_tile(sY, (BC, K), (yb0 + nt, 0)))
                if nt < w:
                    cute.copy(cB, sBp[None, None, kb], rBv[None, None, kb])
                    cute.gemm(mma, accs[nt], rA[None, None, kb], rB[None, None, kb], accs[nt])
                if nt == w:
                    cute.copy(cB, sBp[None, None, kb], rBv[None, None, kb])
                    cute.gemm(mma, accs[nt], rAd[None, None, kb], rB[None, None, kb], accs[nt])
        cute.arch.sync_threads()  # every GEMM is done with R (the decayed keys)

        # ---- fused: the accumulators go out now (R is free), Aqk straight to bf16 (chunk_intra rounds the same
        #      fp32 value at its end); then bk and kg from G, before the decays overwrite it
        coord = thr.partition_C(cute.make_identity_tensor((BC, BC)))
        for nt in cutlass.range_constexpr(4):
            if nt < w:
                self.store_side_bf16(accs[nt], coord, sAqk, sL, sBeta, s, r0, nt * BC, 0, BC, scale)
            if nt == w:
                self.store_side_bf16(accs[nt], coord, sAqk, sL, sBeta, s, r0, nt * BC, lo, hi, scale)
        self.scale_k_kg(sK, sG, sBeta, sBk, mKg, tidx, hv, t0, n)
        ch = tidx % K
        par = tidx // K
        g_edge = sG[BT // 2 - 1, ch]
        cute.arch.sync_threads()  # fused: every read of G is done

        # ---- per-step decays a_t = exp(G_t - G_{t-1}) in place of G (chunk_intra's)
        if par == 1:
            for tt in cutlass.range_constexpr(BT // 2 - 1):
                t = BT - 1 - tt
                sG[t, ch] = cute.math.exp2((sG[t, ch] - sG[t - 1, ch]) * LOG2E, fastmath=True)
            sG[BT // 2, ch] = cute.math.exp2((sG[BT // 2, ch] - g_edge) * LOG2E, fastmath=True)
        else:
            for tt in cutlass.range_constexpr(BT // 2 - 1):
                t = BT // 2 - 1 - tt
                sG[t, ch] = cute.math.exp2((sG[t, ch] - sG[t - 1, ch]) * LOG2E, fastmath=True)
        cute.arch.sync_threads()  # the decays are in place

        # ---- diagonal 8 x 8 sub-block s in fp32 when not mild (chunk_intra's)
        self.diag_fp32(sQ, sK, sG, sAqk, sL, sBeta, lane, r0, s, mild, scale)
        cute.arch.sync_threads()  # fused: q and k are no longer read

        # ---- fused: v into sK now; its latency hides under the solve
        copy_rows_g2s(g2s_tiled_copy(K, self.threads), head_rows(mV, t0, hv, BT), sK, n, tidx)
        cute.arch.cp_async_commit_group()

        self.solve(sL, sD, sTmp, tidx, lane, w, s, r0)

        # ---- stagings: Akk bf16 where q was (zeros above the diagonal), Aqk's upper triangle zeroed; beta v
        sAkk = cute.make_tensor(sQ.iterator, smem_tile_layout(BT, BT))
        for m in cutlass.range_constexpr(BT * BT // self.threads):
            e = tidx + self.threads * m
            ei = e // BT
            ej = e % BT
            xo = cutlass.Float32(0.0)
            if ej <= ei:
                if ei // BC == ej // BC:
                    xo = sD[ei // BC, ei % BC, ej % BC]
                else:
                    xo = sL[ei, ej]
            else:
                sAqk[ei, ej] = cutlass.BFloat16(0.0)
            sAkk[ei, ej] = xo.to(cutlass.BFloat16)
        # each thread scales the very vectors it copied (scale_v's thread mapping is the cp.async's), so its own
        # wait suffices before; one barrier then publishes v and both stagings
        cute.arch.cp_async_wait_group(0)
        self.scale_v(sK, sBeta, tidx, n)
        cute.arch.sync_threads()

        store_rows_s2g(sAqk, head_rows(mAqk, t0, hv, BT), n, tidx, self.threads)
        store_rows_s2g(sAkk, head_rows(mAkk, t0, hv, BT), n, tidx, self.threads)
        # ---- w (warps 0-3) and u (warps 4-7): Akk (bf16) @ right operand, staged for 16-byte stores: w where L
        #      was, u where G was (both free after the stagings above)
        sWo = cute.make_tensor(r_bf16 + self.BK_BYTES // 2, smem_tile_layout(BT, K))
        sUo = cute.make_tensor(cute.recast_ptr(sG.iterator, dtype=cutlass.BFloat16), smem_tile_layout(BT, K))
        grp = wid // 4
        sRhs = sBk
        sOut = sWo
        if grp == 1:
            sRhs = sK
            sOut = sUo
        self.wu_gemm(sAkk, sRhs, sOut, tidx % 128)
        cute.arch.sync_threads()
        store_rows_s2g(sWo, head_rows(mW, t0, hv, BT), n, tidx, self.threads)
        store_rows_s2g(sUo, head_rows(mU, t0, hv, BT), n, tidx, self.threads)

    @cute.jit
    def scale_k_kg(self, sK: cute.Tensor, sG: cute.Tensor, sBeta: cute.Tensor, sBk: cute.Tensor, mKg: cute.Tensor,
                   tidx, hv, t0, n):
        """sBk = beta k e^G (bf16; zero past the chunk end: k and beta are zero there, G is finite), kg = k
        e^(G_last - G) to global memory for rows < n: recompute_w_u's scale_k_v arithmetic (same expressions, same
        rounding), from k / G in shared memory. 8 channels per thread in 16-byte vectors."""
        BT, K = self.BT, self.K
        vb = vec_copy(K, self.threads)
        vf = vec_copy(K, self.threads, cutlass.Float32)
        tb = vb.get_slice(tidx)
        pK = tb.partition_S(sK)
        pBk = tb.partition_D(sBk)
        pG = vf.get_slice(tidx).partition_S(sG)
        gKg = tb.partition_D(head_rows(mKg, t0, hv, BT))
        coord = tb.partition_S(cute.make_identity_tensor((BT, K)))
        c0 = coord[0, 0, 0][1]
        glast = cute.make_rmem_tensor((8,), cutlass.Float32)
        for e in cutlass.range_constexpr(8):
            glast[e] = sG[n - 1, c0 + e]
        fk = cute.make_fragment_like(pK[None, 0, None])
        fo = cute.make_fragment_like(pK[None, 0, None])
        fg = cute.make_fragment_like(pG[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(pK.shape[1])):
            row = coord[0, m, 0][0]
            cute.copy(vb, pK[None, m, None], fk)
            cute.copy(vf, pG[None, m, None], fg)
            b = sBeta[row]
            for e in cutlass.range_constexpr(8):
                g = fg[e]
                kk = fk[e].to(cutlass.Float32)
                fo[e] = (kk * cute.math.exp(glast[e] - g, fastmath=True)).to(cutlass.BFloat16)
                fk[e] = (b * kk * cute.math.exp(g, fastmath=True)).to(cutlass.BFloat16)
            cute.copy(vb, fk, pBk[None, m, None])
            if row < n:
                cute.copy(vb, fo, gKg[None, m, None])

    @cute.jit
    def scale_v(self, sV: cute.Tensor, sBeta: cute.Tensor, tidx, n):
        """sV = beta v in place (bf16, as recompute_w_u); rows >= n stay zero. The thread -> (row, 8 channels)
        mapping is g2s_tiled_copy's for the same tile (16 threads per 128-wide row), so a thread reads only what
        its own cp.async wrote."""
        BT, K = self.BT, self.K
        vb = vec_copy(K, self.threads)
        tb = vb.get_slice(tidx)
        pS = tb.partition_S(sV)
        pD = tb.partition_D(sV)
        coord = tb.partition_S(cute.make_identity_tensor((BT, K)))
        fv = cute.make_fragment_like(pS[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(pS.shape[1])):
            row = coord[0, m, 0][0]
            if row < n:
                cute.copy(vb, pS[None, m, None], fv)
                b = sBeta[row]
                for e in cutlass.range_constexpr(8):
                    fv[e] = (b * fv[e].to(cutlass.Float32)).to(cutlass.BFloat16)
                cute.copy(vb, fv, pD[None, m, None])

    @cute.jit
    def wu_gemm(self, sA: cute.Tensor, sRhs: cute.Tensor, sOut: cute.Tensor, t128):
        """sOut = sA @ sRhs (sA: Akk bf16 [64, 64]; sRhs: [64 tokens, 128] token-major, read with ldmatrix.trans),
        4 warps along the rows (t128: thread index in the warp group), in two 64-column halves; the k-blocks in
        the order recompute_w_u's wu_gemms takes them, so each output element sums the same products in the same
        order."""
        BT, K = self.BT, self.K
        half = K // 2
        mma = tiled_mma(4)
        acc = cute.make_rmem_tensor(mma.get_slice(t128).partition_shape_C((BT, half)), cutlass.Float32)
        rhs_t = transposed(sRhs, BT, K)  # (K channels, BT tokens)
        for hh in cutlass.range_constexpr(2):
            acc.fill(0.0)
            gemm(mma, acc, sA, cute.local_tile(rhs_t, (half, BT), (hh, 0)), t128, False, True, unroll_k=False)
            store_acc_smem(mma, acc, cute.local_tile(sOut, (BT, half), (0, hh)), t128)

    @cute.jit
    def diag_fp32(self, sQ, sK, sG, sAqk, sL, sBeta, lane, r0, s, mild, scale):
        """chunk_intra's fp32 diagonal 8 x 8 sub-block s (not mild): lane (c, h) carries the decayed key of column
        base + c over channels 16 m + 4 h + e, z_j(i) = k_j a_{j+1} ... a_i (a: the per-step decays in sG);
        writes Aqk (bf16 here) and L for columns c <= the row."""
        half_rows = self.BC // 2
        c = lane % half_rows
        h = lane // half_rows
        base = r0 + s * half_rows
        z = cute.make_rmem_tensor((32,), cutlass.Float32)
        z.fill(0.0)
        av = cute.make_rmem_tensor((4,), cutlass.Float32)
        kv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        qv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        n_diag = half_rows
        if mild:
            n_diag = 0
        for ii in cutlass.range(n_diag, unroll=1):
            row = base + ii
            aq = cute.make_rmem_tensor((4,), cutlass.Float32)
            ak = cute.make_rmem_tensor((4,), cutlass.Float32)
            aq.fill(0.0)
            ak.fill(0.0)
            for m in cutlass.range_constexpr(8):
                self.load4(sG, row, 4 * m + h, av)
                self.load4(sK, row, 4 * m + h, kv)
                self.load4(sQ, row, 4 * m + h, qv)
                for e in cutlass.range_constexpr(4):
                    z[4 * m + e] = z[4 * m + e] * av[e]
                if c == ii:
                    for e in cutlass.range_constexpr(4):
                        z[4 * m + e] = kv[e].to(cutlass.Float32)
                for e in cutlass.range_constexpr(4):
                    aq[e] += qv[e].to(cutlass.Float32) * z[4 * m + e]
                    ak[e] += kv[e].to(cutlass.Float32) * z[4 * m + e]
            sq = (aq[0] + aq[1]) + (aq[2] + aq[3])
            sk = (ak[0] + ak[1]) + (ak[2] + ak[3])
            for sh in cutlass.range_constexpr(2):
                sq += cute.arch.shuffle_sync_bfly(sq, half_rows << sh)
                sk += cute.arch.shuffle_sync_bfly(sk, half_rows << sh)
            if h == 0:
                if c <= ii:
                    sAqk[row, base + c] = (sq * scale).to(cutlass.BFloat16)
                    sL[row, base + c] = sk * sBeta[row]

    @cute.jit
    def solve(self, sL, sD, sTmp, tidx, lane, w, s, r0):
        """chunk_intra's solve of (I + L)^-1: the diagonal blocks' inverses into sD (forward substitution, warp
        2 w, lane = column), then the off-diagonal blocks row block by row block into sL. Ends with a barrier."""
        BC = self.BC
        if s == 0:
            if lane < BC:
                x = cute.make_rmem_tensor((BC,), cutlass.Float32)
                for j in cutlass.range_constexpr(BC):
                    x[j] = cutlass.Float32(0.0)
                    if j == lane:
                        x[j] = cutlass.Float32(1.0)
                for di in cutlass.range_constexpr(1, BC):
                    dsum = cutlass.Float32(0.0)
                    for j in cutlass.range_constexpr(di):
                        dsum += sL[r0 + di, r0 + j] * x[j]
                    if di > lane:
                        x[di] = -dsum
                for di in cutlass.range_constexpr(BC):
                    sD[w, di, lane] = x[di]
        cute.arch.sync_threads()
        oi = tidx // BC
        oj = tidx % BC
        lrow = cute.make_rmem_tensor((4,), cutlass.Float32)
        for p in cutlass.range_constexpr(1, 4):
            for q in cutlass.range_constexpr(p):
                osum = cutlass.Float32(0.0)
                for r in cutlass.range_constexpr(q, p):
                    for x4 in cutlass.range_constexpr(BC // 4):
                        self.load4(sL, p * BC + oi, r * (BC // 4) + x4, lrow)
                        for e in cutlass.range_constexpr(4):
                            xx = 4 * x4 + e
                            if cutlass.const_expr(r == q):
                                osum += lrow[e] * sD[q, xx, oj]
                            else:
                                osum += lrow[e] * sL[r * BC + xx, q * BC + oj]
                sTmp[oi, q * BC + oj] = osum
            cute.arch.sync_threads()
            for q in cutlass.range_constexpr(p):
                osum = cutlass.Float32(0.0)
                for x4 in cutlass.range_constexpr(BC // 4):
                    self.load4(sD[p, None, None], oi, x4, lrow)
                    for e in cutlass.range_constexpr(4):
                        osum += lrow[e] * sTmp[4 * x4 + e, q * BC + oj]
                sL[p * BC + oi, q * BC + oj] = -osum
            cute.arch.sync_threads()

    @cute.jit
    def store_side_bf16(self, acc, coord, sAqk, sL, sBeta, s, r0, c0, lo, hi, scale):
        """chunk_intra's store_side with Aqk rounded to bf16 here: rows r0 + r (r >= lo), columns c0 + c (c < hi)
        of the q side (times scale) into sAqk or of the k side (times the row's beta) into sL."""
        for v in cutlass.range_constexpr(cute.size(acc)):
            r, c = coord[v]
            if r >= lo:
                if c < hi:
                    if s == 0:
                        sAqk[r0 + r, c0 + c] = (acc[v] * scale).to(cutlass.BFloat16)
                    else:
                        sL[r0 + r, c0 + c] = acc[v] * sBeta[r0 + r]
