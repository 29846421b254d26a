"""KDA prefill, stage 1 of 2: the chunk-parallel kernel (fused preprocessing + intra-chunk WY form).

One CTA per (chunk of 64 tokens, q/k head), 256 threads (8 warps); it loops over the G = HV / HQK value heads
of its q/k head, so q and k are read and L2-normalised once per group (GVA). Per value head:

    G      chunk-local cumulative sum of the log gate (from raw g in kernel: softplus or safe; or g as given)
    Aqk    [i, j] = scale * sum_d q_i k_j exp(G_i - G_j)          (j <= i, else 0)
    L      [i, j] = beta_i * sum_d k_i k_j exp(G_i - G_j)         (j < i)
    Akk    (I + L)^{-1}                w, u = Akk @ [beta * k * exp(G) | beta * v]
    qg     scale * q * exp(G)        kg = k * exp(G_last - G)      gl = G_last (the chunk's total log decay)

and writes w, u, qg, kg, Aqk (token layout [TT, HV, *], bf16) and gl ([NC, HV, K], fp32) for stage 2
(`chunk_state_wg.py`), which walks the chunks of a segment serially.

Numerics: every decay is exp of a difference of cumulative log gates that is <= 0 (for g <= 0). The score
matrices go in 16-row blocks: inside a diagonal 16x16 block the decays are pairwise; a block p reaches the
columns before it through the block's first token n = 16 p, as exp(G_i - G_n) * exp(G_n - G_j), both factors
<= 1, so nothing overflows whatever the gate (the factorisation of cula_core.reference). Scores, Akk (forward
substitution on the columns of I, 4 threads per column) and the gate are fp32 FMA; w and u are mma.sync
m16n8k16 GEMMs (Akk split into bf16 hi + lo, right-hand sides bf16, fp32 accumulation): warps 0-3 compute w,
warps 4-7 u, through one code path.

Shared memory (~220 KB: one CTA per SM): q, k, G as [64, 128] fp32 with rows padded to 129 words (threads
reading one column of different rows hit different banks), the score matrices [64, 65] fp32, a scratch for one
row block's factorised operands, Akk hi/lo and the two right-hand sides as swizzled bf16 tiles. Loops are
dynamic where they can be (short code). Assumes contiguous inputs, q/k/v in one 16-bit dtype, K = V = 128,
chunks starting at every sequence start (varlen through cu_seqlens and the chunk offsets, found by a binary
search: no host synchronisation); a chunk index past the last chunk exits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, tiled_mma, transposed
from cula_sm90.prefill import common

BT = 64
DK = 128
BC = 16
PAD = DK + 1  # fp32 row stride of the [64, 128] shared tiles (bank-conflict padding)
APAD = BT + 1  # row stride of the [64, 64] score tiles


class ChunkIntraKernel(common.Stage1Launch):
    """Compile-time configuration: gate mode, beta activation, L2 norm, which gate parameters exist."""

    threads = 256

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               alog: cute.Tensor, dtb: cute.Tensor, cu: cute.Tensor, co: cute.Tensor, w: cute.Tensor,
               u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor, akk: cute.Tensor,
               gl: cute.Tensor, N: Int32, search_steps: Int32, G: Int32, scale: Float32, lower_bound: Float32):
        # akk: common.Stage1Launch's Akk output, never written here (training runs the tensor-core stage 1)
        tid, _, _ = cute.arch.thread_idx()
        chunk, h, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(PAD, 1)), 16)
        sK = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(PAD, 1)), 16)
        sG = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(PAD, 1)), 16)
        sA = smem.allocate_tensor(Float32, cute.make_layout((BT, BT), stride=(APAD, 1)), 16)
        sL = smem.allocate_tensor(Float32, cute.make_layout((BT, BT), stride=(APAD, 1)), 16)
        # one row block's factorised operands: rows 0..15 q_i e^(G_i-G_n), 16..31 k_i e^(G_i-G_n),
        # 32..79 k_j e^(G_n-G_j) for the columns j < n before the block
        sX = smem.allocate_tensor(Float32, cute.make_layout((5 * BC, DK), stride=(PAD, 1)), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(BT), 16)
        # Akk = (I + L)^-1 split hi + lo (bf16) and the right-hand sides of w and u (bf16), for the GEMMs
        sAkh = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, BT), 128)
        sAkl = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, BT), 128)
        sR2 = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, DK, 2), 128)

        _, t0, L, valid = common.find_chunk(cu, co, chunk, N, search_steps)
        if valid:
            # ---- q, k rows (L2-normalised once for the whole group of value heads): warp w owns q rows
            # 8w..8w+7 and the same k rows. A dynamic loop (small code: this kernel's straight-line code is
            # fetched once per CTA, so its length costs time) with 8 loads in flight per step.
            for rr in cutlass.range(8, unroll=1):
                row = warp * 8 + rr
                vals = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
                for e in cutlass.range_constexpr(4):
                    xq = Float32(0.0)
                    xk = Float32(0.0)
                    if row < L:
                        xq = q[t0 + row, h, lane + 32 * e].to(Float32)
                        xk = k[t0 + row, h, lane + 32 * e].to(Float32)
                    vals[e, 0] = xq
                    vals[e, 1] = xk
                for which in cutlass.range_constexpr(2):
                    rs = Float32(1.0)
                    if const_expr(self.l2norm):
                        ss = Float32(0.0)
                        for e in cutlass.range_constexpr(4):
                            ss += vals[e, which] * vals[e, which]
                        ss = cute.arch.warp_reduction_sum(ss)
                        rs = cute.math.rsqrt(ss + 1e-6)
                    for e in cutlass.range_constexpr(4):
                        if const_expr(which == 0):
                            sQ[row, lane + 32 * e] = vals[e, which] * rs
                        else:
                            sK[row, lane + 32 * e] = vals[e, which] * rs

            for j in cutlass.range(G):
                hv = h * G + j
                cute.arch.sync_threads()  # previous head done with sG/sA/sL/sB; q/k rows written
                # ---- log gate (element-wise, all threads), beta
                d = tid % DK
                a_rate = Float32(1.0)
                if const_expr(self.has_a_log):
                    a_rate = cute.math.exp(alog[hv].to(Float32), fastmath=True)
                bias = Float32(0.0)
                if const_expr(self.has_dt_bias):
                    bias = dtb[hv, d].to(Float32)
                # thread (half, d): rows 32 half .. 32 half + 31 of column d, loads issued together, the
                # gate and a local cumulative sum in registers; the second half then adds the first's total
                half = tid // DK
                r0 = half * (BT // 2)
                acc = Float32(0.0)
                for mb in cutlass.range(BT // 16, unroll=1):
                    gv = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                    for mm in cutlass.range_constexpr(8):
                        x = Float32(0.0)
                        if r0 + mb * 8 + mm < L:
                            x = g[t0 + r0 + mb * 8 + mm, hv, d].to(Float32)
                        gv[mm] = x
                    for mm in cutlass.range_constexpr(8):
                        if r0 + mb * 8 + mm < L:  # rows past the end add nothing (identity transitions)
                            acc += self.log_gate(gv[mm], a_rate, bias, lower_bound)
                        sG[r0 + mb * 8 + mm, d] = acc
                if tid < BT:
                    b = Float32(0.0)
                    if tid < L:
                        b = common.activate_beta(beta[t0 + tid, hv].to(Float32), self.beta_activation)
                    sB[tid] = b
                cute.arch.sync_threads()
                if half == 1:
                    first = sG[BT // 2 - 1, d]
                    for m in cutlass.range(BT // 2, unroll=4):
                        sG[BT // 2 + m, d] = sG[BT // 2 + m, d] + first
                cute.arch.sync_threads()
                self.scores(sQ, sK, sG, sA, sL, sX, sB, tid, scale)
                cute.arch.sync_threads()
                self.store_qk(sQ, sK, sG, sA, qg, kg, aqk, gl, tid, t0, L, hv, chunk, scale)
                self.solve_tc(sK, sG, sA, sL, sB, sAkh, sAkl, sR2, v, w, u, tid, t0, L, hv)

    @cute.jit
    def log_gate(self, x: Float32, a_rate: Float32, bias: Float32, lower_bound: Float32) -> Float32:
        """The per-element log decay from raw g (FLA's gates; see cula_core.reference.gates)."""
        r = x
        if const_expr(self.gate == "softplus"):
            y = x + bias
            sp = y
            if y <= 20.0:
                sp = cute.math.log1p(cute.math.exp(y, fastmath=True), fastmath=True)
            r = -a_rate * sp
        elif const_expr(self.gate == "safe"):
            y = a_rate * (x + bias)
            r = lower_bound / (1.0 + cute.math.exp(-y, fastmath=True))
        return r

    @cute.jit
    def scores(self, sQ, sK, sG, sA, sL, sX, sB, tid, scale: Float32):
        """Aqk (scaled, causal) into sA and beta-scaled strictly-lower L into sL, in 16-row blocks."""
        ti = tid // BC
        tj = tid % BC
        # diagonal 16x16 blocks: pairwise decays (tj > ti gives zeros, also above the diagonal of sA); a
        # dynamic loop over the blocks keeps the code short
        for p in cutlass.range(BT // BC, unroll=1):
            i = p * BC + ti
            jj = p * BC + tj
            a = Float32(0.0)
            lk = Float32(0.0)
            if tj <= ti:
                for dd in cutlass.range(DK, unroll=4):
                    kd = sK[jj, dd] * cute.math.exp(sG[i, dd] - sG[jj, dd], fastmath=True)
                    a += sQ[i, dd] * kd
                    lk += sK[i, dd] * kd
            sA[i, jj] = a * scale
            lval = Float32(0.0)
            if tj < ti:
                lval = lk * sB[i]
            sL[i, jj] = lval
            # blocks above the diagonal of Aqk stay zero (Aqk is written out in full)
            for pp in cutlass.range(p + 1, BT // BC, unroll=1):
                sA[i, pp * BC + tj] = Float32(0.0)
        # off-diagonal blocks of row block p, through the block's first token n = 16 p
        for p in cutlass.range_constexpr(1, BT // BC):
            nref = p * BC
            cute.arch.sync_threads()  # previous block's readers of sX are done
            for e in cutlass.range(tid, (2 + p) * BC * DK, self.threads):
                r = e // DK
                dd = e % DK
                if r < BC:
                    sX[r, dd] = sQ[nref + r, dd] * cute.math.exp(sG[nref + r, dd] - sG[nref, dd], fastmath=True)
                elif r < 2 * BC:
                    sX[r, dd] = sK[nref + r - BC, dd] * cute.math.exp(sG[nref + r - BC, dd] - sG[nref, dd],
                                                                      fastmath=True)
                else:
                    jc = r - 2 * BC
                    sX[r, dd] = sK[jc, dd] * cute.math.exp(sG[nref, dd] - sG[jc, dd], fastmath=True)
            cute.arch.sync_threads()
            acc_a = cute.make_rmem_tensor(cute.make_layout(p), Float32)
            acc_l = cute.make_rmem_tensor(cute.make_layout(p), Float32)
            for qb in cutlass.range_constexpr(p):
                acc_a[qb] = Float32(0.0)
                acc_l[qb] = Float32(0.0)
            for dd in cutlass.range(DK, unroll=4):
                xq = sX[ti, dd]
                xk = sX[BC + ti, dd]
                for qb in cutlass.range_constexpr(p):
                    kb = sX[2 * BC + qb * BC + tj, dd]
                    acc_a[qb] += xq * kb
                    acc_l[qb] += xk * kb
            i = nref + ti
            for qb in cutlass.range_constexpr(p):
                sA[i, qb * BC + tj] = acc_a[qb] * scale
                sL[i, qb * BC + tj] = acc_l[qb] * sB[i]

    @cute.jit
    def store_qk(self, sQ, sK, sG, sA, qg, kg, aqk, gl, tid, t0: Int32, L: Int32, hv: Int32, chunk: Int32,
                 scale: Float32):
        """qg = scale q exp(G), kg = k exp(G_last - G), Aqk and gl out."""
        c = tid % DK
        is_w = tid < DK
        g_last = sG[BT - 1, c]  # rows past a partial chunk's end add nothing to G
        for i in cutlass.range(L, unroll=4):
            if is_w:
                qg[t0 + i, hv, c] = (sQ[i, c] * scale * cute.math.exp(sG[i, c], fastmath=True)).to(qg.element_type)
            else:
                kg[t0 + i, hv, c] = (sK[i, c] * cute.math.exp(g_last - sG[i, c], fastmath=True)).to(
                    kg.element_type)
        if is_w:
            gl[chunk, hv, c] = g_last
        jc = tid % BT
        for i in cutlass.range(tid // BT, L, self.threads // BT):
            aqk[t0 + i, hv, jc] = sA[i, jc].to(aqk.element_type)

    @cute.jit
    def solve_tc(self, sK, sG, sA, sL, sB, sAkh, sAkl, sR2, v, w, u, tid, t0: Int32, L: Int32, hv: Int32):
        """Akk = (I + L)^-1 by forward substitution on the columns of I (fp32, 4 threads per column, in sA:
        Aqk is out), then w = Akk @ (beta k exp(G)) on warps 0-3 and u = Akk @ (beta v) on warps 4-7 with
        mma.sync (Akk split hi + lo, right-hand sides bf16)."""
        cute.arch.sync_threads()  # Aqk has left sA
        jcol = tid // 4
        q4 = tid % 4
        for i in cutlass.range(BT):
            acc = Float32(0.0)
            for m in cutlass.range(jcol + q4, i, 4, unroll=2):
                acc += sL[i, m] * sA[m, jcol]
            acc += cute.arch.shuffle_sync_bfly(acc, offset=1)
            acc += cute.arch.shuffle_sync_bfly(acc, offset=2)
            x = -acc
            if i == jcol:
                x = Float32(1.0)
            if i < jcol:
                x = Float32(0.0)
            sA[i, jcol] = x  # the 4 threads of the column all write it: each reads back its own rows
        # right-hand sides (rows past the end are zero: beta is 0 there): stage 0 for w, stage 1 for u
        c = tid % DK
        for m in cutlass.range(BT * DK // self.threads, unroll=4):
            i = m * (self.threads // DK) + tid // DK
            vv = Float32(0.0)
            if i < L:
                vv = v[t0 + i, hv, c].to(Float32)
            sR2[i, c, 1] = (sB[i] * vv).to(BFloat16)
            sR2[i, c, 0] = (sB[i] * sK[i, c] * cute.math.exp(sG[i, c], fastmath=True)).to(BFloat16)
        cute.arch.sync_threads()
        for m in cutlass.range(BT * BT // self.threads, unroll=4):
            i = m * (self.threads // BT) + tid // BT
            jj = tid % BT
            x = sA[i, jj]
            hi = x.to(BFloat16)
            sAkh[i, jj] = hi
            sAkl[i, jj] = (x - hi.to(Float32)).to(BFloat16)
        cute.arch.sync_threads()
        # warps 0-3: w = Akk @ R0, warps 4-7: u = Akk @ R1; one code path, the operand picked by warp group
        wg = tid // 128
        t = tid % 128
        sR = sR2[None, None, wg]
        mma = tiled_mma(4)
        thr = mma.get_slice(t)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BT, DK)), Float32)
        acc.fill(0.0)
        gemm(mma, acc, sAkh, transposed(sR, BT, DK), t, False, True)
        gemm(mma, acc, sAkl, transposed(sR, BT, DK), t, False, True)
        cute.arch.sync_threads()  # both groups are done reading their right-hand sides
        pR = thr.partition_C(sR)
        for e in cutlass.range_constexpr(cute.size(acc)):
            pR[e] = acc[e].to(BFloat16)
        cute.arch.sync_threads()
        # out, coalesced: a dynamic loop over rows (thread = column)
        if wg == 0:
            for i in cutlass.range(L, unroll=2):
                w[t0 + i, hv, t] = sR2[i, t, 0]
        else:
            for i in cutlass.range(L, unroll=2):
                u[t0 + i, hv, t] = sR2[i, t, 1]
