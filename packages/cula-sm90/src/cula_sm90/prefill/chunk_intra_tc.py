"""KDA prefill, stage 1 of 2, tensor-core version: the chunk-parallel kernel for the safe gate (bounded decay).

Same contract as `chunk_intra.py` (writes w, u, qg, kg, Aqk in token layout [TT, HV, *] bf16 and gl [NC, HV, K]
fp32 for stage 2). It serves the safe gate with lower_bound >= forward.TC_LOWER_BOUND_MIN (-8): every per-token
log decay lies in (lower_bound, 0), so a 16-token block spans at most 8 |lower_bound| (<= 64) on either side of
its middle token. The other gates (softplus, precomputed: unbounded decays) stay on `chunk_intra.py`.

One CTA (128 threads, 4 warps) per (chunk of 64 tokens, q/k head); it loops over the G = HV / HQK value heads of
the group (q and k read, L2-normalised in place as bf16, as FLA's l2norm output, once per group). Per value head:

    G      chunk-local cumulative log gate in fp32 (thread d scans column d)
    scores per row block p (16 rows), reference r = 16 p + 8 (the block's middle token):
           Aqk[i, j] = scale (q_i e^(G_i - G_r)) . (k_j e^(G_r - G_j))     (j <= i)
           L[i, j]   = beta_i (k_i e^(G_i - G_r)) . (k_j e^(G_r - G_j))    (j < i)
           the factorised operands are bf16 tiles and one mma.sync GEMM per (p, 16-column block); each factor is
           at most e^(8 |lower_bound|) (no overflow), each product keeps bf16's relative precision (the
           factorisation is exact per term: no cancellation), masked entries are selected away, never multiplied.
           Decays are differences of cumulative log gates; nothing divides by a decay.
    Akk    (I + L)^-1 in fp32 FFMA, blocked by 16 and in place of L: the four diagonal blocks by substitution (one
           warp each), then row block by row block X_bc = -X_bb sum_m L_bm X_mc (warp c: column block c)
    w, u   (Akk diag(beta)) @ [k e^G | v] on tensor cores (Akk diag(beta) in bf16, as FLA's solve_tril output;
           4 warps along M, one accumulator at a time)
    qg = scale q e^G, kg = k e^(G_last - G), gl = G_last

Pipeline and memory: q, k (and a bf16 g) by 16-byte cp.async in one round trip, v by cp.async while the inverse
runs; qg, kg, w, u out with 16-byte stores (w, u staged through shared memory), Aqk from the accumulators.
Shared memory 104.5 KiB, 164 registers (two CTAs per SM): q, k bf16 tiles (32 KiB), G fp32 (32 KiB; then the w /
u staging), a 24 KiB region R (g; the score operands; v and Akk), the L tile (fp32, 16.25 KiB; the inverse in
place, then k e^G). Assumes contiguous, 16-byte aligned q/k/v/g (forward.py copies a misaligned view), K = V =
128, chunks starting at every sequence start (varlen through cu_seqlens and the chunk offsets: a binary search,
no host synchronisation); a chunk index past the last chunk exits.
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

    threads = 128
    g_smem = True  # g is bf16: loaded by cp.async (forward.py sets it from g's dtype)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               alog: cute.Tensor, dtb: cute.Tensor, cu: cute.Tensor, co: cute.Tensor, w: cute.Tensor,
               u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor, gl: cute.Tensor,
               N: Int32, search_steps: Int32, G: Int32, scale: Float32, lower_bound: Float32):
        tid, _, _ = cute.arch.thread_idx()
        chunk, h, _ = cute.arch.block_idx()

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, DK), 128)
        sK = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, DK), 128)
        sG = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(DK, 1)), 128)
        # the 24 KiB region R, in turn: the score operands (96 rows: q_r, k_r, then the column operand); v (first
        # 16 KiB, cp.async during the inverse) and Akk diag(beta) (bf16, last 8 KiB)
        r_raw = smem.allocate(6 * BC * DK * 2, 128)
        r_bf = cute.recast_ptr(r_raw, dtype=BFloat16)
        sOp = cute.make_tensor(r_bf, tc.bf16_tile(6 * BC, DK))
        sV = cute.make_tensor(r_bf, tc.bf16_tile(BT, DK))
        sAk = cute.make_tensor(r_bf + BT * DK, tc.bf16_tile(BT, BT))
        # the L region: L (fp32), the inverse X in place, then k e^G (bf16)
        l_raw = smem.allocate(BT * LPAD * 4, 128)
        sL = cute.make_tensor(cute.recast_ptr(l_raw, dtype=Float32), cute.make_layout((BT, BT), stride=(LPAD, 1)))
        sKe = cute.make_tensor(cute.recast_ptr(l_raw, dtype=BFloat16), tc.bf16_tile(BT, DK))
        sB = smem.allocate_tensor(Float32, cute.make_layout(BT), 16)

        _, t0, L, valid = common.find_chunk(cu, co, chunk, N, search_steps)
        if valid:
            cp = tc.g2s_copy(DK, self.threads)
            tc.copy_rows(cp, tc.rows_at(q, t0, h, 0, BT, DK), sQ, L, tid)
            tc.copy_rows(cp, tc.rows_at(k, t0, h, 0, BT, DK), sK, L, tid)
            if const_expr(self.g_smem):  # the first head's g in the same round trip
                tc.copy_rows(cp, tc.rows_at(g, t0, h * G, 0, BT, DK), sV, L, tid)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            if const_expr(self.l2norm):
                self.l2norm_rows(sQ, tid)
                self.l2norm_rows(sK, tid)
            for j in cutlass.range(G, unroll=1):
                self.head(h * G + j, j, chunk, t0, L, sQ, sK, sG, sOp, sV, sAk, sL, sKe, sB, v, g, beta,
                          alog, dtb, w, u, qg, kg, aqk, gl, scale, lower_bound, tid)

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
    def head(self, hv: Int32, j: Int32, chunk: Int32, t0: Int32, L: Int32, sQ, sK, sG, sOp, sV, sAk, sL, sKe, sB, v, g, beta, alog, dtb, w, u, qg, kg, aqk, gl, scale: Float32, lower_bound: Float32, tid):
        warp = tid // 32
        lane = tid % 32
        cute.arch.sync_threads()  # the previous head is done with every buffer
        # ---- the log gate and its chunk-local cumulative sum: thread d owns column d; rows past the end add
        # nothing (identity transitions). bf16 g comes by cp.async into R (the first head's with q and k), fp32 g
        # by loads coalesced across the warp, 16 in flight
        if const_expr(self.g_smem):
            if j > 0:
                tc.copy_rows(tc.g2s_copy(DK, self.threads), tc.rows_at(g, t0, hv, 0, BT, DK), sV, L, tid)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
        d = tid
        a_rate = Float32(1.0)
        if const_expr(self.has_a_log):
            a_rate = cute.math.exp(alog[hv].to(Float32), fastmath=True)
        bias = Float32(0.0)
        if const_expr(self.has_dt_bias):
            bias = dtb[hv, d].to(Float32)
        acc = Float32(0.0)
        for mb in cutlass.range(BT // 16, unroll=1):
            gv = cute.make_rmem_tensor(cute.make_layout(16), Float32)
            for mm in cutlass.range_constexpr(16):
                x = Float32(0.0)
                if const_expr(self.g_smem):
                    x = sV[mb * 16 + mm, d].to(Float32)  # zero-filled past the end
                elif mb * 16 + mm < L:
                    x = g[t0 + mb * 16 + mm, hv, d].to(Float32)
                gv[mm] = x
            for mm in cutlass.range_constexpr(16):
                if mb * 16 + mm < L:
                    y = a_rate * (gv[mm] + bias)
                    acc += lower_bound / (1.0 + cute.math.exp(-y, fastmath=True))
                sG[mb * 16 + mm, d] = acc
        if tid < BT:
            b = Float32(0.0)
            if tid < L:
                b = common.activate_beta(beta[t0 + tid, hv].to(Float32), self.beta_activation)
            sB[tid] = b
        cute.arch.sync_threads()

        # ---- scores, one 16-row block p at a time (operands built by all threads, GEMMs by warps w <= p)
        vb = vec_copy(BFloat16, self.threads, DK)
        vf = vec_copy(Float32, self.threads, DK)
        tb = vb.get_slice(tid)
        tf = vf.get_slice(tid)
        pQ = tb.partition_S(sQ)
        pK = tb.partition_S(sK)
        pG = tf.partition_S(sG)
        pOp = tb.partition_D(sOp)
        cI = tb.partition_S(cute.make_identity_tensor((BT, DK)))
        c0 = cI[0, 0, 0][1]
        fx = cute.make_fragment_like(pQ[None, 0, None])
        fo = cute.make_fragment_like(pQ[None, 0, None])
        fg = cute.make_fragment_like(pG[None, 0, None])
        gr = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        mma1 = tc.tiled_mma_m(1)
        thr1 = mma1.get_slice(lane)
        cC = thr1.partition_C(cute.make_identity_tensor((BC, BC)))
        for p in cutlass.range_constexpr(BT // BC):
            rref = p * BC + 8
            for e in cutlass.range_constexpr(8):
                gr[e] = sG[rref, c0 + e]
            # operand rows (8 per pass): 0-15 q e^(G - G_r) of block p, 16-31 k e^(G - G_r), then k_j e^(G_r - G_j)
            for m in cutlass.range_constexpr(2 * (p + 3)):
                src = pQ
                sm = 2 * p + m
                if const_expr(m >= 2):
                    src = pK
                if const_expr(m >= 2 and m < 4):
                    sm = 2 * p + m - 2
                if const_expr(m >= 4):
                    sm = m - 4
                cute.copy(vb, src[None, sm, None], fx)
                cute.copy(vf, pG[None, sm, None], fg)
                for e in cutlass.range_constexpr(8):
                    ex = fg[e] - gr[e]
                    if const_expr(m >= 4):
                        ex = gr[e] - fg[e]
                    fo[e] = (fx[e].to(Float32) * cute.math.exp(ex, fastmath=True)).to(BFloat16)
                cute.copy(vb, fo, pOp[None, m, None])
            cute.arch.sync_threads()
            acc_a = cute.make_rmem_tensor(thr1.partition_shape_C((BC, BC)), Float32)
            acc_l = cute.make_rmem_tensor(thr1.partition_shape_C((BC, BC)), Float32)
            acc_a.fill(0.0)
            acc_l.fill(0.0)
            if warp <= p:
                sKc = cute.local_tile(sOp, (BC, DK), (2 + warp, 0))
                tc.gemm(mma1, acc_a, cute.local_tile(sOp, (BC, DK), (0, 0)), sKc, lane, False, False)
                tc.gemm(mma1, acc_l, cute.local_tile(sOp, (BC, DK), (1, 0)), sKc, lane, False, False)
            for e in cutlass.range_constexpr(cute.size(acc_a)):
                i, jj = cC[e]
                row = p * BC + i
                col = warp * BC + jj
                a = Float32(0.0)
                if col <= row:
                    a = acc_a[e] * scale
                lv = Float32(0.0)
                if col < row:
                    lv = acc_l[e] * sB[row]
                sL[row, col] = lv
                if row < L:
                    aqk[t0 + row, hv, col] = a.to(aqk.element_type)
            cute.arch.sync_threads()  # the operands are read: the next block may overwrite them

        # ---- v in flight (cp.async into R: the operands are dead) while the inverse runs
        tc.copy_rows(tc.g2s_copy(DK, self.threads), tc.rows_at(v, t0, hv, 0, BT, DK), sV, L, tid)
        cute.arch.cp_async_commit_group()
        self.inverse(sL, warp, lane)

        # ---- Akk diag(beta) in bf16 (as FLA's solve_tril output) for the w / u GEMMs
        for m in cutlass.range(BT * BT // self.threads, unroll=4):
            i = m * (self.threads // BT) + tid // BT
            jj = tid % BT
            sAk[i, jj] = (sL[i, jj] * sB[jj]).to(BFloat16)
        cute.arch.sync_threads()  # X is dead: k e^G may take its place

        # ---- qg, kg out; k e^G (the right-hand side of w) into the L region; gl out
        pKe = tb.partition_D(sKe)
        gq = tb.partition_D(tc.rows_at(qg, t0, hv, 0, BT, DK))
        gk = tb.partition_D(tc.rows_at(kg, t0, hv, 0, BT, DK))
        glast = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        for e in cutlass.range_constexpr(8):
            glast[e] = sG[BT - 1, c0 + e]  # rows past a partial chunk's end add nothing to G
        fk = cute.make_fragment_like(pQ[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(pQ.shape[1])):
            row = cI[0, m, 0][0]
            cute.copy(vf, pG[None, m, None], fg)
            cute.copy(vb, pQ[None, m, None], fx)
            cute.copy(vb, pK[None, m, None], fk)
            for e in cutlass.range_constexpr(8):
                eg = cute.math.exp(fg[e], fastmath=True)
                fo[e] = (fx[e].to(Float32) * scale * eg).to(BFloat16)
                fx[e] = (fk[e].to(Float32) * eg).to(BFloat16)
            if row < L:
                cute.copy(vb, fo, gq[None, m, None])
            cute.copy(vb, fx, pKe[None, m, None])
            for e in cutlass.range_constexpr(8):
                fo[e] = (fk[e].to(Float32) * cute.math.exp(glast[e] - fg[e], fastmath=True)).to(BFloat16)
            if row < L:
                cute.copy(vb, fo, gk[None, m, None])
        gl[chunk, hv, tid] = sG[BT - 1, tid]
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        # ---- w = Akk diag(beta) @ (k e^G), u = Akk diag(beta) @ v (4 warps along M), one accumulator in turn,
        # staged as bf16 in G's space (G is dead), then out in 16-byte vectors
        mma4 = tc.tiled_mma_m(4)
        thr4 = mma4.get_slice(tid)
        g_bf = cute.recast_ptr(sG.iterator, dtype=BFloat16)
        sWo = cute.make_tensor(g_bf, tc.bf16_tile(BT, DK))
        sUo = cute.make_tensor(g_bf + BT * DK, tc.bf16_tile(BT, DK))
        acc = cute.make_rmem_tensor(thr4.partition_shape_C((BT, DK)), Float32)
        for which in cutlass.range_constexpr(2):
            rhs = sKe
            dst = sWo
            if const_expr(which == 1):
                rhs = sV
                dst = sUo
            acc.fill(0.0)
            tc.gemm(mma4, acc, sAk, tc.t_view(rhs, BT, DK), tid, False, True)
            pd = thr4.partition_C(dst)
            for e in cutlass.range_constexpr(cute.size(acc)):
                pd[e] = acc[e].to(BFloat16)
        cute.arch.sync_threads()
        pw_s = tb.partition_S(sWo)
        pu_s = tb.partition_S(sUo)
        gw = tb.partition_D(tc.rows_at(w, t0, hv, 0, BT, DK))
        gu = tb.partition_D(tc.rows_at(u, t0, hv, 0, BT, DK))
        for m in cutlass.range_constexpr(cute.size(pQ.shape[1])):
            if cI[0, m, 0][0] < L:
                cute.copy(vb, pw_s[None, m, None], fx)
                cute.copy(vb, fx, gw[None, m, None])
                cute.copy(vb, pu_s[None, m, None], fk)
                cute.copy(vb, fk, gu[None, m, None])

    @cute.jit
    def inverse(self, sL, warp, lane):
        """X = (I + L)^-1 in place of L (L strictly lower, fp32; its upper blocks are already 0), blocked by 16.
        Warp b inverts the diagonal block b by substitution (lane j: column j). Then, row block by row block
        (b = 1..3), warp c < b computes X_bc = -X_bb T, T = sum_{c <= m < b} L_bm X_mc: T in registers, a barrier
        (every warp has read L's row block b), T staged in X_bc's place, the product with X_bb, X_bc written."""
        b0 = warp * BC
        j = lane % BC
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
        half = lane // BC
        col = b0 + j
        t = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        for bb in cutlass.range_constexpr(1, BT // BC):
            r0 = bb * BC + half * 8
            for r in cutlass.range_constexpr(8):
                t[r] = Float32(0.0)
            if warp < bb:
                for m in cutlass.range(b0, bb * BC, unroll=4):
                    xm = sL[m, col]
                    for r in cutlass.range_constexpr(8):
                        t[r] += sL[r0 + r, m] * xm
            cute.arch.sync_threads()
            if warp < bb:
                for r in cutlass.range_constexpr(8):
                    sL[r0 + r, col] = t[r]
                cute.arch.sync_warp()
                for r in cutlass.range_constexpr(8):
                    t[r] = Float32(0.0)
                for m in cutlass.range_constexpr(BC):
                    tm = sL[bb * BC + m, col]
                    for r in cutlass.range_constexpr(8):
                        t[r] += sL[r0 + r, bb * BC + m] * tm
                cute.arch.sync_warp()
                for r in cutlass.range_constexpr(8):
                    sL[r0 + r, col] = -t[r]
        cute.arch.sync_threads()
