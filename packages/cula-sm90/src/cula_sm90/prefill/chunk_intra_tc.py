"""KDA prefill, stage 1 of 2, tensor-core version: the chunk-parallel kernel for the safe gate (bounded decay).

Same contract as `chunk_intra.py` (writes w, u, qg, kg, Aqk in token layout [TT, HV, *] bf16 and gl [NC, HV, K]
fp32 for stage 2). It serves the safe gate with lower_bound >= forward.TC_LOWER_BOUND_MIN (-8): every per-token
log decay lies in (lower_bound, 0), so a 16-token block spans at most 8 |lower_bound| (<= 64) on either side of
its middle token. The other gates (softplus, precomputed: unbounded decays) stay on `chunk_intra.py`.

One CTA (256 threads, 8 warps) per (chunk of 64 tokens, value head): grid x = NC * G chunk-major, so the G value
heads of a q/k head's group run in adjacent CTAs and re-read q, k from L2 (q, k are L2-normalised in place as bf16,
as FLA's l2norm output). One head per CTA keeps the kernel loop-free: a loop over the group would hold every
swizzled shared-memory address live across it. Per CTA, with r(i) = 16 (i // 16) + 8 the middle token of token
i's 16-row block:

    G      chunk-local cumulative log gate in fp32, in registers: threads d and 128 + d scan rows 0-31 and 32-63
           of column d, the second half then adds the first half's total; only G at the four middle tokens and
           G_last go to shared memory
    out    from those registers, per element: qg = scale q e^G, kg = k e^(G_last - G), gl = G_last; in place, the
           bf16 operands q^ = q e^(G - G_r(i)), k^ = k e^(G - G_r(i)), k_ = k e^(G_r(i) - G) (each factor at most
           e^(8 |lower_bound|) <= e^64: no overflow)
    scores per row block p (16 rows), r = r(16 p):
           Aqk[i, j] = scale q^_i . k_j e^(G_r - G_r(j))     (j <= i)
           L[i, j]   = beta_i k^_i . k_j e^(G_r - G_r(j))    (j < i)
           i.e. (q_i e^(G_i - G_r)) . (k_j e^(G_r - G_j)): the factorisation is exact per term (no cancellation),
           so each product keeps bf16's relative precision; the column operand of an earlier block c < p is k_c
           times the per-feature factor e^(G_r - G_r(16 c)) <= 1, rounded to bf16 again; masked entries are selected
           away, never multiplied. One mma.sync GEMM per warp: warp (which, c) = (warp // 4, warp % 4) computes
           column block c <= p of Aqk (which 0) or of L (which 1)
    Akk    (I + L)^-1 in fp32 FFMA, blocked by 16 and in place of L: the four diagonal blocks by substitution (warps
           0-3, one each), then row block by row block X_bc = -X_bb sum_m L_bm X_mc (warps c and c + 4: 8 rows each)
    w, u   A = Akk diag(beta) in bf16 (as FLA's solve_tril output); u = A v, w = A (k e^G) = sum_c A[:, c]
           (k^_c diag(e^G_r(16 c))): the per-feature factors scale the fp32 accumulator's columns between k-blocks,
           last block first (Horner: e^(G_r(c) - G_r(c-1)), then e^G_r(0), all <= 1), so w's operands are rounded
           once as before; 8 warps, 4 along M x 2 along N, one accumulator at a time

Decays are differences of cumulative log gates; nothing divides by a decay.

Pipeline and memory: q, k (and a bf16 g) by 16-byte cp.async in one round trip, v by cp.async while the inverse
runs; w, u out with 16-byte stores (staged through shared memory), qg, kg by column (a warp writes 64 contiguous
bytes of a row), Aqk from the accumulators. Shared memory 67.5 KiB, three CTAs per SM (the launch asks ptxas for
three, which caps the registers): three bf16 [64, 128] tiles (q -> q^ -> the decayed column operands -> v; k -> k^ -> the u
staging; g -> k_ -> A), the L tile (fp32, 16.25 KiB; the inverse in place, then the w staging), G at the middle
tokens and the scan's totals (3 KiB), beta. Assumes contiguous, 16-byte aligned q/k/v/g (forward.py copies a
misaligned view), K = V = 128, chunks starting at every sequence start (varlen through cu_seqlens and the chunk
offsets: a binary search, no host synchronisation); a chunk index past the last chunk exits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import CopyUniversalOp

from cula_sm90.prefill import common, tc

BT = 64
DK = 128
BC = 16
LPAD = BT + 1  # fp32 row stride of L: the inverse reads one L element per row across a warp's rows
THREADS = 256
SCAN_ROWS = BT // (THREADS // DK)  # rows of G's column each scanning thread sums
INV_ROWS = BC // 4  # rows of an off-diagonal inverse block per thread (2 warps x 2 half-warps per block)


def vec_copy(dtype, threads: int, cols: int):
    """Register <-> memory copies of a row-major (rows, cols) tile in 8-element vectors (16 bytes of bf16, two
    16-byte accesses of fp32): cols / 8 threads per row, element e of a thread's fragment at column c0 + e."""
    per_row = cols // 8
    atom = cute.make_copy_atom(CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, 8), stride=(8, 1)))


class ChunkIntraTCKernel(common.Stage1Launch):
    """Compile-time configuration (common.Stage1Launch): beta activation, L2 norm, which gate parameters exist;
    the gate is `safe`."""

    threads = THREADS
    cta_per_value_head = True
    min_ctas_per_sm = 3
    g_smem = True  # g is bf16: loaded by cp.async (forward.py sets it from g's dtype)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               alog: cute.Tensor, dtb: cute.Tensor, cu: cute.Tensor, co: cute.Tensor, w: cute.Tensor,
               u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor, gl: cute.Tensor,
               N: Int32, search_steps: Int32, G: Int32, scale: Float32, lower_bound: Float32):
        tid, _, _ = cute.arch.thread_idx()
        chunk_j, h, _ = cute.arch.block_idx()
        chunk = chunk_j // G
        hv = h * G + (chunk_j - chunk * G)

        smem = cutlass.memory.SmemAllocator()
        # three bf16 [64, 128] tiles: 0 q -> q e^(G - G_r) -> the decayed column operands -> v; 1 k -> k e^(G - G_r)
        # -> the u staging; 2 g (bf16) -> k e^(G_r - G) -> Akk diag(beta)
        sT = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, DK, 3), 128)
        # L (fp32), the inverse X in place, then the w staging (bf16)
        l_raw = smem.allocate(BT * LPAD * 4, 128)
        sL = cute.make_tensor(cute.recast_ptr(l_raw, dtype=Float32), cute.make_layout((BT, BT), stride=(LPAD, 1)))
        # G at the four reference rows (8, 24, 40, 56), G_31 (the first scan half's total), G_63
        sGr = smem.allocate_tensor(Float32, cute.make_layout((6, DK), stride=(DK, 1)), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(BT), 16)

        _, t0, L, valid = common.find_chunk(cu, co, chunk, N, search_steps)
        if valid:
            cp = tc.g2s_copy(DK, self.threads)
            tc.copy_rows(cp, tc.rows_at(q, t0, h, 0, BT, DK), sT[None, None, 0], L, tid)
            tc.copy_rows(cp, tc.rows_at(k, t0, h, 0, BT, DK), sT[None, None, 1], L, tid)
            if const_expr(self.g_smem):  # g in the same round trip
                tc.copy_rows(cp, tc.rows_at(g, t0, hv, 0, BT, DK), sT[None, None, 2], L, tid)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            if const_expr(self.l2norm):
                self.l2norm_rows(sT[None, None, 0], tid)
                self.l2norm_rows(sT[None, None, 1], tid)
            self.head(hv, chunk, t0, L, sT, sL, l_raw, sGr, sB, v, g, beta, alog, dtb, w, u, qg, kg, aqk, gl,
                      scale, lower_bound, tid)

    @cute.jit
    def l2norm_rows(self, s: cute.Tensor, tid):
        """x / sqrt(sum x^2 + 1e-6) per row, in place (bf16, as FLA's l2norm output); 16 threads per row."""
        vc = vec_copy(BFloat16, self.threads, DK)
        thr = vc.get_slice(tid)
        ps = thr.partition_S(s)
        pd = thr.partition_D(s)
        f = cute.make_fragment_like(ps[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(ps.shape[1])):
            cute.copy(vc, ps[None, m, None], f)
            ss = Float32(0.0)
            for e in cutlass.range_constexpr(8):
                x = f[e].to(Float32)
                ss += x * x
            for off in cutlass.range_constexpr(4):
                ss += cute.arch.shuffle_sync_bfly(ss, offset=8 >> off)
            rs = cute.math.rsqrt(ss + 1e-6)
            for e in cutlass.range_constexpr(8):
                f[e] = (f[e].to(Float32) * rs).to(BFloat16)
            cute.copy(vc, f, pd[None, m, None])
        cute.arch.sync_threads()

    @cute.jit
    def head(self, hv: Int32, chunk: Int32, t0: Int32, L: Int32, sT, sL, l_raw, sGr, sB, v, g, beta, alog, dtb,
             w, u, qg, kg, aqk, gl, scale: Float32, lower_bound: Float32, tid):
        warp = tid // 32
        lane = tid % 32
        sQ = sT[None, None, 0]
        sK = sT[None, None, 1]
        sKc = sT[None, None, 2]
        # ---- the log gate and its chunk-local cumulative sum G, in registers: thread (half, d) scans rows
        # [32 half, 32 half + 32) of column d, the second half adds the first half's total; rows past the end add
        # nothing (identity transitions). bf16 g came by cp.async into tile 2, fp32 g by loads coalesced across
        # the warp
        d = tid % DK
        half = tid // DK
        a_rate = Float32(1.0)
        if const_expr(self.has_a_log):
            a_rate = cute.math.exp(alog[hv].to(Float32), fastmath=True)
        bias = Float32(0.0)
        if const_expr(self.has_dt_bias):
            bias = dtb[hv, d].to(Float32)
        acc = Float32(0.0)
        gcol = cute.make_rmem_tensor(cute.make_layout(SCAN_ROWS), Float32)
        for mb in cutlass.range_constexpr(SCAN_ROWS // 16):
            gv = cute.make_rmem_tensor(cute.make_layout(16), Float32)
            for mm in cutlass.range_constexpr(16):
                row = half * SCAN_ROWS + mb * 16 + mm
                x = Float32(0.0)
                if const_expr(self.g_smem):
                    x = sKc[row, d].to(Float32)  # zero-filled past the end
                elif row < L:
                    x = g[t0 + row, hv, d].to(Float32)
                gv[mm] = x
            for mm in cutlass.range_constexpr(16):
                if half * SCAN_ROWS + mb * 16 + mm < L:
                    y = a_rate * (gv[mm] + bias)
                    acc += lower_bound / (1.0 + cute.math.exp(-y, fastmath=True))
                gcol[mb * 16 + mm] = acc
        if tid < BT:
            b = Float32(0.0)
            if tid < L:
                b = common.activate_beta(beta[t0 + tid, hv].to(Float32), self.beta_activation)
            sB[tid] = b
        if half == 0:
            sGr[0, d] = gcol[8]
            sGr[1, d] = gcol[24]
            sGr[4, d] = gcol[SCAN_ROWS - 1]
        cute.arch.sync_threads()
        if half == 1:
            base = sGr[4, d]
            for mm in cutlass.range_constexpr(SCAN_ROWS):
                gcol[mm] = gcol[mm] + base
            sGr[2, d] = gcol[8]
            sGr[3, d] = gcol[24]
            sGr[5, d] = gcol[SCAN_ROWS - 1]
            gl[chunk, hv, d] = gcol[SCAN_ROWS - 1]  # rows past a partial chunk's end add nothing to G
        cute.arch.sync_threads()

        # ---- per element of the column: qg, kg out; in place, the score operands q^ = q e^(G - G_r),
        # k^ = k e^(G - G_r) (also w's right-hand side) and k_ = k e^(G_r - G) over g (read above by this thread)
        glast = sGr[5, d]
        g_lo = gcol[8]
        g_hi = gcol[24]
        for mm in cutlass.range_constexpr(SCAN_ROWS):
            row = half * SCAN_ROWS + mm
            gi = gcol[mm]
            gref = g_lo
            if const_expr(mm >= 16):
                gref = g_hi
            qv = sQ[row, d].to(Float32)
            kv = sK[row, d].to(Float32)
            if row < L:
                qg[t0 + row, hv, d] = (qv * scale * cute.math.exp(gi, fastmath=True)).to(qg.element_type)
                kg[t0 + row, hv, d] = (kv * cute.math.exp(glast - gi, fastmath=True)).to(kg.element_type)
            down = cute.math.exp(gi - gref, fastmath=True)
            sQ[row, d] = (qv * down).to(BFloat16)
            sK[row, d] = (kv * down).to(BFloat16)
            sKc[row, d] = (kv * cute.math.exp(gref - gi, fastmath=True)).to(BFloat16)
        cute.arch.sync_threads()

        # ---- scores, one 16-row block p at a time. Column block c < p meets row block p through
        # k_c e^(G_r(p) - G_r(c)) (a per-feature factor <= 1), built by all threads over q^'s block c (dead since
        # step c); then warp (which, c), c = warp % 4, which = warp // 4, computes column block c <= p of Aqk
        # (which 0: q^ rows) or of L (which 1: k^ rows)
        vb = vec_copy(BFloat16, self.threads, DK)
        tb = vb.get_slice(tid)
        pKc = tb.partition_S(sKc)
        pQd = tb.partition_D(sQ)
        cI = tb.partition_S(cute.make_identity_tensor((BT, DK)))
        c0 = cI[0, 0, 0][1]
        fx = cute.make_fragment_like(pKc[None, 0, None])
        fo = cute.make_fragment_like(pKc[None, 0, None])
        gp = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        mma1 = tc.tiled_mma_m(1)
        thr1 = mma1.get_slice(lane)
        cC = thr1.partition_C(cute.make_identity_tensor((BC, BC)))
        which = warp // 4
        cb = warp % 4
        t_bf = sT.iterator
        for p in cutlass.range_constexpr(BT // BC):
            if const_expr(p > 0):
                for e in cutlass.range_constexpr(8):
                    gp[e] = sGr[p, c0 + e]
                for c in cutlass.range_constexpr(p):  # one 16-row block per pass of the 256 threads
                    cute.copy(vb, pKc[None, c, None], fx)
                    for e in cutlass.range_constexpr(8):
                        f = cute.math.exp(gp[e] - sGr[c, c0 + e], fastmath=True)
                        fo[e] = (fx[e].to(Float32) * f).to(BFloat16)
                    cute.copy(vb, fo, pQd[None, c, None])
                cute.arch.sync_threads()
            acc_s = cute.make_rmem_tensor(thr1.partition_shape_C((BC, BC)), Float32)
            acc_s.fill(0.0)
            if cb <= p:
                col_tile = Int32(0)  # tile of the column operand: 0 (decayed copy of block cb) or 2 (block p)
                if cb == p:
                    col_tile = Int32(2)
                sA = cute.make_tensor(t_bf + cute.assume(which * (BT * DK), divby=BT * DK), tc.bf16_tile(BT, DK))
                sBc = cute.make_tensor(t_bf + cute.assume(col_tile * (BT * DK), divby=BT * DK), tc.bf16_tile(BT, DK))
                tc.gemm(mma1, acc_s, cute.local_tile(sA, (BC, DK), (p, 0)), cute.local_tile(sBc, (BC, DK), (cb, 0)),
                        lane, False, False)
            if which == 0:
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    i, jj = cC[e]
                    row = p * BC + i
                    col = cb * BC + jj
                    a = Float32(0.0)
                    if col <= row:
                        a = acc_s[e] * scale
                    if row < L:
                        aqk[t0 + row, hv, col] = a.to(aqk.element_type)
            else:
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    i, jj = cC[e]
                    row = p * BC + i
                    col = cb * BC + jj
                    lv = Float32(0.0)
                    if col < row:
                        lv = acc_s[e] * sB[row]
                    sL[row, col] = lv
            cute.arch.sync_threads()  # the operands are read: the next block may overwrite them

        # ---- v in flight (cp.async into tile 0: the operands are dead) while the inverse runs
        tc.copy_rows(tc.g2s_copy(DK, self.threads), tc.rows_at(v, t0, hv, 0, BT, DK), sQ, L, tid)
        cute.arch.cp_async_commit_group()
        self.inverse(sL, warp, lane)

        # ---- Akk diag(beta) in bf16 (as FLA's solve_tril output) for the w / u GEMMs, over k_ (dead)
        sAk = cute.make_tensor(t_bf + 2 * (BT * DK), tc.bf16_tile(BT, BT))
        for m in cutlass.range(BT * BT // self.threads, unroll=4):
            i = m * (self.threads // BT) + tid // BT
            jj = tid % BT
            sAk[i, jj] = (sL[i, jj] * sB[jj]).to(BFloat16)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # X is dead: w may be staged in its place

        # ---- w = Akk diag(beta) @ (k e^G) = sum_c (Akk diag(beta))[:, c] (k^_c e^G_r(c)): the per-feature
        # factors scale the accumulator's columns between k-blocks (Horner, every factor <= 1); u = Akk diag(beta)
        # @ v. 8 warps (4 along M x 2 along N), one accumulator in turn; w staged as bf16 in L's place, u in k^'s
        # once every warp is past w's GEMM; then out in 16-byte vectors
        mma8 = tc.tiled_mma_mn(4, 2)
        thr8 = mma8.get_slice(tid)
        sWo = cute.make_tensor(cute.recast_ptr(l_raw, dtype=BFloat16), tc.bf16_tile(BT, DK))
        acc_o = cute.make_rmem_tensor(thr8.partition_shape_C((BT, DK)), Float32)
        acc_o.fill(0.0)
        self.gemm_decayed(mma8, acc_o, sAk, tc.t_view(sK, BT, DK), sGr, tid)
        pw = thr8.partition_C(sWo)
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            pw[e] = acc_o[e].to(BFloat16)
        acc_o.fill(0.0)
        tc.gemm(mma8, acc_o, sAk, tc.t_view(sQ, BT, DK), tid, False, True)
        cute.arch.sync_threads()  # every warp is done reading k^
        pu = thr8.partition_C(sK)
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            pu[e] = acc_o[e].to(BFloat16)
        cute.arch.sync_threads()
        pw_s = tb.partition_S(sWo)
        pu_s = tb.partition_S(sK)
        gw = tb.partition_D(tc.rows_at(w, t0, hv, 0, BT, DK))
        gu = tb.partition_D(tc.rows_at(u, t0, hv, 0, BT, DK))
        for m in cutlass.range_constexpr(cute.size(pw_s.shape[1])):
            if cI[0, m, 0][0] < L:
                cute.copy(vb, pw_s[None, m, None], fx)
                cute.copy(vb, fx, gw[None, m, None])
                cute.copy(vb, pu_s[None, m, None], fo)
                cute.copy(vb, fo, gu[None, m, None])

    @cute.jit
    def gemm_decayed(self, tmma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, sGr, tid):
        """acc += sum_c sA[:, c] (sB_c diag(e^G_r(c))) over the four 16-token k-blocks c (sA [64, 64] bf16, sB the
        [128, 64] transposed view of a [64, 128] tile: sB_c its columns 16c..16c+15), last block first: after block
        c the accumulator's column n is scaled by e^(G_r(c)[n] - G_r(c - 1)[n]), after block 0 by e^G_r(0)[n]
        (fp32, every factor <= 1)."""
        cC = tmma.get_slice(tid).partition_C(cute.make_identity_tensor((BT, DK)))
        for step in cutlass.range_constexpr(BT // BC):
            kb = BT // BC - 1 - step
            tc.gemm(tmma, acc, cute.local_tile(sA, (BT, BC), (0, kb)), cute.local_tile(sB, (DK, BC), (0, kb)), tid,
                    False, True)
            for e in cutlass.range_constexpr(cute.size(acc)):
                n = cC[e][1]
                x = sGr[kb, n]
                if const_expr(kb > 0):
                    x = x - sGr[kb - 1, n]
                acc[e] = acc[e] * cute.math.exp(x, fastmath=True)

    @cute.jit
    def inverse(self, sL, warp, lane):
        """X = (I + L)^-1 in place of L (L strictly lower, fp32; its upper blocks are already 0), blocked by 16.
        Warp b < 4 inverts the diagonal block b by substitution (lane j: column j). Then, row block by row block
        (b = 1..3), warps c and c + 4 (c < b) compute X_bc = -X_bb T, T = sum_{c <= m < b} L_bm X_mc, each for 8
        of its rows (lane: 4 rows of column j): T in registers, a barrier (every warp has read L's row block b),
        T staged in X_bc's place, a barrier, the product with X_bb, a barrier (T is read), X_bc written, a barrier
        (the next row block reads it)."""
        b0 = (warp % 4) * BC
        j = lane % BC
        if warp < 4:
            x = cute.make_rmem_tensor(cute.make_layout(BC), Float32)
            for i in cutlass.range_constexpr(BC):
                acc = Float32(0.0)
                for m in cutlass.range_constexpr(i):
                    acc += sL[b0 + i, b0 + m] * x[m]
                xi = -acc
                if i == j:
                    xi = Float32(1.0)
                if i < j:
                    xi = Float32(0.0)
                x[i] = xi
                cute.arch.sync_warp()  # every lane has read row i of L before it becomes row i of X
                if lane < BC:
                    sL[b0 + i, b0 + j] = xi
        cute.arch.sync_threads()
        rsub = (warp // 4) * 8 + (lane // BC) * INV_ROWS
        col = b0 + j
        t = cute.make_rmem_tensor(cute.make_layout(INV_ROWS), Float32)
        for bb in cutlass.range_constexpr(1, BT // BC):
            r0 = bb * BC + rsub
            active = b0 < bb * BC
            for r in cutlass.range_constexpr(INV_ROWS):
                t[r] = Float32(0.0)
            if active:
                for m in cutlass.range(b0, bb * BC, unroll=4):
                    xm = sL[m, col]
                    for r in cutlass.range_constexpr(INV_ROWS):
                        t[r] += sL[r0 + r, m] * xm
            cute.arch.sync_threads()
            if active:
                for r in cutlass.range_constexpr(INV_ROWS):
                    sL[r0 + r, col] = t[r]
            cute.arch.sync_threads()
            if active:
                for r in cutlass.range_constexpr(INV_ROWS):
                    t[r] = Float32(0.0)
                for m in cutlass.range_constexpr(BC):
                    tm = sL[bb * BC + m, col]
                    for r in cutlass.range_constexpr(INV_ROWS):
                        t[r] += sL[r0 + r, bb * BC + m] * tm
            cute.arch.sync_threads()
            if active:
                for r in cutlass.range_constexpr(INV_ROWS):
                    sL[r0 + r, col] = -t[r]
            cute.arch.sync_threads()
