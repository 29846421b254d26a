"""chunk_intra: the intra-chunk score matrices of KDA for one (chunk of 64, value head) per CTA.

    Aqk[i, j] = scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])       (j <= i, else 0)
    L[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j <  i, else 0)
    Akk       = (I + L)^{-1}                                           (unit lower triangular)

GVA: the CTA of value head hv reads q/k at head hv // (HV // HQK); G and beta at hv; writes in HV space.

Tiling: 8 warps, 2 CTAs per SM (launch bound: 65536 / (256 x 2) = 128 registers per thread, 16 warps per SM).
Warp wid = 2 w + s owns rows n = 16 w .. n + 15 of the chunk and side s (0: q, Aqk; 1: k, L). Shared memory
106.2 KiB: q, k (bf16, 16 KiB each), G (fp32, rows padded to 136 floats), region R (40 KiB), beta.
  * scores by warp-level MMA (mma.sync m16n8k16, bf16 operands, fp32 accumulation), one 16 x 16 accumulator per
    column block b <= w: A = x_i e^{G_i - G_n} (x = q or k by side; 16 x 128) held as MMA register fragments,
    built 16 channels at a time right before the MMAs that read them (never in shared memory); B = the decayed
    keys k_j e^{G_n - G_j} (16 x 128 per block, in region R), shared by the warp pair, each warp building the
    blocks nt <= w with nt % 2 == s. For j < n both exponents are <= 0 (the reference's factorisation: no
    overflow however strong the decay). The accumulators stay in registers until a barrier frees region R,
    where the fp32 score matrices then go;
  * the diagonal block: "mild" (decay span under 2^100 over the block) -> the same GEMM with all 16 columns;
    otherwise it is split in 8 x 8 sub-blocks: the lower-left one by the GEMM with reference row n + 8 (both
    factors <= 1: A rows >= n + 8, B columns < n + 8, the rest zeroed), the two diagonal ones in exact fp32 on
    CUDA cores, warp s taking sub-block s: exp(G_i - G_j) as the running product of per-step decays
    a_t = exp(g_t) <= 1, one multiply per (row step, channel) and no exp per pair; lane (column c = lane % 8,
    channel quarter lane // 8) over 32 channels, 8 serial row steps, the quarters added by two shuffles;
  * the solve, in fp32: the diagonal 16 x 16 blocks inverted by forward substitution (one lane per column, warps
    with s = 0), then the off-diagonal blocks row block by row block, X_pq = -X_pp sum_r L_pr X_rq, one element
    per thread, rows read 4 columns per 16-byte load (L in rows of 68 floats, inverted blocks in rows of 20,
    the partial products in rows of 52, the scratch where G was).
Pipeline: cp.async q/k (zero rows past the chunk end) and G (rows past the end repeat the last valid one,
so every exponent stays <= 0), build B, MMA (A built per k-block), per-step decays (the two halves of the
CTA take rows 32..63 and 1..31), fp32 sub-blocks, solve; Aqk and Akk staged as bf16 where q was, then 16-byte
stores of rows < n.

8 warps rather than 4 (which need 242 registers, 8 warps per SM): chosen by measurement, docs/sm100.md and
docs/benchmarks/train_fwd.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g
from cula_core.cute_kernels.warp_mma import ldmatrix_copy_B, smem_tile_layout, tiled_mma
from cula_sm100.forward.cute_utils import chunk_block, load_beta, LOG2E, token_layout


class ChunkIntra:
    BT = 64
    BC = 16
    K = 128
    Y_BLOCKS = 10  # 16-row blocks of decayed keys: row block w's pair holds w + 1 of them (1 + 2 + 3 + 4)
    threads = 256
    MIN_CTAS = 2  # per SM: caps registers at 65536 / (256 x 2) = 128
    G_STRIDE = 136  # fp32 row stride of G in shared memory (K + 8; 544 bytes keeps 16-byte copies aligned)
    L_STRIDE = 68   # fp32 row strides of L, of the inverted diagonal blocks and of the solve's partial products:
    D_STRIDE = 20   # multiples of 4 floats, so the solve reads rows 4 at a time (16-byte loads)
    TMP_STRIDE = 52

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
            grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=self.MIN_CTAS,
            preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAqk: cute.Tensor,
               mAkk: cute.Tensor, mT: cute.Tensor, group: cutlass.Int32, scale: cutlass.Float32):
        K, BT = self.K, self.BT
        tidx, _, hv, t0, n = chunk_block(mT)
        wid = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        hq = hv // group  # GVA: q / k at the value head's q/k head

        smem = cutlass.utils.SmemAllocator()  # 106.2 KiB
        sQ = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K), 1024)
        sK = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K), 1024)
        # G rows padded by 8 floats: the A fragment's G_i reads (rows lane / 4, 8-byte column pairs lane % 4) hit 4
        # rows per half-warp in distinct banks (unpadded, the 8 rows would share banks: 8-way conflicts)
        sG = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT, K), stride=(self.G_STRIDE, 1)), 128)
        r_raw = smem.allocate(self.Y_BLOCKS * self.BC * K * 2, 1024)
        sBeta = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BT,)), 16)

        cp_bf16 = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp_bf16, head_rows(mQ, t0, hq, BT), sQ, n, tidx)
        copy_rows_g2s(cp_bf16, head_rows(mK, t0, hq, BT), sK, n, tidx)
        copy_rows_g2s(g2s_tiled_copy(K, self.threads, cutlass.Float32), head_rows(mG, t0, hv, BT), sG, n, tidx)
        cute.arch.cp_async_commit_group()
        load_beta(sBeta, mBeta, t0, hv, n, tidx, self.beta_activation)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        # rows past the chunk end repeat the last valid G (their q/k are zero): exponents stay <= 0. Thread =
        # (channel, row parity); row n - 1 is never written here, so the reads race with nothing.
        ch = tidx % K
        par = tidx // K
        for rr in cutlass.range_constexpr(BT // 2):
            r = 2 * rr + par
            if r >= n:
                sG[r, ch] = sG[n - 1, ch]
        cute.arch.sync_threads()
        self.scores_and_solve(sQ, sK, sG, r_raw, sBeta, mAqk, mAkk, tidx, wid, lane, hv, t0, n, scale)

    @cute.jit
    def scores_and_solve(self, sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor, r_raw: cute.Pointer,
                            sBeta: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor, tidx, wid, lane, hv, t0, n,
                            scale: cutlass.Float32):
        """Everything after the loads: sQ / sK hold the chunk's (normalised) q / k rows, zero past its end; sG its
        G, rows past the end repeating the last valid one; sBeta the activated beta. Writes Aqk and Akk."""
        K, BT, BC = self.K, self.BT, self.BC
        w = wid // 2  # row block
        s = wid % 2   # side: 0 q (Aqk), 1 k (L); in the fp32 path, the 8 x 8 diagonal sub-block
        r0 = w * BC
        sY = cute.make_tensor(cute.recast_ptr(r_raw, dtype=cutlass.BFloat16), smem_tile_layout(self.Y_BLOCKS * BC, K))
        r_f32 = cute.recast_ptr(r_raw, dtype=cutlass.Float32)
        # fp32 score matrices in region R once the GEMMs are done with it: sA with an odd row stride (65: column
        # walks conflict-free); sL, which the solve reads along rows, with rows of 68 floats so that 4 of them are
        # one 16-byte load. The solve's
        # scratch (inverted diagonal blocks sD, rows of 20; partial products sTmp, rows of 52) goes where G was:
        # nothing reads G after the fp32 sub-block path
        sA = cute.make_tensor(r_f32, cute.make_layout((BT, BT), stride=(BT + 1, 1)))
        sL = cute.make_tensor(r_f32 + BT * (BT + 1), cute.make_layout((BT, BT), stride=(self.L_STRIDE, 1)))
        sD = cute.make_tensor(sG.iterator, cute.make_layout((4, BC, BC), stride=(BC * self.D_STRIDE, self.D_STRIDE, 1)))
        sTmp = cute.make_tensor(sG.iterator + 4 * BC * self.D_STRIDE,
                                cute.make_layout((BC, 3 * BC), stride=(self.TMP_STRIDE, 1)))

        # ---- the row block's decay span (both warps of the pair compute it: same value). When it keeps
        #      exp(G_n - G_j) <= 2^100 (no overflow in bf16 / fp32) the diagonal block's GEMM takes all 16 columns
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

        # ---- B: the pair's decayed keys k_j exp2(G_ref - G_j), block nt built by the warp with s == nt % 2
        gref = cute.make_rmem_tensor((4,), cutlass.Float32)
        gdia = cute.make_rmem_tensor((4,), cutlass.Float32)
        self.load4(sG, r0, lane, gref)
        self.load4(sG, r0 + lo, lane, gdia)  # the diagonal block's reference row: n when mild, else n + 8
        for e in cutlass.range_constexpr(4):
            gref[e] = gref[e] * LOG2E
            gdia[e] = gdia[e] * LOG2E
        gv = cute.make_rmem_tensor((4,), cutlass.Float32)
        kv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        yv = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        yb0 = w * (w + 1) // 2
        gsel = cute.make_rmem_tensor((4,), cutlass.Float32)
        for it in cutlass.range(2, unroll=1):  # runtime loop: one copy of build_keys in the code, not eight
            nt = s + 2 * it  # this warp's blocks: nt = s, s + 2 (those <= w)
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
        # the per-step decays' rows 32..63 read G_31, which the other half of the CTA overwrites: read it now
        ch = tidx % K
        par = tidx // K
        g_edge = sG[BT // 2 - 1, ch]
        sX = sQ
        if s == 1:
            sX = sK
        cute.arch.sync_threads()  # every warp's B operand is built

        # ---- scores by warp-level MMA, k-block by k-block: A (this side's rows x exp2(G_i - G_n), and for the
        #      diagonal block x exp2(G_i - G_{n+lo}) with rows < lo zero) is built 16 channels at a time right
        #      before the MMAs that read it, so at most 32 accumulator registers and two A slices are held (a
        #      whole 16 x 128 A of both sides would take 64 registers and cap the CTA at 8 warps per SM).
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
        cute.arch.sync_threads()  # every warp is done reading G
        # ---- per-step decays a_t = exp(G_t - G_{t-1}) in place of G, descending t: half par = 1 rows 63..32
        #      (G_31 from the register read above), half par = 0 rows 31..1 (row 0 keeps G_0: the fp32 path
        #      multiplies only zeros by it)
        if par == 1:
            for tt in cutlass.range_constexpr(BT // 2 - 1):
                t = BT - 1 - tt
                sG[t, ch] = cute.math.exp2((sG[t, ch] - sG[t - 1, ch]) * LOG2E, fastmath=True)
            sG[BT // 2, ch] = cute.math.exp2((sG[BT // 2, ch] - g_edge) * LOG2E, fastmath=True)
        else:
            for tt in cutlass.range_constexpr(BT // 2 - 1):
                t = BT // 2 - 1 - tt
                sG[t, ch] = cute.math.exp2((sG[t, ch] - sG[t - 1, ch]) * LOG2E, fastmath=True)
        cute.arch.sync_threads()  # every GEMM is done with R; the decays are in place
        coord = thr.partition_C(cute.make_identity_tensor((BC, BC)))
        for nt in cutlass.range_constexpr(4):
            if nt < w:
                self.store_side(accs[nt], coord, sA, sL, sBeta, s, r0, nt * BC, 0, BC, scale)
            if nt == w:
                self.store_side(accs[nt], coord, sA, sL, sBeta, s, r0, nt * BC, lo, hi, scale)

        # ---- diagonal 8 x 8 sub-block s in fp32 (not mild): lane (c, h) carries the decayed key of column
        #      base + c over channels 16 m + 4 h + e (m < 8, e < 4), z_j(i) = k_j a_{j+1} ... a_i, dots it with
        #      q_i and k_i; the 4 quarters add by two shuffles
        c = lane % half_rows
        h = lane // half_rows
        base = r0 + s * half_rows
        z = cute.make_rmem_tensor((32,), cutlass.Float32)
        z.fill(0.0)
        av = cute.make_rmem_tensor((4,), cutlass.Float32)
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
                    sA[row, base + c] = sq * scale
                    sL[row, base + c] = sk * sBeta[row]  # the diagonal entry is written but never read
        cute.arch.sync_threads()

        # ---- solve: diagonal block inverses by forward substitution (warp 2 w, lane = column)
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

        # ---- solve: off-diagonal blocks, row block p after row block p - 1, one element (oi, oj) per thread; the
        #      row operand (L_pr, X_pp) read 4 columns per 16-byte load
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

        # ---- stores: bf16 tiles staged where q was, zeros above the diagonal, then 16-byte rows < n
        sAqk_o = cute.make_tensor(sQ.iterator, smem_tile_layout(BT, BT))
        sAkk_o = cute.make_tensor(sQ.iterator + BT * BT, smem_tile_layout(BT, BT))
        for m in cutlass.range_constexpr(BT * BT // self.threads):
            e = tidx + self.threads * m
            ei = e // BT
            ej = e % BT
            a = cutlass.Float32(0.0)
            xo = cutlass.Float32(0.0)
            if ej <= ei:
                a = sA[ei, ej]
                if ei // BC == ej // BC:
                    xo = sD[ei // BC, ei % BC, ej % BC]
                else:
                    xo = sL[ei, ej]
            sAqk_o[ei, ej] = a.to(cutlass.BFloat16)
            sAkk_o[ei, ej] = xo.to(cutlass.BFloat16)
        cute.arch.sync_threads()
        store_rows_s2g(sAqk_o, head_rows(mAqk, t0, hv, BT), n, tidx, self.threads)
        store_rows_s2g(sAkk_o, head_rows(mAkk, t0, hv, BT), n, tidx, self.threads)

    @cute.jit
    def build_slice(self, rA, rAd, cA, sX, sG, r0, lo, mild):
        """One k-block of this side's A fragments (x = q or k, rows i = r0 + r of the warp): rA = x_i exp2(G_i - G_n)
        (the off-diagonal blocks' A), rAd the diagonal block's: the same when `mild`, else x_i exp2(G_i - G_{n+lo})
        with rows r < lo zero."""
        for j in cutlass.range_constexpr(cute.size(rA)):
            r, d = cA[j]
            gi = sG[r0 + r, d] * LOG2E
            xi = sX[r0 + r, d].to(cutlass.Float32)
            xv = (xi * cute.math.exp2(gi - sG[r0, d] * LOG2E, fastmath=True)).to(cutlass.BFloat16)
            rA[j] = xv
            rAd[j] = xv
            if not mild:
                xd = cutlass.Float32(0.0)
                if r >= lo:
                    xd = xi * cute.math.exp2(gi - sG[r0 + lo, d] * LOG2E, fastmath=True)
                rAd[j] = xd.to(cutlass.BFloat16)

    @cute.jit
    def store_side(self, acc, coord, sA, sL, sBeta, s, r0, c0, lo, hi, scale):
        """One side's block of scores (rows r0 + r, r >= lo; columns c0 + c, c < hi): sA (q side, times scale)
        or sL (k side, times beta of the row)."""
        for v in cutlass.range_constexpr(cute.size(acc)):
            r, c = coord[v]
            if r >= lo:
                if c < hi:
                    if s == 0:
                        sA[r0 + r, c0 + c] = acc[v] * scale
                    else:
                        sL[r0 + r, c0 + c] = acc[v] * sBeta[r0 + r]

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
    def load4(self, s: cute.Tensor, row, blk, frag: cute.Tensor):
        """frag = s[row, 4 blk : 4 blk + 4] (one 16-byte / 8-byte shared-memory vector)."""
        cute.autovec_copy(cute.local_tile(s, (1, 4), (row, blk))[0, None], frag)

    @cute.jit
    def store4(self, frag: cute.Tensor, s: cute.Tensor, row, blk):
        """s[row, 4 blk : 4 blk + 4] = frag."""
        cute.autovec_copy(frag, cute.local_tile(s, (1, 4), (row, blk))[0, None])
