"""KDA prefill, stage 1 of 2, tensor-core version: the chunk-parallel kernel for the safe gate (bounded decay).

Same contract as `chunk_intra.py` (writes w, u, qg, kg, Aqk in token layout [TT, HV, *] bf16 and gl [NC, HV, K]
fp32 for stage 2). It serves the safe gate with lower_bound >= forward.TC_LOWER_BOUND_MIN (-5, FLA's safe range):
every per-token log decay lies in (lower_bound, 0), so G changes by less than 16 |lower_bound| <= 80 across a
16-token block and no factor below exceeds e^80 (fp32 / bf16 overflow at e^88.7); factors below 1 may underflow
to 0 where the exact term is below fp32's range anyway. The other gates (softplus, precomputed: unbounded decays)
stay on `chunk_intra.py`.

One CTA (256 threads, 8 warps) per (chunk of 64 tokens, value head): grid x = NC * G chunk-major, so the G value
heads of a q/k head's group run in adjacent CTAs and re-read q, k from L2. One head per CTA keeps the kernel
loop-free: a loop over the group would hold every swizzled shared-memory address live across it. Every log decay
below is kept in base 2 (log2 e times the natural one: the gate's lower bound and A_log's rate carry the factor),
so each exponential is one ex2; gl leaves in the natural log. Per CTA, in order:

    G      chunk-local cumulative log gate in fp32: thread (quarter, pair) scans 16 rows of two columns in
           registers, each quarter then adds the totals of the quarters before it; G passes through shared memory
           once, into registers in the row layout of the 16-byte vector copies (each thread's 4 rows x 8 columns:
           every operand row and qg / kg row a thread builds is its own). The block boundaries B_0 = 0,
           B_m = G[16 m - 1] (m = 1..3), B_4 = G_last go to a small table, with S_pc = e^(B_p - B_{c+1}) per channel
           for the 10 blocks (p, c), c <= p
    build  one pass over the thread's rows (row i in block m), with the rows' L2 norms (16 threads per row, a
           butterfly; the norm scales q in fp32, k is normalised to bf16 as FLA's l2norm output): q e^(G_i - B_m)
           in place of q and k e^(G_i - B_m) (row operands, <= 1), k e^(B_{m+1} - G_i) (column operand, <= 1);
           qg = scale q e^G and kg = k e^(G_last - G) out, k e^G in place of k, gl = G_last out
    scores Aqk[i, j] = scale (q_i e^(G_i - B_p)) . (k_j e^(B_{c+1} - G_j) S_pc)   (i in block p, j in block c, j <= i)
           L[i, j]   = beta_i (k_i e^(G_i - B_p)) . (k_j e^(B_{c+1} - G_j) S_pc)  (j < i)
           exact per term (the exponents add up to G_i - G_j; no cancellation, nothing divides by a decay); the
           column fragment is scaled by S_pc in registers after its ldmatrix (fp32 multiply, one more bf16
           rounding) once for both products. The 10 pairs (p, c) over the 8 warps (pairs 8 - 9 on warps 0 - 1),
           two mma.sync GEMMs each (16 x 16 x 128); Aqk leaves from the accumulators, L waits in registers until
           its region is free
    Akk    (I + L)^-1 in place of L, blocked by 16: the four diagonal blocks by substitution in fp32 (warps 0-3,
           one each), then row block by row block X_bc = -X_bb sum_m L_bm X_mc on tensor cores, every fp32
           operand split into bf16 hi + lo (three mma.sync passes: ~16 bits per product, fp32 accumulation;
           FLA's solve_tril runs these products in TF32)
    w, u   (Akk diag(beta)) @ [k e^G | v] on tensor cores (Akk diag(beta) in bf16, as FLA's solve_tril output;
           8 warps, 4 along M x 2 along N, one accumulator at a time)
Row blocks wholly past a partial chunk's end skip their scores, inverse rows and gate-scan quarter (branches
uniform across the CTA or the warp); what they would have written is never read.

Pipeline and memory: q, k (and a bf16 g) by 16-byte cp.async in one round trip (the gate's parameters and beta
load meanwhile), v by cp.async into q's place while the inverse runs; qg, kg, w, u out with 16-byte stores (w and
u staged in the places of their right-hand sides k e^G and v), Aqk in 4-byte pairs (its blocks above the diagonal
as zeros). Shared memory 72 KiB: q (then its row operand, v, the u staging) and k (then k e^G, the w staging) bf16
tiles (32 KiB), a 16 KiB region R (raw g; the column operands; Akk diag(beta)) and the L tile (fp32, 16.25 KiB:
the row operands of k, then L and the inverse in place) back to back (before the build, R and L carry G from the
scan to the registers), the boundary table (2.5 KiB), the S table (5 KiB) and beta. Three CTAs (24 warps) per
SM: launched with a three-CTA register bound (80 registers). Assumes contiguous, 16-byte aligned q/k/v/g
(forward.py copies a misaligned view), K = V = 128, chunks starting at every sequence start (varlen through
cu_seqlens and the chunk offsets: a binary search, no host synchronisation); a chunk index past the last chunk
exits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, vec_copy
from cula_core.cute_kernels.warp_mma import (gemm, ldmatrix_copy_A, ldmatrix_copy_B, mma_atom, smem_tile_layout,
                                             tiled_mma, transposed)
from cula_sm90.prefill import common

BT = 64
DK = 128
BC = 16
LPAD = BT + 1  # fp32 row stride of L: odd, so accesses down a column (solve, fragments) spread over the banks
THREADS = 256
R_BYTES = BT * DK * 2  # the region R: raw g, then the column operands k e^(B_{c+1} - G), then Akk diag(beta)
PAIRS = 10  # (p, c) blocks with c <= p
L_BYTES = BT * LPAD * 4
SCAN_ROWS = BT // (2 * THREADS // DK)  # rows of G's two columns each scanning thread sums
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


class ChunkIntraTCKernel(common.Stage1Launch):
    """Compile-time configuration (common.Stage1Launch): beta activation, L2 norm, which gate parameters exist;
    the gate is `safe`."""

    threads = THREADS
    cta_per_value_head = True
    min_ctas_per_sm = 3  # 80 registers: the 72 KiB of shared memory already fit three CTAs
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
        # q, then v (cp.async once qg is out), then the u staging; k, then k e^G (in place), then the w staging
        sQ = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, DK), 128)
        sK = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, DK), 128)
        # the region R (16 KiB) and the L tile (fp32) back to back; before the build both hold G (fp32, 32 KiB)
        # on its way from the scan's column layout to the registers of the row layout
        r_raw = smem.allocate(R_BYTES + L_BYTES, 128)
        r_bf = cute.recast_ptr(r_raw, dtype=BFloat16)
        sGin = cute.make_tensor(r_bf, cute.make_layout((BT, DK), stride=(DK, 1)))  # raw g (bf16), R's 16 KiB
        sKc = cute.make_tensor(r_bf, smem_tile_layout(BT, DK))  # k e^(B_{c+1} - G) per block c
        sAk = cute.make_tensor(r_bf, smem_tile_layout(BT, BT))  # Akk diag(beta), bf16
        # k e^(G - B_m) per block m (the L rows), in L's region until the L scores are read
        sKr = cute.make_tensor(cute.recast_ptr(r_raw + R_BYTES, dtype=BFloat16), smem_tile_layout(BT, DK))
        sG = cute.make_tensor(cute.recast_ptr(r_raw, dtype=Float32), cute.make_layout((BT, DK), stride=(DK, 1)))
        sL = cute.make_tensor(cute.recast_ptr(r_raw + R_BYTES, dtype=Float32),
                              cute.make_layout((BT, BT), stride=(LPAD, 1)))
        # the block boundaries B_0 .. B_4 (B_4 = G_last); rows 0 - 2 first carry the scan's quarter totals
        sRef = smem.allocate_tensor(Float32, cute.make_layout((5, DK), stride=(DK, 1)), 128)
        sB = smem.allocate_tensor(Float32, cute.make_layout(BT), 16)
        sS = smem.allocate_tensor(Float32, cute.make_layout((PAIRS, DK), stride=(DK, 1)), 16)

        _, t0, L, valid = common.find_chunk(cu, co, chunk, N, search_steps)
        if valid:
            cp = g2s_tiled_copy(DK, self.threads)
            copy_rows_g2s(cp, head_rows(q, t0, h, BT), sQ, L, tid)
            copy_rows_g2s(cp, head_rows(k, t0, h, BT), sK, L, tid)
            if const_expr(self.g_smem):  # g in the same round trip
                copy_rows_g2s(cp, head_rows(g, t0, hv, BT), sGin, L, tid)
            cute.arch.cp_async_commit_group()
            # the gate's parameters and beta load while the copies fly
            pair = tid % (DK // 2)
            a_rate = Float32(1.0)
            if const_expr(self.has_a_log):
                a_rate = cute.math.exp(alog[hv].to(Float32), fastmath=True)
            a_rate = a_rate * LOG2E  # the sigmoid's exponent in base 2
            bias0 = Float32(0.0)
            bias1 = Float32(0.0)
            if const_expr(self.has_dt_bias):
                bias0 = dtb[hv, 2 * pair].to(Float32)
                bias1 = dtb[hv, 2 * pair + 1].to(Float32)
            b = Float32(0.0)
            if tid < L:
                b = common.activate_beta(beta[t0 + tid, hv].to(Float32), self.beta_activation)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self.head(hv, chunk, t0, L, sQ, sK, sGin, sKc, sKr, sAk, sG, sL, sRef, sS, sB, v, g, w, u, qg, kg, aqk, gl,
                      a_rate, bias0, bias1, b, scale, lower_bound, tid)

    @cute.jit
    def row_rnorm(self, f):
        """1 / sqrt(sum x^2 + 1e-6) of the row whose 8 columns `f` holds in the vector copies' layout (16 threads
        per row: a butterfly over them); 1 without the L2 norm. Rows past the chunk's end are zero: 0 * 1e3."""
        rs = Float32(1.0)
        if const_expr(self.l2norm):
            ss = Float32(0.0)
            for e in cutlass.range_constexpr(8):
                x = f[e].to(Float32)
                ss += x * x
            for off in cutlass.range_constexpr(4):
                ss += cute.arch.shuffle_sync_bfly(ss, offset=8 >> off)
            rs = cute.math.rsqrt(ss + 1e-6)
        return rs

    @cute.jit
    def head(self, hv: Int32, chunk: Int32, t0: Int32, L: Int32, sQ, sK, sGin, sKc, sKr, sAk, sG, sL, sRef, sS, sB,
             v, g, w, u, qg, kg, aqk, gl, a_rate: Float32, bias0: Float32, bias1: Float32, b: Float32, scale: Float32,
             lower_bound: Float32, tid):
        warp = tid // 32
        lane = tid % 32
        # ---- the log gate and its chunk-local cumulative sum: thread (quarter, pair) scans rows
        # [16 quarter, 16 quarter + 16) of columns 2 pair and 2 pair + 1 in registers (one 4-byte load and one
        # 8-byte store per row); each quarter then adds the totals of the quarters before it. Rows past the end
        # add nothing (identity transitions). bf16 g came by cp.async with q and k, fp32 g by loads coalesced
        # across the warp
        lb2 = lower_bound * LOG2E  # G is kept in base 2 (log2 e times the natural log decay) until gl leaves
        pair = tid % (DK // 2)
        quarter = tid // (DK // 2)
        col = 2 * pair
        acc0 = Float32(0.0)
        acc1 = Float32(0.0)
        part = cute.make_rmem_tensor(cute.make_layout((2, SCAN_ROWS), stride=(1, 2)), Float32)
        gin = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        part.fill(0.0)
        if quarter * SCAN_ROWS < L:  # a quarter wholly past the end adds nothing: no loads, no exps
            for mm in cutlass.range_constexpr(SCAN_ROWS):
                row = quarter * SCAN_ROWS + mm
                if const_expr(self.g_smem):  # zero-filled past the end
                    cute.autovec_copy(cute.local_tile(sGin, (1, 2), (row, pair))[0, None], gin)
                    part[0, mm] = gin[0].to(Float32)
                    part[1, mm] = gin[1].to(Float32)
                else:
                    x0 = Float32(0.0)
                    x1 = Float32(0.0)
                    if row < L:
                        x0 = g[t0 + row, hv, col].to(Float32)
                        x1 = g[t0 + row, hv, col + 1].to(Float32)
                    part[0, mm] = x0
                    part[1, mm] = x1
            for mm in cutlass.range_constexpr(SCAN_ROWS):
                # lower_bound * sigmoid(y) through rcp.approx (2^-23 relative): an IEEE division would add a
                # slow-path check and branch per element
                y0 = a_rate * (part[0, mm] + bias0)
                y1 = a_rate * (part[1, mm] + bias1)
                s0 = lb2 * cute.arch.rcp_approx(1.0 + cute.math.exp2(-y0, fastmath=True))
                s1 = lb2 * cute.arch.rcp_approx(1.0 + cute.math.exp2(-y1, fastmath=True))
                if quarter * SCAN_ROWS + mm < L:
                    acc0 += s0
                    acc1 += s1
                part[0, mm] = acc0
                part[1, mm] = acc1
        if quarter < 3:  # sRef's rows 0 - 2 carry the quarter totals until the boundaries take them
            sRef[quarter, col] = acc0
            sRef[quarter, col + 1] = acc1
        if tid < BT:
            sB[tid] = b
        cute.arch.sync_threads()  # g is read (G may take its place) and the quarter totals are written
        base0 = Float32(0.0)
        base1 = Float32(0.0)
        for qq in cutlass.range_constexpr(3):
            if qq < quarter:
                base0 += sRef[qq, col]
                base1 += sRef[qq, col + 1]
        gout = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        for mm in cutlass.range_constexpr(SCAN_ROWS):
            gout[0] = base0 + part[0, mm]
            gout[1] = base1 + part[1, mm]
            cute.autovec_copy(gout, cute.local_tile(sG, (1, 2), (quarter * SCAN_ROWS + mm, pair))[0, None])
        cute.arch.sync_threads()

        # ---- G into registers in the row layout of the 16-byte vector copies (thread: columns c0 .. c0 + 7 of
        # rows 16 m + tid // 16): every row block's operands and qg / kg read only the thread's own rows; the
        # block boundaries go to sRef for every thread
        vb = vec_copy(DK, self.threads)
        vf = vec_copy(DK, self.threads, Float32)
        tb = vb.get_slice(tid)
        tf = vf.get_slice(tid)
        pG = tf.partition_S(sG)
        rG = cute.make_fragment_like(pG)
        cute.copy(vf, pG, rG)
        for i in cutlass.range_constexpr((5 * DK + self.threads - 1) // self.threads):
            idx = i * self.threads + tid
            if idx < 5 * DK:
                r = idx // DK
                x = Float32(0.0)
                if r > 0:
                    x = sG[r * BC - 1, idx % DK]  # rows past a partial chunk's end add nothing to G
                sRef[r, idx % DK] = x
        # S_pc = e^(B_p - B_{c+1}) per channel, pair index p (p + 1) / 2 + c
        for i in cutlass.range_constexpr((PAIRS * DK + self.threads - 1) // self.threads):
            idx = i * self.threads + tid
            if idx < PAIRS * DK:
                pr = idx // DK
                d = idx % DK
                p, c = self.pair_of(pr)
                bp = Float32(0.0)
                if p > 0:
                    bp = sG[p * BC - 1, d]
                sS[pr, d] = cute.math.exp2(bp - sG[c * BC + BC - 1, d], fastmath=True)
        cute.arch.sync_threads()  # G's staging area is free: the score operands and L take it

        # ---- one pass over the thread's rows (row 16 m + tid // 16 of block m), each row L2-normalised first:
        # with a = e^(G - B_m), cc = e^(B_{m+1} - G) (both <= 1; ex2 of base-2 differences): q a in place of q,
        # k a (the L rows) in the L region, k cc (the columns) in R; qg = scale q e^G and kg = k e^(G_last - G)
        # out, k e^G in place of k
        pQ = tb.partition_S(sQ)
        pK = tb.partition_S(sK)
        pQd = tb.partition_D(sQ)
        pKd = tb.partition_D(sK)
        pKr = tb.partition_D(sKr)
        pKc = tb.partition_D(sKc)
        cI = tb.partition_S(cute.make_identity_tensor((BT, DK)))
        gq = tb.partition_D(head_rows(qg, t0, hv, BT))
        gk = tb.partition_D(head_rows(kg, t0, hv, BT))
        fx = cute.make_fragment_like(pQ[None, 0, None])
        fk = cute.make_fragment_like(pQ[None, 0, None])
        fo = cute.make_fragment_like(pQ[None, 0, None])
        gr = cute.make_fragment_like(self.ref_row(sRef, 0, tf))
        for m in cutlass.range_constexpr(BT // BC):
            row = cI[0, m, 0][0]
            # q's products first (q dies), then k's
            cute.copy(vb, pQ[None, m, None], fx)
            cute.copy(vf, self.ref_row(sRef, m, tf), gr)
            rq = self.row_rnorm(fx)
            for e in cutlass.range_constexpr(8):
                fo[e] = (fx[e].to(Float32) * rq * cute.math.exp2(rG[e, m, 0] - gr[e], fastmath=True)).to(BFloat16)
            cute.copy(vb, fo, pQd[None, m, None])  # q is in fx: q a may take its place
            for e in cutlass.range_constexpr(8):
                fo[e] = (fx[e].to(Float32) * (rq * scale) * cute.math.exp2(rG[e, m, 0], fastmath=True)).to(BFloat16)
            if row < L:
                cute.copy(vb, fo, gq[None, m, None])
            cute.copy(vb, pK[None, m, None], fk)
            rk = self.row_rnorm(fk)
            if const_expr(self.l2norm):
                for e in cutlass.range_constexpr(8):
                    fk[e] = (fk[e].to(Float32) * rk).to(BFloat16)
            for e in cutlass.range_constexpr(8):  # gr still holds B_m
                fo[e] = (fk[e].to(Float32) * cute.math.exp2(rG[e, m, 0] - gr[e], fastmath=True)).to(BFloat16)
            cute.copy(vb, fo, pKr[None, m, None])
            cute.copy(vf, self.ref_row(sRef, m + 1, tf), gr)
            for e in cutlass.range_constexpr(8):
                fo[e] = (fk[e].to(Float32) * cute.math.exp2(gr[e] - rG[e, m, 0], fastmath=True)).to(BFloat16)
            cute.copy(vb, fo, pKc[None, m, None])
            cute.copy(vf, self.ref_row(sRef, 4, tf), gr)
            for e in cutlass.range_constexpr(8):
                fo[e] = (fk[e].to(Float32) * cute.math.exp2(gr[e] - rG[e, m, 0], fastmath=True)).to(BFloat16)
            if row < L:
                cute.copy(vb, fo, gk[None, m, None])
            for e in cutlass.range_constexpr(8):
                fo[e] = (fk[e].to(Float32) * cute.math.exp2(rG[e, m, 0], fastmath=True)).to(BFloat16)
            cute.copy(vb, fo, pKd[None, m, None])  # k e^G in place of k
        if tid < DK:
            gl[chunk, hv, tid] = sRef[4, tid] * LN2
        cute.arch.sync_threads()  # every operand tile is written

        # ---- scores: the 10 block pairs (p, c), c <= p, over the 8 warps (warp w: pair w, then warps 0 - 1: pairs
        # 8 - 9); one warp computes both Aqk_pc and L_pc from one column fragment, k cc of block c scaled per
        # channel by S_pc = e^(B_p - B_{c+1}) in registers. Aqk leaves from the accumulators; L waits in registers
        # until every warp has read the k row operands (they share L's region)
        mma1 = tiled_mma(1)
        thr1 = mma1.get_slice(lane)
        cC = thr1.partition_C(cute.make_identity_tensor((BC, BC)))
        a_pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        nacc = cute.size(thr1.partition_shape_C((BC, BC)))
        acc_l = cute.make_rmem_tensor(cute.make_layout((nacc, 2), stride=(1, nacc)), Float32)
        acc_q = cute.make_rmem_tensor(thr1.partition_shape_C((BC, BC)), Float32)
        acc_k = cute.make_rmem_tensor(thr1.partition_shape_C((BC, BC)), Float32)
        for slot in cutlass.range_constexpr(2):
            pr = warp + 8 * slot
            p, c = self.pair_of(pr)
            if (slot == 0 or warp < PAIRS - 8) and p * BC < L:
                acc_q.fill(0.0)
                acc_k.fill(0.0)
                self.gemm_pair(mma1, acc_q, acc_k, cute.local_tile(sQ, (BC, DK), (p, 0)),
                               cute.local_tile(sKr, (BC, DK), (p, 0)), cute.local_tile(sKc, (BC, DK), (c, 0)),
                               sS, pr, lane)
                for e2 in cutlass.range_constexpr(cute.size(acc_q) // 2):
                    i, jj = cC[2 * e2]
                    row = p * BC + i
                    col = c * BC + jj
                    for x in cutlass.range_constexpr(2):
                        av = Float32(0.0)
                        if col + x <= row:
                            av = acc_q[2 * e2 + x] * scale
                        a_pair[x] = av.to(BFloat16)
                    if row < L:
                        # aqk's strides are runtime values: the pair's 4-byte alignment is asserted
                        off = cute.assume(cute.crd2idx((t0 + row, hv, col), aqk.layout), divby=2)
                        cute.autovec_copy(a_pair, cute.make_tensor(aqk.iterator + off, cute.make_layout(2)))
                for e in cutlass.range_constexpr(nacc):
                    acc_l[e, slot] = acc_k[e]
        # Aqk's blocks above the diagonal: zeros (stage 2 reads whole rows)
        self.zero_upper_aqk(aqk, t0, hv, L, tid)
        cute.arch.sync_threads()  # the L rows are read: L takes their region
        for slot in cutlass.range_constexpr(2):
            pr = warp + 8 * slot
            p, c = self.pair_of(pr)
            if (slot == 0 or warp < PAIRS - 8) and p * BC < L:
                for e in cutlass.range_constexpr(nacc):
                    i, jj = cC[e]
                    row = p * BC + i
                    col = c * BC + jj
                    lv = Float32(0.0)
                    if col < row:
                        lv = acc_l[e, slot] * sB[row]
                    sL[row, col] = lv
        cute.arch.sync_threads()  # L is written; q a is read: v may take q's place

        # ---- v in flight (cp.async) while the inverse runs
        copy_rows_g2s(g2s_tiled_copy(DK, self.threads), head_rows(v, t0, hv, BT), sQ, L, tid)
        cute.arch.cp_async_commit_group()
        self.inverse(sL, L, warp, lane)

        # ---- Akk diag(beta) in bf16 (as FLA's solve_tril output) for the w / u GEMMs
        for m in cutlass.range(BT * BT // self.threads, unroll=4):
            i = m * (self.threads // BT) + tid // BT
            jj = tid % BT
            x = Float32(0.0)
            if jj <= i:  # the blocks above the diagonal were never written
                x = sL[i, jj] * sB[jj]
            sAk[i, jj] = x.to(BFloat16)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        # ---- w = Akk diag(beta) @ (k e^G), u = Akk diag(beta) @ v (8 warps: 4 along M x 2 along N), one
        # accumulator in turn; each result is staged as bf16 in the place of its right-hand side once every warp
        # has read it, then both go out in 16-byte vectors
        mma8 = tiled_mma(4, 2)
        thr8 = mma8.get_slice(tid)
        acc_o = cute.make_rmem_tensor(thr8.partition_shape_C((BT, DK)), Float32)
        for out in cutlass.range_constexpr(2):
            rhs = sK
            if const_expr(out == 1):
                rhs = sQ
            acc_o.fill(0.0)
            gemm(mma8, acc_o, sAk, transposed(rhs, BT, DK), tid, False, True)
            cute.arch.sync_threads()
            pd = thr8.partition_C(rhs)
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                pd[e] = acc_o[e].to(BFloat16)
        cute.arch.sync_threads()
        gw = tb.partition_D(head_rows(w, t0, hv, BT))
        gu = tb.partition_D(head_rows(u, t0, hv, BT))
        for m in cutlass.range_constexpr(cute.size(pQ.shape[1])):
            if cI[0, m, 0][0] < L:
                cute.copy(vb, pK[None, m, None], fx)
                cute.copy(vb, fx, gw[None, m, None])
                cute.copy(vb, pQ[None, m, None], fk)
                cute.copy(vb, fk, gu[None, m, None])

    @cute.jit
    def pair_of(self, pr):
        """(p, c) of pair index pr = p (p + 1) / 2 + c, c <= p < 4."""
        p = Int32(0)
        for q_ in cutlass.range_constexpr(1, 4):
            if pr >= q_ * (q_ + 1) // 2:
                p = Int32(q_)
        return p, pr - p * (p + 1) // 2

    @cute.jit
    def gemm_pair(self, mma, acc_q, acc_k, sQr, sKr, sKc, sS, pr, lane):
        """acc_q += sQr @ (sKc diag(S_pr))^T and acc_k += sKr @ (sKc diag(S_pr))^T for one warp (16 x 16 x 128 each):
        ldmatrix fragments k-block by k-block; the column fragment is scaled once per channel (its k index) by row
        pr of the S table in fp32, rounded to bf16, and feeds both products. The S values come through a view of
        that row with row stride 0, partitioned like the column operand (each fragment element meets its own
        channel's factor)."""
        thr = mma.get_slice(lane)
        rQ = thr.make_fragment_A(thr.partition_A(cute.local_tile(sQr, (BC, 16), (0, 0))))
        rK = thr.make_fragment_A(thr.partition_A(cute.local_tile(sKr, (BC, 16), (0, 0))))
        rB = thr.make_fragment_B(thr.partition_B(cute.local_tile(sKc, (BC, 16), (0, 0))))
        pS = thr.partition_B(cute.make_tensor(sS.iterator + pr * DK, cute.make_layout((BC, DK), stride=(0, 1))))
        rS = cute.make_fragment_like(pS[None, None, 0], Float32)
        ldA = ldmatrix_copy_A(mma, BFloat16, False)
        ldB = ldmatrix_copy_B(mma, BFloat16, False)
        tA = ldA.get_slice(lane)
        tB = ldB.get_slice(lane)
        srcQ = tA.partition_S(sQr)
        srcK = tA.partition_S(sKr)
        srcB = tB.partition_S(sKc)
        dstQ = tA.retile(rQ)
        dstK = tA.retile(rK)
        dstB = tB.retile(rB)
        for kb in cutlass.range_constexpr(DK // 16):
            cute.copy(ldB, srcB[None, None, kb], dstB[None, None, 0])
            cute.autovec_copy(pS[None, None, kb], rS)
            cute.copy(ldA, srcQ[None, None, kb], dstQ[None, None, 0])
            cute.copy(ldA, srcK[None, None, kb], dstK[None, None, 0])
            for e in cutlass.range_constexpr(cute.size(rB)):
                rB[e] = (rB[e].to(Float32) * rS[e]).to(BFloat16)
            cute.gemm(mma, acc_q, rQ[None, None, 0], rB[None, None, 0], acc_q)
            cute.gemm(mma, acc_k, rK[None, None, 0], rB[None, None, 0], acc_k)

    @cute.jit
    def zero_upper_aqk(self, aqk, t0, hv, L, tid):
        """Zeros into Aqk's blocks above the diagonal (row block p, columns from 16 (p + 1)) of the valid rows, in
        4-byte pairs: no warp computes them, and stage 2 reads whole rows."""
        z = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        z.fill(0.0)
        for it in cutlass.range_constexpr(BT * BT // 2 // self.threads):
            idx = it * self.threads + tid
            row = idx // (BT // 2)
            col = 2 * (idx % (BT // 2))
            if row < L and col >= (row // BC + 1) * BC:
                off = cute.assume(cute.crd2idx((t0 + row, hv, col), aqk.layout), divby=2)
                cute.autovec_copy(z, cute.make_tensor(aqk.iterator + off, cute.make_layout(2)))

    @cute.jit
    def ref_row(self, sRef, r: cutlass.Constexpr, thr):
        """Row r of sRef as this thread's 8 columns (c0 .. c0 + 7) in the vector copies' layout: the row seen as
        a (16, DK) tile with row stride 0, partitioned like the 16 rows of one vector pass."""
        view = cute.make_tensor(sRef.iterator + r * DK, cute.make_layout((BC, DK), stride=(0, 1)))
        return thr.partition_S(view)[None, 0, None]

    @cute.jit
    def inverse(self, sL, L: Int32, warp, lane):
        """X = (I + L)^-1 in place of L (L strictly lower, fp32; its upper blocks are already 0), blocked by 16.
        Warp b < 4 inverts the diagonal block b by substitution in fp32 (lane j: column j). Then, row block by row
        block (b = 1..3), warp c + 4 h (c < b, h < 2) computes columns [8 h, 8 h + 8) of X_bc = -X_bb T,
        T = sum_{c <= m < b} L_bm X_mc, on tensor cores: mma.sync m16n8k16 with every fp32 operand split into
        bf16 hi + lo (hi hi + hi lo + lo hi: ~16 bits per product, fp32 accumulation). T is staged in X_bc's
        place, L_bc's, once every warp of the row block has its sum (a CTA barrier: the warps of the columns
        left of c read L_bc), and read back by its own warp (warp barriers); a CTA barrier ends each row block
        (the next one reads X_bc). Row blocks wholly past the chunk's end are skipped (their rows of X are never read)."""
        b0 = (warp % 4) * BC
        j = lane % BC
        if warp < 4 and b0 < L:
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
        mma = cute.make_tiled_mma(mma_atom(), (1, 1, 1))  # one warp, a 16 x 8 output per product
        thr = mma.get_slice(lane)
        cA = thr.partition_A(cute.make_identity_tensor((BC, BC)))  # (row, k)
        cB = thr.partition_B(cute.make_identity_tensor((8, BC)))  # (column, k)
        cC = thr.partition_C(cute.make_identity_tensor((BC, 8)))  # (row, column)
        a_hi = cute.make_rmem_tensor(thr.partition_shape_A((BC, BC)), BFloat16)
        a_lo = cute.make_rmem_tensor(thr.partition_shape_A((BC, BC)), BFloat16)
        b_hi = cute.make_rmem_tensor(thr.partition_shape_B((8, BC)), BFloat16)
        b_lo = cute.make_rmem_tensor(thr.partition_shape_B((8, BC)), BFloat16)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BC, 8)), Float32)
        c = warp % 4
        col0 = c * BC + (warp // 4) * 8  # this warp's 8 columns of X_bc
        for bb in cutlass.range_constexpr(1, BT // BC):
            r0 = bb * BC
            if r0 < L:
                self.inverse_row_block(sL, mma, cA, cB, cC, a_hi, a_lo, b_hi, b_lo, acc, c, col0, bb)

    @cute.jit
    def inverse_row_block(self, sL, mma, cA, cB, cC, a_hi, a_lo, b_hi, b_lo, acc, c, col0, bb: cutlass.Constexpr):
        """Row block bb of the inverse's off-diagonal part (see inverse); ends with a CTA barrier."""
        r0 = bb * BC
        if c < bb:
            # T = sum_m L_bm X_mc (X_mc = 0 for m < c)
            acc.fill(0.0)
            for m in cutlass.range_constexpr(bb):
                if c <= m:
                    self.load_split(sL, cA, a_hi, a_lo, r0, m * BC, False)
                    self.load_split(sL, cB, b_hi, b_lo, m * BC, col0, True)
                    self.mma_split(mma, acc, a_hi, a_lo, b_hi, b_lo)
        # T takes the place of L_bc, which the warps of the columns left of c still read for their own sums
        cute.arch.sync_threads()
        if c < bb:
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, n = cC[e]
                sL[r0 + i, col0 + n] = acc[e]
            cute.arch.sync_warp()
            # X_bc = -X_bb T
            acc.fill(0.0)
            self.load_split(sL, cA, a_hi, a_lo, r0, r0, False)
            self.load_split(sL, cB, b_hi, b_lo, r0, col0, True)
            self.mma_split(mma, acc, a_hi, a_lo, b_hi, b_lo)
            cute.arch.sync_warp()  # every lane has read T before X_bc takes its place
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, n = cC[e]
                sL[r0 + i, col0 + n] = -acc[e]
        cute.arch.sync_threads()

    @cute.jit
    def load_split(self, sL, coords, hi, lo, row0, col0, k_rows: cutlass.Constexpr):
        """An operand fragment from the fp32 tile sL, split into bf16 hi + lo. `coords` holds each fragment
        element's (outer, k) coordinate: the element is sL[row0 + outer, col0 + k], or (`k_rows`, a B operand
        read from its [k][column] storage) sL[row0 + k, col0 + outer]."""
        for e in cutlass.range_constexpr(cute.size(hi)):
            o, kk = coords[e]
            x = Float32(0.0)
            if const_expr(k_rows):
                x = sL[row0 + kk, col0 + o]
            else:
                x = sL[row0 + o, col0 + kk]
            h = x.to(BFloat16)
            hi[e] = h
            lo[e] = (x - h.to(Float32)).to(BFloat16)

    @cute.jit
    def mma_split(self, mma, acc, a_hi, a_lo, b_hi, b_lo):
        """acc += A B^T from split operands: hi hi + hi lo + lo hi (lo lo is below fp32 rounding of the sum)."""
        cute.gemm(mma, acc, a_hi, b_hi, acc)
        cute.gemm(mma, acc, a_hi, b_lo, acc)
        cute.gemm(mma, acc, a_lo, b_hi, acc)
