"""chunk_intra: the intra-chunk score matrices of KDA for one (chunk of 64, value head) per CTA.

    Aqk[i, j] = scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])       (j <= i, else 0)
    L[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j <  i, else 0)
    Akk       = (I + L)^{-1}                                           (unit lower triangular)

GVA: the CTA of value head hv reads q/k at head hv // (HV // HQK); G and beta at hv; writes in HV space.

Tiling (4 warps, warp w owns rows n..n+15 of the chunk, n = 16w; 104 KiB of shared memory, 2 CTAs per SM):
  * scores by warp-level MMA (mma.sync m16n8k16, bf16 operands, fp32 accumulation), one GEMM per column block
    b <= w: A = [q_i e^{G_i - G_n}; k_i e^{G_i - G_n}] (32 x 128) held as MMA register fragments (built element
    by element at the fragment's coordinates, never in shared memory), B = [k_j e^{G_n - G_j}] (16 x 128 per
    block, shared memory, built with 16-byte / 8-byte vector accesses). For j < n both exponents are <= 0 (the
    reference's factorisation: no overflow however strong the decay). The accumulators stay in registers
    until a barrier frees the region that held B, where the fp32 score matrices then go (region R, 40 KiB);
  * the diagonal block: "mild" (decay span under 2^100 over the block) -> the same GEMM with all 16 columns;
    otherwise it is split in 8 x 8 sub-blocks: the lower-left one by the GEMM with reference row n + 8 (both
    factors <= 1: A rows >= n + 8, B columns < n + 8, the rest zeroed), the two diagonal ones in exact fp32 on
    CUDA cores: exp(G_i - G_j) as the running product of per-step decays a_t = exp(g_t) <= 1, one multiply per
    (row step, channel) and no exp per pair; lane (8 sub-block x column, half of the channels), 8 serial steps;
  * the solve, in fp32: each warp inverts its diagonal block by forward substitution (one lane per
    column), then the off-diagonal blocks row block by row block, X_pq = -X_pp sum_r L_pr X_rq.
Pipeline: cp.async q/k (zero rows past the chunk end) and G (rows past the end repeat the last valid one,
so every exponent stays <= 0), build operands, MMA, per-step decays, fp32 sub-blocks, solve; Aqk and Akk
staged as bf16 where q was, then 16-byte stores of rows < n.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import (LOG2E, chunk_block, copy_rows_g2s, g2s_tiled_copy, gemm_rs, head_rows,
                                          load_beta, make_tiled_mma, smem_layout, store_rows_s2g, token_layout)


class ChunkIntra:
    BT = 64
    BC = 16
    K = 128
    threads = 128
    Y_BLOCKS = 10  # 16-row blocks of decayed keys: warp w holds w + 1 of them (1 + 2 + 3 + 4)

    def __init__(self, beta_activation: str):
        self.beta_activation = beta_activation

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, G_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 Aqk_ptr: cute.Pointer, Akk_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        K, BT = self.K, self.BT
        mQ = cute.make_tensor(q_ptr, token_layout(TT, HQK, K))
        mK = cute.make_tensor(k_ptr, token_layout(TT, HQK, K))
        mG = cute.make_tensor(G_ptr, token_layout(TT, HV, K))
        mBeta = cute.make_tensor(beta_ptr, token_layout(TT, HV, 1))
        mAqk = cute.make_tensor(Aqk_ptr, token_layout(TT, HV, BT))
        mAkk = cute.make_tensor(Akk_ptr, token_layout(TT, HV, BT))
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(mQ, mK, mG, mBeta, mAqk, mAkk, mT, HV // HQK, scale).launch(
            grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAqk: cute.Tensor,
               mAkk: cute.Tensor, mT: cute.Tensor, group: cutlass.Int32, scale: cutlass.Float32):
        K, BT = self.K, self.BT
        tidx, _, hv, t0, n = chunk_block(mT)
        w = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        hq = hv // group  # GVA: q / k at the value head's q/k head

        smem = cutlass.utils.SmemAllocator()  # 104 KiB
        sQ = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 1024)
        sK = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 1024)
        sG = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT, K), stride=(K, 1)), 128)
        # region R (40 KiB), in turn: the decayed keys of every warp (warp w: blocks 0..w, 16 rows each, from
        # block w (w + 1) / 2 on), then the fp32 score matrices and the solve's scratch
        r_raw = smem.allocate(self.Y_BLOCKS * self.BC * K * 2, 1024)
        sBeta = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT,)), 16)

        # ---- loads: q / k (zero rows past the chunk end), G, beta
        cp_bf16 = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp_bf16, head_rows(mQ, t0, hq, BT), sQ, n, tidx)
        copy_rows_g2s(cp_bf16, head_rows(mK, t0, hq, BT), sK, n, tidx)
        copy_rows_g2s(g2s_tiled_copy(K, self.threads, cutlass.Float32), head_rows(mG, t0, hv, BT), sG, n, tidx)
        cute.arch.cp_async_commit_group()
        load_beta(sBeta, mBeta, t0, hv, n, tidx, self.beta_activation)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        # rows past the chunk end repeat the last valid G (their q/k are zero): exponents stay <= 0
        for r in cutlass.range_constexpr(BT):
            if r >= n:
                sG[r, tidx] = sG[n - 1, tidx]
        cute.arch.sync_threads()
        self.scores_and_solve(sQ, sK, sG, r_raw, sBeta, mAqk, mAkk, tidx, w, lane, hv, t0, n, scale)

    @cute.jit
    def scores_and_solve(self, sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor, r_raw: cute.Pointer,
                         sBeta: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor, tidx, w, lane, hv, t0, n,
                         scale: cutlass.Float32):
        """Everything after the loads: sQ / sK hold the chunk's (normalised) q / k rows, zero past its end; sG its
        G, rows past the end repeating the last valid one; sBeta the activated beta. Writes Aqk and Akk."""
        K, BT, BC = self.K, self.BT, self.BC
        r0 = w * BC
        sY = cute.make_tensor(cute.recast_ptr(r_raw, dtype=cutlass.BFloat16), smem_layout(self.Y_BLOCKS * BC, K))
        r_f32 = cute.recast_ptr(r_raw, dtype=cutlass.Float32)
        # fp32 score matrices; odd row stride (65) keeps column walks conflict-free
        sA = cute.make_tensor(r_f32, cute.make_layout((BT, BT), stride=(BT + 1, 1)))
        sL = cute.make_tensor(r_f32 + BT * (BT + 1), cute.make_layout((BT, BT), stride=(BT + 1, 1)))
        sD = cute.make_tensor(r_f32 + 2 * BT * (BT + 1),
                              cute.make_layout((4, BC, BC), stride=(BC * (BC + 1), BC + 1, 1)))
        sTmp = cute.make_tensor(r_f32 + 2 * BT * (BT + 1) + 4 * BC * (BC + 1),
                                cute.make_layout((BC, 3 * BC), stride=(3 * BC + 1, 1)))

        # ---- the diagonal block. When its decay span keeps exp(G_n - G_j) <= 2^100 (no overflow in bf16 / fp32;
        #      the factors of earlier columns are <= 1 anyway) the GEMM takes all of it ("mild" below). Otherwise it
        #      is split in 8 x 8 sub-blocks: the lower-left one by the GEMM with reference row n + 8 (both factors
        #      <= 1 for rows >= n + 8 against columns < n + 8), the two diagonal ones in exact fp32 further down.
        span = cutlass.Float32(0.0)
        for e in cutlass.range_constexpr(4):
            span = cute.arch.fmax(span, sG[r0, lane * 4 + e] - sG[r0 + BC - 1, lane * 4 + e])
        for sh in cutlass.range_constexpr(5):
            span = cute.arch.fmax(span, cute.arch.shuffle_sync_bfly(span, 1 << sh))
        mild = span * LOG2E < 100.0
        half_rows = BC // 2
        lo = half_rows  # A rows from lo on, B rows (columns) before hi take part in the diagonal block's GEMM
        hi = half_rows
        if mild:
            lo = 0
            hi = BC

        # ---- operands, in log2 units. B (shared): the warp's decayed keys k_j exp(G_n - G_j), n = 16 w, lane
        #      = 4 channels, 16-byte / 8-byte vectors. A (registers, never in shared memory): the MMA fragment of
        #      [q_i; k_i] exp(G_i - G_n) for the warp's 16 rows, built element by element at its coordinates.
        gref = cute.make_rmem_tensor((4,), cutlass.Float32)
        gdia = cute.make_rmem_tensor((4,), cutlass.Float32)  # the diagonal block's reference (n or n + 8)
        self.load4(sG, r0, lane, gref)
        self.load4(sG, r0 + lo, lane, gdia)  # n when mild, else n + 8
        for e in cutlass.range_constexpr(4):
            gref[e] = gref[e] * LOG2E
            gdia[e] = gdia[e] * LOG2E
        gv = cute.make_rmem_tensor((4,), cutlass.Float32)
        kv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        yv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        yb0 = w * (w + 1) // 2
        for nt in cutlass.range_constexpr(4):
            if nt < w:
                self.build_keys(sG, sK, cute.local_tile(sY, (BC, K), (yb0 + nt, 0)), nt * BC, gref, BC, lane,
                                gv, kv, yv)
            if nt == w:
                self.build_keys(sG, sK, cute.local_tile(sY, (BC, K), (yb0 + nt, 0)), nt * BC, gdia, hi, lane,
                                gv, kv, yv)
        mma = make_tiled_mma(1)
        thr = mma.get_slice(lane)
        rA = cute.make_rmem_tensor(thr.partition_shape_A((2 * BC, K)), cutlass.BFloat16)
        cA = thr.partition_A(cute.make_identity_tensor((2 * BC, K)))
        self.build_rows(rA, cA, sQ, sK, sG, r0, r0, 0)
        cute.arch.sync_threads()  # every warp's B operand is built

        # ---- scores of the warp's rows against each column block up to its own, by warp-level MMA, held in
        #      registers until region R is free
        accs = [cute.make_rmem_tensor(thr.partition_shape_C((2 * BC, BC)), cutlass.Float32) for _ in range(4)]
        for nt in cutlass.range_constexpr(4):
            accs[nt].fill(0.0)
            if nt < w:
                gemm_rs(mma, accs[nt], rA, cute.local_tile(sY, (BC, K), (yb0 + nt, 0)), lane, False)
        if not mild:  # the diagonal block's A: reference row n + 8, rows before it zero
            self.build_rows(rA, cA, sQ, sK, sG, r0, r0 + half_rows, half_rows)
        for nt in cutlass.range_constexpr(4):
            if nt == w:
                gemm_rs(mma, accs[nt], rA, cute.local_tile(sY, (BC, K), (yb0 + nt, 0)), lane, False)
        cute.arch.sync_threads()  # every warp is done reading G
        # ---- per-step decays a_t = exp(g_t) = exp(G_t - G_{t-1}), in place of G (no longer needed); descending t
        #      so that G_{t-1} is read before it is overwritten. Rows past the end repeat G: a = 1 there.
        for tt in cutlass.range_constexpr(BT - 1):
            t = BT - 1 - tt
            sG[t, tidx] = cute.math.exp2((sG[t, tidx] - sG[t - 1, tidx]) * LOG2E, fastmath=True)
        cute.arch.sync_threads()  # every GEMM is done with R; the decays are in place
        coord = thr.partition_C(cute.make_identity_tensor((2 * BC, BC)))
        for nt in cutlass.range_constexpr(4):
            if nt < w:
                self.store_scores(accs[nt], coord, sA, sL, sBeta, r0, nt * BC, 0, BC, scale)
            if nt == w:
                self.store_scores(accs[nt], coord, sA, sL, sBeta, r0, nt * BC, lo, hi, scale)

        # ---- diagonal 8 x 8 sub-blocks in fp32 (not mild), exact for any decay: lane (jl, half), jl = 8 sb + c,
        #      carries the decayed key of column j = n + 8 sb + c over its 64 channels, z_j(i) = k_j a_{j+1} ... a_i
        #      (one multiply per row step, no exp, every factor <= 1), and dots it with q_i and k_i; the halves add
        #      by one shuffle. Channels of lane half h: 8 m + 4 h + e (m < 16, e < 4), read as 4-element vectors.
        jl = lane % BC
        half = lane // BC
        col = jl % half_rows
        base = r0 + (jl // half_rows) * half_rows
        z = cute.make_rmem_tensor((64,), cutlass.Float32)
        z.fill(0.0)
        av = cute.make_rmem_tensor((4,), cutlass.Float32)
        qv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        n_diag = half_rows
        if mild:
            n_diag = 0  # warp-uniform: this warp's diagonal block came from the GEMM
        for ii in cutlass.range(n_diag, unroll=1):  # runtime loop: small code, quick compilation
            row = base + ii
            aq = cute.make_rmem_tensor((4,), cutlass.Float32)
            ak = cute.make_rmem_tensor((4,), cutlass.Float32)
            aq.fill(0.0)
            ak.fill(0.0)
            for m in cutlass.range_constexpr(16):
                # at ii = 0 every z is still 0, so multiplying by row `base`'s entry (G_0 itself at row 0) is harmless
                self.load4(sG, row, 2 * m + half, av)
                self.load4(sK, row, 2 * m + half, kv)
                self.load4(sQ, row, 2 * m + half, qv)
                for e in cutlass.range_constexpr(4):
                    z[4 * m + e] = z[4 * m + e] * av[e]
                if col == ii:
                    for e in cutlass.range_constexpr(4):
                        z[4 * m + e] = kv[e].to(cutlass.Float32)
                for e in cutlass.range_constexpr(4):
                    aq[e] += qv[e].to(cutlass.Float32) * z[4 * m + e]
                    ak[e] += kv[e].to(cutlass.Float32) * z[4 * m + e]
            sq = (aq[0] + aq[1]) + (aq[2] + aq[3])
            sk = (ak[0] + ak[1]) + (ak[2] + ak[3])
            sq += cute.arch.shuffle_sync_bfly(sq, BC)
            sk += cute.arch.shuffle_sync_bfly(sk, BC)
            if half == 0:
                if col <= ii:
                    sA[row, base + col] = sq * scale
                    sL[row, base + col] = sk * sBeta[row]  # the diagonal entry is written but never read
        cute.arch.sync_threads()

        # ---- solve: diagonal block inverses (lane = column), fp32
        if lane < BC:
            x = cute.make_rmem_tensor((BC,), cutlass.Float32)
            for j in cutlass.range_constexpr(BC):
                x[j] = cutlass.Float32(0.0)
                if j == lane:
                    x[j] = cutlass.Float32(1.0)
            for i in cutlass.range_constexpr(1, BC):
                s = cutlass.Float32(0.0)
                for j in cutlass.range_constexpr(i):
                    s += sL[r0 + i, r0 + j] * x[j]
                if i > lane:
                    x[i] = -s
            for i in cutlass.range_constexpr(BC):
                sD[w, i, lane] = x[i]
        cute.arch.sync_threads()

        # ---- solve: off-diagonal blocks, row block p after row block p - 1 (X overwrites L there)
        for p in cutlass.range_constexpr(1, 4):
            for q in cutlass.range_constexpr(p):
                for m in cutlass.range_constexpr(2):
                    e = tidx + 128 * m
                    i = e // BC
                    jj = e % BC
                    s = cutlass.Float32(0.0)
                    for r in cutlass.range_constexpr(q, p):
                        for xx in cutlass.range_constexpr(BC):
                            if cutlass.const_expr(r == q):
                                s += sL[p * BC + i, r * BC + xx] * sD[q, xx, jj]
                            else:
                                s += sL[p * BC + i, r * BC + xx] * sL[r * BC + xx, q * BC + jj]
                    sTmp[i, q * BC + jj] = s
            cute.arch.sync_threads()
            for q in cutlass.range_constexpr(p):
                for m in cutlass.range_constexpr(2):
                    e = tidx + 128 * m
                    i = e // BC
                    jj = e % BC
                    s = cutlass.Float32(0.0)
                    for xx in cutlass.range_constexpr(BC):
                        s += sD[p, i, xx] * sTmp[xx, q * BC + jj]
                    sL[p * BC + i, q * BC + jj] = -s
            cute.arch.sync_threads()

        # ---- stores: bf16 tiles staged where q was (free now), zeros above the diagonal, then 16-byte rows < n
        sAqk_o = cute.make_tensor(sQ.iterator, smem_layout(BT, BT))
        sAkk_o = cute.make_tensor(sQ.iterator + BT * BT, smem_layout(BT, BT))
        for m in cutlass.range_constexpr(BT * BT // self.threads):
            e = tidx + self.threads * m
            i = e // BT
            j = e % BT
            a = cutlass.Float32(0.0)
            x = cutlass.Float32(0.0)
            if j <= i:
                a = sA[i, j]
                if i // BC == j // BC:
                    x = sD[i // BC, i % BC, j % BC]
                else:
                    x = sL[i, j]
            sAqk_o[i, j] = a.to(cutlass.BFloat16)
            sAkk_o[i, j] = x.to(cutlass.BFloat16)
        cute.arch.sync_threads()
        store_rows_s2g(sAqk_o, head_rows(mAqk, t0, hv, BT), n, tidx, self.threads)
        store_rows_s2g(sAkk_o, head_rows(mAkk, t0, hv, BT), n, tidx, self.threads)

    @cute.jit
    def build_keys(self, sG, sK, sYb, j0, gref, rows, lane, gv, kv, yv):
        """sYb[i] = k_{j0+i} exp2(gref - G_{j0+i}) for i < rows, 0 after (lane: 4 channels, vector accesses)."""
        for i in cutlass.range_constexpr(self.BC):
            yv.fill(0.0)
            if i < rows:
                self.load4(sG, j0 + i, lane, gv)
                self.load4(sK, j0 + i, lane, kv)
                for e in cutlass.range_constexpr(4):
                    yv[e] = (kv[e].to(cutlass.Float32) * cute.math.exp2(gref[e] - gv[e] * LOG2E, fastmath=True)
                             ).to(cutlass.BFloat16)
            self.store4(yv, sYb, i, lane)

    @cute.jit
    def build_rows(self, rA, cA, sQ, sK, sG, r0, rref, lo):
        """The A fragment: rows [q_i; k_i] exp2(G_i - G_rref) of the warp's 16 rows i = r0 + r, zero for r < lo
        (the q and k rows of one fragment position share a row and channel, so one exp serves both)."""
        rAq = rA[None, 0, None]
        rAk = rA[None, 1, None]
        cAq = cA[None, 0, None]
        for j in cutlass.range_constexpr(cute.size(rAq)):
            r, d = cAq[j]
            xq = cutlass.Float32(0.0)
            xk = cutlass.Float32(0.0)
            if r >= lo:
                dec = cute.math.exp2(sG[r0 + r, d] * LOG2E - sG[rref, d] * LOG2E, fastmath=True)
                xq = sQ[r0 + r, d].to(cutlass.Float32) * dec
                xk = sK[r0 + r, d].to(cutlass.Float32) * dec
            rAq[j] = xq.to(cutlass.BFloat16)
            rAk[j] = xk.to(cutlass.BFloat16)

    @cute.jit
    def store_scores(self, acc, coord, sA, sL, sBeta, r0, c0, lo, hi, scale):
        """The block's scores (rows r0 + r, r >= lo; columns c0 + c, c < hi) into sA (q side, times scale) and
        sL (k side, times beta of the row)."""
        BC = self.BC
        for v in cutlass.range_constexpr(cute.size(acc)):
            r, c = coord[v]
            rr = r % BC
            if rr >= lo:
                if c < hi:
                    if r < BC:
                        sA[r0 + rr, c0 + c] = acc[v] * scale
                    else:
                        sL[r0 + rr, c0 + c] = acc[v] * sBeta[r0 + rr]

    @cute.jit
    def load4(self, s: cute.Tensor, row, blk, frag: cute.Tensor):
        """frag = s[row, 4 blk : 4 blk + 4] (one 16-byte / 8-byte shared-memory vector)."""
        cute.autovec_copy(cute.local_tile(s, (1, 4), (row, blk))[0, None], frag)

    @cute.jit
    def store4(self, frag: cute.Tensor, s: cute.Tensor, row, blk):
        """s[row, 4 blk : 4 blk + 4] = frag."""
        cute.autovec_copy(frag, cute.local_tile(s, (1, 4), (row, blk))[0, None])
