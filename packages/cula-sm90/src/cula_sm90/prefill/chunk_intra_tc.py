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
    Akk    X = (I + L)^-1, blocked by 16, written as Akk diag(beta) in bf16. L leaves the score accumulators as
           bf16 hi + lo operand tiles (the blocks below the diagonal) and fp32 diagonal blocks; the warp of each
           diagonal block inverts it by substitution in fp32 (right-looking: one dependent FMA per step) while the
           others zero Akk's upper blocks; after one CTA barrier, warp c (c < 3) runs column block c down alone:
           X_bc^T = -(sum_{c <= m < b} X_mc^T L_bm^T) X_bb^T on tensor cores, transposed so that every result
           stays in registers as the next product's A operand (no shared-memory round trip, no barrier per
           block), while warps 4-7 convert the diagonal blocks. Every fp32 operand is split into bf16 hi + lo
           (three mma.sync passes: ~16 bits per product, fp32 accumulation; FLA's solve_tril runs these products
           in TF32)
    w, u   (Akk diag(beta)) @ [k e^G | v] on tensor cores (Akk diag(beta) in bf16, as FLA's solve_tril output;
           8 warps, 4 along M x 2 along N, one accumulator at a time; a warp's row block sums over its chunk's
           blocks up to itself only, where Akk can be nonzero)
    Akk    only with `store_akk` (chunk_kda's training residual, forward.py): X itself (no beta) in bf16 to akk
           [TT, HV, 64], rows of the chunk only, zeros above the diagonal blocks: column_chain also keeps each X_bc
           in fp32 in its place in the L tile (free below the diagonal blocks, beside the X_bb), and after w, u every
           thread writes 8 columns of a row per 16-byte store. The inference configuration compiles without it
Row blocks wholly past a partial chunk's end skip their scores, inverse rows and gate-scan quarter (branches
uniform across the CTA or the warp); what they would have written is never read.

Pipeline and memory: q, k (and a bf16 g) by 16-byte cp.async in one round trip (the gate's parameters and beta load
meanwhile), v by cp.async into q's place (issued once the scores are read) while the inverse runs; qg, kg, w, u out
with 16-byte stores (w and u staged in the places of their right-hand sides k e^G and v), Aqk in 4-byte pairs (its
blocks above the diagonal as zeros). Shared memory 72 KiB: q (then its row operand, v, the u staging) and k (then k
e^G, the w staging) bf16 tiles (32 KiB), a 16 KiB region R (raw g; the column operands; Akk diag(beta) and the
inverse's L operand tiles) and the L tile (fp32, 16.25 KiB: the row operands of k, then the diagonal blocks of L and
of X in place) back to back (before the build, R and L carry G from the scan to the registers), the boundary table
(2.5 KiB), the S table (5 KiB; then the diagonal inverses' operand tiles) and beta. Three CTAs (24 warps) per
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
from cula_core.cute_kernels.warp_mma import (gemm_k_range, ldmatrix_copy_A, ldmatrix_copy_B, smem_tile_layout,
                                             tiled_mma, transposed)
from cula_sm90.prefill import common

BT = 64
DK = 128
BC = 16
LPAD = BT + 1  # fp32 row stride of L: odd, so accesses down a column (solve, fragments) spread over the banks
THREADS = 256
R_BYTES = BT * DK * 2  # the region R: raw g, then the column operands k e^(B_{c+1} - G), then Akk diag(beta)
PAIRS = 10  # (p, c) blocks with c <= p
TILE = BC * BC  # elements of one bf16 operand tile of the inverse
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
    store_akk = False  # also write Akk = (I + L)^-1 for training (forward.py sets it per configuration)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               alog: cute.Tensor, dtb: cute.Tensor, cu: cute.Tensor, co: cute.Tensor, w: cute.Tensor,
               u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor, akk: cute.Tensor,
               gl: cute.Tensor, N: Int32, search_steps: Int32, G: Int32, scale: Float32, lower_bound: Float32):
        tid, _, _ = cute.arch.thread_idx()
        chunk_j, h, _ = cute.arch.block_idx()
        chunk = chunk_j // G
        hv = h * G + (chunk_j - chunk * G)
        _, t0, L, valid = common.find_chunk(cu, co, chunk, N, search_steps)
        if valid:
            self.tile(q, k, v, g, beta, alog, dtb, w, u, qg, kg, aqk, akk, gl, (t0, L, chunk), h, hv, scale,
                      lower_bound, tid)

    @cute.jit
    def tile(self, q, k, v, g, beta, alog, dtb, w, u, qg, kg, aqk, akk, gl, where, h: Int32, hv: Int32,
             scale: Float32, lower_bound: Float32, tid):
        """One CTA's work on the 64 rows `where` names (this kernel: (first token, valid rows, chunk index) of one
        chunk; the packed kernel: its tile, see geometry) for value head hv of q/k head h."""
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
        geo = self.geometry(smem, where, tid)

        cp = g2s_tiled_copy(DK, self.threads)
        self.load_rows(cp, q, geo, h, sQ, tid)
        self.load_rows(cp, k, geo, h, sK, tid)
        if const_expr(self.g_smem):  # g in the same round trip
            self.load_rows(cp, g, geo, hv, sGin, tid)
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
        b = self.load_beta(beta, geo, hv, tid)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self.head(hv, geo, sQ, sK, sGin, sKc, sKr, sAk, sG, sL, sRef, sS, sB, v, g, w, u, qg, kg, aqk, akk, gl,
                  a_rate, bias0, bias1, b, scale, lower_bound, tid)

    # ---- where the tile's rows live: this kernel's hooks for one chunk, geo = (first token t0, valid rows L,
    # chunk index); chunk_intra_tc_packed.py overrides them for tiles of several pieces. Row r of the tile is
    # token t0 + r, valid below L; block m's boundary rows in sRef: B_m (start) row m, B_{m+1} (end) row m + 1,
    # G_last row 4

    @cute.jit
    def geometry(self, smem, where, tid):
        """The tile's geometry from the kernel's `where` (smem: the allocator, for tables of its own)."""
        return where

    @cute.jit
    def load_rows(self, cp, t: cute.Tensor, geo, h, s: cute.Tensor, tid):
        """cp.async of the tile's rows of head h of t [TT, H, D] into the shared tile s (zeros for invalid rows)."""
        t0, L, _ = geo
        copy_rows_g2s(cp, head_rows(t, t0, h, BT), s, L, tid)

    @cute.jit
    def load_beta(self, beta: cute.Tensor, geo, hv, tid) -> Float32:
        """beta of tile row tid (tid < BT), activated; 0 for invalid rows and threads past BT."""
        t0, L, _ = geo
        b = Float32(0.0)
        if tid < L:
            b = common.activate_beta(beta[t0 + tid, hv].to(Float32), self.beta_activation)
        return b

    @cute.jit
    def row_ok(self, geo, row):
        """Tile row `row` (< BT) holds a token."""
        return row < geo[1]

    @cute.jit
    def block_ok(self, geo, m):
        """Row block m holds a token."""
        return m * BC < geo[1]

    @cute.jit
    def row_token(self, geo, row):
        """The token of valid tile row `row`."""
        return geo[0] + row

    @cute.jit
    def pair_ok(self, geo, p, c):
        """The score block (p, c), c <= p, is computed: block p holds a token and both blocks belong to one
        sequence's chunk."""
        return p * BC < geo[1]

    @cute.jit
    def chain_ok(self, geo, b, c: cutlass.Constexpr):
        """Akk's block (b, c), b > c, is computed (column_chain): block b holds a token of block c's chunk."""
        return b * BC < geo[1]

    @cute.jit
    def scan_adds(self, geo, qq: cutlass.Constexpr, quarter):
        """Block qq's gate total adds to the cumulative gate of block `quarter` (qq < 3)."""
        return qq < quarter

    @cute.jit
    def continues_chunk(self, geo, p):
        """Block p is not its chunk's first: its start boundary is the previous block's end (else 0)."""
        return p > 0

    @cute.jit
    def start_ref(self, geo, m: cutlass.Constexpr):
        """The sRef row of block m's start boundary B_m (row 0 holds zeros)."""
        return m

    @cute.jit
    def last_ref(self, geo, m: cutlass.Constexpr):
        """The sRef row of G_last of block m's chunk."""
        return 4

    @cute.jit
    def chunk_col(self, geo, p):
        """Tile column of block p's chunk's column 0 (Aqk's columns are chunk positions)."""
        return 0

    @cute.jit
    def first_contraction_block(self, geo, m):
        """The first block of m's chunk in the tile (Akk's row block m is zero left of it)."""
        return 0

    @cute.jit
    def out_rows(self, t: cute.Tensor, geo, hv, m: cutlass.Constexpr, tb):
        """This thread's row of block m (the 16-byte vector copy `tb`'s layout) in the token tensor t [TT, HV, D]."""
        return tb.partition_D(head_rows(t, geo[0], hv, BT))[None, m, None]

    @cute.jit
    def write_gl(self, gl: cute.Tensor, geo, hv, sRef, tid):
        """gl = G_last (natural log) of the tile's chunk(s)."""
        if tid < DK:
            gl[geo[2], hv, tid] = sRef[4, tid] * LN2

    @cute.jit
    def zero_akk(self, sAk, geo, t):
        """Zeros into the blocks of Akk no warp computes, by 128 threads (t: 0..127): those above the diagonal."""
        self.zero_upper_akk(sAk, t)

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
    def head(self, hv: Int32, geo, sQ, sK, sGin, sKc, sKr, sAk, sG, sL, sRef, sS, sB, v, g, w, u, qg, kg, aqk, akk,
             gl, a_rate: Float32, bias0: Float32, bias1: Float32, b: Float32, scale: Float32, lower_bound: Float32,
             tid):
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
        if self.block_ok(geo, quarter):  # a quarter wholly past the end adds nothing: no loads, no exps
            for mm in cutlass.range_constexpr(SCAN_ROWS):
                row = quarter * SCAN_ROWS + mm
                if const_expr(self.g_smem):  # zero-filled past the end
                    cute.autovec_copy(cute.local_tile(sGin, (1, 2), (row, pair))[0, None], gin)
                    part[0, mm] = gin[0].to(Float32)
                    part[1, mm] = gin[1].to(Float32)
                else:
                    x0 = Float32(0.0)
                    x1 = Float32(0.0)
                    if self.row_ok(geo, row):
                        x0 = g[self.row_token(geo, row), hv, col].to(Float32)
                        x1 = g[self.row_token(geo, row), hv, col + 1].to(Float32)
                    part[0, mm] = x0
                    part[1, mm] = x1
            for mm in cutlass.range_constexpr(SCAN_ROWS):
                # lower_bound * sigmoid(y) through rcp.approx (2^-23 relative): an IEEE division would add a
                # slow-path check and branch per element
                y0 = a_rate * (part[0, mm] + bias0)
                y1 = a_rate * (part[1, mm] + bias1)
                s0 = lb2 * cute.arch.rcp_approx(1.0 + cute.math.exp2(-y0, fastmath=True))
                s1 = lb2 * cute.arch.rcp_approx(1.0 + cute.math.exp2(-y1, fastmath=True))
                if self.row_ok(geo, quarter * SCAN_ROWS + mm):
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
            if self.scan_adds(geo, qq, quarter):
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
                if self.continues_chunk(geo, p):
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
        fx = cute.make_fragment_like(pQ[None, 0, None])
        fk = cute.make_fragment_like(pQ[None, 0, None])
        fo = cute.make_fragment_like(pQ[None, 0, None])
        gr = cute.make_fragment_like(self.ref_row(sRef, 0, tf))
        for m in cutlass.range_constexpr(BT // BC):
            row = cI[0, m, 0][0]
            # q's products first (q dies), then k's
            cute.copy(vb, pQ[None, m, None], fx)
            cute.copy(vf, self.ref_row(sRef, self.start_ref(geo, m), tf), gr)
            rq = self.row_rnorm(fx)
            for e in cutlass.range_constexpr(8):
                fo[e] = (fx[e].to(Float32) * rq * cute.math.exp2(rG[e, m, 0] - gr[e], fastmath=True)).to(BFloat16)
            cute.copy(vb, fo, pQd[None, m, None])  # q is in fx: q a may take its place
            for e in cutlass.range_constexpr(8):
                fo[e] = (fx[e].to(Float32) * (rq * scale) * cute.math.exp2(rG[e, m, 0], fastmath=True)).to(BFloat16)
            if self.row_ok(geo, row):
                cute.copy(vb, fo, self.out_rows(qg, geo, hv, m, tb))
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
            cute.copy(vf, self.ref_row(sRef, self.last_ref(geo, m), tf), gr)
            for e in cutlass.range_constexpr(8):
                fo[e] = (fk[e].to(Float32) * cute.math.exp2(gr[e] - rG[e, m, 0], fastmath=True)).to(BFloat16)
            if self.row_ok(geo, row):
                cute.copy(vb, fo, self.out_rows(kg, geo, hv, m, tb))
            for e in cutlass.range_constexpr(8):
                fo[e] = (fk[e].to(Float32) * cute.math.exp2(rG[e, m, 0], fastmath=True)).to(BFloat16)
            cute.copy(vb, fo, pKd[None, m, None])  # k e^G in place of k
        self.write_gl(gl, geo, hv, sRef, tid)
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
            if (slot == 0 or warp < PAIRS - 8) and self.pair_ok(geo, p, c):
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
                    if self.row_ok(geo, row):
                        # aqk's strides are runtime values: the pair's 4-byte alignment is asserted
                        off = cute.assume(cute.crd2idx((self.row_token(geo, row), hv, col - self.chunk_col(geo, p)),
                                                       aqk.layout), divby=2)
                        cute.autovec_copy(a_pair, cute.make_tensor(aqk.iterator + off, cute.make_layout(2)))
                for e in cutlass.range_constexpr(nacc):
                    acc_l[e, slot] = acc_k[e]
        # Aqk's blocks above the diagonal: zeros (stage 2 reads whole rows)
        self.zero_upper_aqk(aqk, geo, hv, tid)
        cute.arch.sync_threads()  # the L rows, q a, the column operands and S are read: their places are free

        # the inverse's bf16 hi + lo operand tiles (16 x 16 each, see op_tile), once the scores are done: the six L
        # blocks below the diagonal in R after Akk diag(beta) (6 KiB), the four diagonal inverses (transposed) in
        # the S table's place (4 KiB)
        l_tiles = sAk.iterator + BT * BT
        x_tiles = cute.recast_ptr(sS.iterator, dtype=BFloat16)
        # ---- v in flight (cp.async, into q's place) while the inverse runs
        self.load_rows(g2s_tiled_copy(DK, self.threads), v, geo, hv, sQ, tid)
        cute.arch.cp_async_commit_group()
        # ---- L from the accumulators: the blocks below the diagonal as bf16 hi + lo operand tiles, the diagonal
        # blocks in fp32 into sL; the warp of a diagonal block then inverts it (its own writes: a warp barrier),
        # the warps without one zero Akk's blocks above the diagonal
        for slot in cutlass.range_constexpr(2):
            pr = warp + 8 * slot
            p, c = self.pair_of(pr)
            if (slot == 0 or warp < PAIRS - 8) and self.pair_ok(geo, p, c) and c < p:
                self.store_split_pair(acc_l, slot, cC, sB, l_tiles, p, c)
        # the diagonal pairs 0, 2, 5, 9 are on warps 0, 2, 5 (slot 0) and 1 (slot 1)
        pd = Int32(0)
        if warp == 2:
            pd = Int32(1)
        if warp == 5:
            pd = Int32(2)
        if warp == 1:
            pd = Int32(3)
        if (warp < 3 or warp == 5) and self.block_ok(geo, pd):
            for e in cutlass.range_constexpr(nacc):
                i, jj = cC[e]
                av = acc_l[e, 0]
                if warp == 1:
                    av = acc_l[e, 1]
                lv = Float32(0.0)
                if jj < i:
                    lv = av * sB[pd * BC + i]
                sL[pd * BC + i, pd * BC + jj] = lv
            cute.arch.sync_warp()  # the block is written before its lanes read its columns
            self.invert_diag(sL, x_tiles, pd, lane)
        if warp == 3 or warp == 4 or warp >= 6:  # the warps without a diagonal block (pairs 0, 2, 5, 9)
            self.zero_akk(sAk, geo, (warp - 3 - warp // 6) * 32 + lane)
        cute.arch.sync_threads()  # the operand tiles and Akk's diagonal and upper blocks are written
        # ---- Akk's blocks below the diagonal: warp c < 3 runs column block c down (see column_chain)
        for cb in cutlass.range_constexpr(BT // BC - 1):
            if warp == cb and self.chain_ok(geo, cb + 1, cb):
                self.column_chain(sAk, sL, sB, l_tiles, x_tiles, geo, lane, cb)
        if warp >= 4 and self.block_ok(geo, warp - 4):
            self.diag_akk(sL, sAk, sB, warp - 4, lane)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        # ---- w = Akk diag(beta) @ (k e^G), u = Akk diag(beta) @ v (8 warps: 4 along M x 2 along N), one
        # accumulator in turn; each result is staged as bf16 in the place of its right-hand side once every warp
        # has read it, then both go out in 16-byte vectors
        mma8 = tiled_mma(4, 2)
        thr8 = mma8.get_slice(tid)
        acc_o = cute.make_rmem_tensor(thr8.partition_shape_C((BT, DK)), Float32)
        # this warp's row block mb of Akk is nonzero only in the k-blocks of its chunk (or piece) up to mb: the
        # product skips the others, whose rows of k e^G and v may belong to another sequence's piece
        mb = thr8.partition_C(cute.make_identity_tensor((BT, DK)))[0][0] // BC
        kb_first = self.first_contraction_block(geo, mb)
        for out in cutlass.range_constexpr(2):
            rhs = sK
            if const_expr(out == 1):
                rhs = sQ
            acc_o.fill(0.0)
            gemm_k_range(mma8, acc_o, sAk, transposed(rhs, BT, DK), tid, False, True, kb_first, mb)
            cute.arch.sync_threads()
            pd = thr8.partition_C(rhs)
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                pd[e] = acc_o[e].to(BFloat16)
        cute.arch.sync_threads()
        for m in cutlass.range_constexpr(cute.size(pQ.shape[1])):
            if self.row_ok(geo, cI[0, m, 0][0]):
                cute.copy(vb, pK[None, m, None], fx)
                cute.copy(vb, fx, self.out_rows(w, geo, hv, m, tb))
                cute.copy(vb, pQ[None, m, None], fk)
                cute.copy(vb, fk, self.out_rows(u, geo, hv, m, tb))
        if const_expr(self.store_akk):
            self.store_akk_rows(sL, akk, geo, hv, tid)

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
    def zero_upper_aqk(self, aqk, geo, hv, tid):
        """Zeros into Aqk's blocks above the diagonal (row block p, chunk columns from the end of block p) of the
        valid rows, in 4-byte pairs: no warp computes them, and stage 2 reads whole rows."""
        z = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        z.fill(0.0)
        for it in cutlass.range_constexpr(BT * BT // 2 // self.threads):
            idx = it * self.threads + tid
            row = idx // (BT // 2)
            col = 2 * (idx % (BT // 2))
            if self.row_ok(geo, row):
                if col >= (row // BC + 1) * BC - self.chunk_col(geo, row // BC):
                    off = cute.assume(cute.crd2idx((self.row_token(geo, row), hv, col), aqk.layout), divby=2)
                    cute.autovec_copy(z, cute.make_tensor(aqk.iterator + off, cute.make_layout(2)))

    @cute.jit
    def ref_row(self, sRef, r, thr):
        """Row r of sRef as this thread's 8 columns (c0 .. c0 + 7) in the vector copies' layout: the row seen as
        a (16, DK) tile with row stride 0, partitioned like the 16 rows of one vector pass. r: a constant, or a
        runtime row (the packed kernel's boundaries), whose offset is asserted 16-byte aligned."""
        off = r * DK
        if const_expr(not isinstance(r, int)):
            off = cute.assume(off, divby=DK)
        view = cute.make_tensor(sRef.iterator + off, cute.make_layout((BC, DK), stride=(0, 1)))
        return thr.partition_S(view)[None, 0, None]

    @cute.jit
    def op_tile(self, base, idx):
        """Operand tile idx at `base`: a 16 x 16 bf16 tile (512 bytes) stored row-major, its two 16-byte halves
        of rows 4 - 7 (mod 8) swapped, so ldmatrix (plain or transposed) reads 8 rows without bank conflicts.
        Tiles 2 t and 2 t + 1 are the hi and lo parts of operand t."""
        return cute.make_tensor(base + idx * TILE,
                                cute.make_composed_layout(cute.make_swizzle(1, 3, 3), 0,
                                                          cute.make_layout((BC, BC), stride=(BC, 1))))

    @cute.jit
    def tile_offset(self, r, col):
        """Element offset of (r, col) in an op_tile (the same swizzle, for stores that bypass its layout)."""
        return r * BC + (col ^ (((r // 4) % 2) * 8))

    @cute.jit
    def store_split_pair(self, acc_l, slot, cC, sB, l_tiles, p, c):
        """L_pc (c < p: every entry below the diagonal) = diag(beta) times the score accumulator, split into bf16
        hi + lo, into its operand tiles (off-diagonal block index p (p - 1) / 2 + c), in 4-byte column pairs."""
        t = p * (p - 1) // 2 + c
        hi = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        lo = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        for e2 in cutlass.range_constexpr(cute.size(acc_l) // 4):
            i, jj = cC[2 * e2]
            bi = sB[p * BC + i]
            for x in cutlass.range_constexpr(2):
                lv = acc_l[2 * e2 + x, slot] * bi
                h = lv.to(BFloat16)
                hi[x] = h
                lo[x] = (lv - h.to(Float32)).to(BFloat16)
            off = cute.assume(self.tile_offset(i, jj), divby=2)
            cute.autovec_copy(hi, cute.make_tensor(l_tiles + 2 * t * TILE + off, cute.make_layout(2)))
            cute.autovec_copy(lo, cute.make_tensor(l_tiles + (2 * t + 1) * TILE + off, cute.make_layout(2)))

    @cute.jit
    def invert_diag(self, sL, x_tiles, p, lane):
        """X_pp = (I + L_pp)^-1 of the strictly lower 16 x 16 block in sL, by substitution in fp32, lane j
        (and j + 16, a duplicate) column j: x = e_j, then for m = 0..14, x_i -= L_im x_m (i > m) -- every update
        of step m is independent, so the dependent chain is one FMA per step. Out: X_pp in fp32 in L_pp's place
        (once every lane has read L_pp: a warp barrier) and X_pp^T (row j = column j of X_pp) split into bf16
        hi + lo into operand tiles 2 p, 2 p + 1 at `x_tiles`, two 16-byte stores per tile."""
        b0 = p * BC
        j = lane % BC
        x = cute.make_rmem_tensor(cute.make_layout(BC), Float32)
        for i in cutlass.range_constexpr(BC):
            v = Float32(0.0)
            if i == j:
                v = Float32(1.0)
            x[i] = v
        for m in cutlass.range_constexpr(BC - 1):
            for i in cutlass.range_constexpr(m + 1, BC):
                x[i] = x[i] - sL[b0 + i, b0 + m] * x[m]
        cute.arch.sync_warp()  # every lane has read L_pp before X_pp takes its place
        if lane < BC:
            for i in cutlass.range_constexpr(BC):
                sL[b0 + i, b0 + j] = x[i]
            hi = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(1, 8)), BFloat16)
            lo = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(1, 8)), BFloat16)
            for i in cutlass.range_constexpr(BC):
                h = x[i].to(BFloat16)
                hi[i % 8, i // 8] = h
                lo[i % 8, i // 8] = (x[i] - h.to(Float32)).to(BFloat16)
            for half in cutlass.range_constexpr(2):
                off = cute.assume(self.tile_offset(j, half * 8), divby=8)
                cute.autovec_copy(hi[None, half], cute.make_tensor(x_tiles + 2 * p * TILE + off,
                                                                   cute.make_layout(8)))
                cute.autovec_copy(lo[None, half], cute.make_tensor(x_tiles + (2 * p + 1) * TILE + off,
                                                                   cute.make_layout(8)))

    @cute.jit
    def akk_offset(self, r, col):
        """Element offset of (r, col) in Akk's tile (smem_tile_layout(BT, BT): 8 x 64 atoms, the 16-byte chunk
        index XOR row % 8)."""
        return r * BT + (col ^ ((r % 8) * 8))

    @cute.jit
    def diag_akk(self, sL, sAk, sB, p, lane):
        """Akk's diagonal block p, X_pp diag(beta) in bf16 from sL, by one warp: lane l, row l // 2, 8 columns."""
        row = p * BC + lane // 2
        col = p * BC + 8 * (lane % 2)
        for x in cutlass.range_constexpr(8):
            sAk[row, col + x] = (sL[row, col + x] * sB[col + x]).to(BFloat16)

    @cute.jit
    def zero_upper_akk(self, sAk, t):
        """Zeros into Akk's six blocks above the diagonal by 128 threads (t: 0..127), one 4-byte pair per block."""
        z = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        z.fill(0.0)
        for pb in cutlass.range_constexpr(BT // BC - 1):
            for cb in cutlass.range_constexpr(pb + 1, BT // BC):
                row = pb * BC + t // 8
                col = cb * BC + 2 * (t % 8)
                sAk[row, col] = z[0]
                sAk[row, col + 1] = z[1]

    @cute.jit
    def column_chain(self, sAk, sL, sB, l_tiles, x_tiles, geo, lane, c: cutlass.Constexpr):
        """Akk's blocks X_bc (b > c, valid row blocks) of column block c, by one warp, transposed so that each
        result is the next product's A operand in registers (an m16n16 accumulator and an m16k16 A fragment of
        mma.sync hold the same elements in the same registers):
            X_bc^T = -T_b X_bb^T,  T_b = sum_{c <= m < b} X_mc^T L_bm^T
        right-looking: once X_mc^T is known it is added into every later T_b (b > m), so the dependent chain per
        block is the last term of T_b and the X_bb product. Every operand is split into bf16 hi + lo (hi hi +
        hi lo + lo hi: ~16 bits per product, fp32 accumulation): the accumulators in registers, the L blocks and
        X_bb^T from their operand tiles by ldmatrix. Blocks b outside block c's chunk (chain_ok) are skipped. Out: X_bc diag(beta) in bf16 into Akk (2-byte stores); with
        `store_akk` also X_bc in fp32 into its place in sL (free below the diagonal blocks), for store_akk_rows."""
        mma = tiled_mma(1)
        thr = mma.get_slice(lane)
        cC = thr.partition_C(cute.make_identity_tensor((BC, BC)))  # (column j of block c, row i of block b)
        probe = self.op_tile(x_tiles, 0)
        a_hi = thr.make_fragment_A(thr.partition_A(probe))
        a_lo = thr.make_fragment_A(thr.partition_A(probe))
        b_hi = thr.make_fragment_B(thr.partition_B(probe))
        b_lo = thr.make_fragment_B(thr.partition_B(probe))
        ldA = ldmatrix_copy_A(mma, BFloat16, False)
        ldB = ldmatrix_copy_B(mma, BFloat16, False)
        ldBt = ldmatrix_copy_B(mma, BFloat16, True)
        tA = ldA.get_slice(lane)
        tB = ldB.get_slice(lane)
        tBt = ldBt.get_slice(lane)
        # X_cc^T: its operand tiles hold X_cc^T row-major, the A operand's (M, K) storage
        cute.copy(ldA, tA.partition_S(self.op_tile(x_tiles, 2 * c)), tA.retile(a_hi))
        cute.copy(ldA, tA.partition_S(self.op_tile(x_tiles, 2 * c + 1)), tA.retile(a_lo))
        acc_t = [cute.make_rmem_tensor(thr.partition_shape_C((BC, BC)), Float32) for _ in range(BT // BC - 1 - c)]
        for t_ in acc_t:
            t_.fill(0.0)
        # accumulator element e sits at (column jj of block c, row 8 (e // 4) + i of block b), (jj, i) = cC[e % 4]:
        # its Akk offset is a per-lane base plus a constant (whole 8-row steps leave the swizzle alone)
        corr = cute.make_rmem_tensor(thr.partition_shape_C((BC, BC)), Float32)
        akk_base = [self.akk_offset(cC[e][1], c * BC + cC[e][0]) for e in range(4)]
        x_base = []
        if const_expr(self.store_akk):
            x_base = [cute.crd2idx((cC[e][1], c * BC + cC[e][0]), sL.layout) for e in range(4)]
        beta = [sB[c * BC + cC[2 * v1][0]] for v1 in range(2)]  # column jj: t1 + 8 v1, v1 = (e // 2) % 2
        y = cute.make_rmem_tensor(thr.partition_shape_C((BC, BC)), Float32)
        for b in cutlass.range_constexpr(c + 1, BT // BC):
            if self.chain_ok(geo, b, c):
                m = b - 1
                # a holds X_mc^T: its terms of T_b first (the chain), then of the later T_b2
                for b2 in cutlass.range_constexpr(b, BT // BC):
                    if self.chain_ok(geo, b2, c):
                        t = b2 * (b2 - 1) // 2 + m
                        cute.copy(ldB, tB.partition_S(self.op_tile(l_tiles, 2 * t)), tB.retile(b_hi))
                        cute.copy(ldB, tB.partition_S(self.op_tile(l_tiles, 2 * t + 1)), tB.retile(b_lo))
                        if const_expr(b2 == b):
                            self.mma_split_short(mma, acc_t[b2 - c - 1], corr, a_hi, a_lo, b_hi, b_lo)
                        else:
                            self.mma_split(mma, acc_t[b2 - c - 1], a_hi, a_lo, b_hi, b_lo)
                self.split_acc(acc_t[b - c - 1], a_hi, a_lo, False)
                # X_bb^T as the B operand: (N, K) = X_bb, stored transposed in its tiles
                cute.copy(ldBt, tBt.partition_S(transposed(self.op_tile(x_tiles, 2 * b), BC, BC)), tBt.retile(b_hi))
                cute.copy(ldBt, tBt.partition_S(transposed(self.op_tile(x_tiles, 2 * b + 1), BC, BC)),
                          tBt.retile(b_lo))
                y.fill(0.0)
                self.mma_split_short(mma, y, corr, a_hi, a_lo, b_hi, b_lo)
                for e in cutlass.range_constexpr(cute.size(y)):
                    off = akk_base[e % 4] + (b * BC + 8 * (e // 4)) * BT
                    akk_elem = cute.make_tensor(sAk.iterator + off, cute.make_layout(1))
                    akk_elem[0] = (-y[e] * beta[(e // 2) % 2]).to(BFloat16)
                    if const_expr(self.store_akk):
                        x_elem = cute.make_tensor(sL.iterator + x_base[e % 4] + (b * BC + 8 * (e // 4)) * LPAD,
                                                  cute.make_layout(1))
                        x_elem[0] = -y[e]
                if const_expr(b < BT // BC - 1):
                    self.split_acc(y, a_hi, a_lo, True)

    @cute.jit
    def store_akk_rows(self, sL, akk, geo, hv: Int32, tid):
        """Akk = X = (I + L)^-1 (no beta) in bf16 to global, rows < L, from the fp32 X in sL (diagonal blocks from
        invert_diag, blocks below them from column_chain) with zeros for the blocks above the diagonal: thread
        writes 8 columns of a row per 16-byte store (a warp: 4 whole rows). One chunk per tile (geo: this kernel's)."""
        t0, L, _ = geo
        f = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
        for it in cutlass.range_constexpr(BT * BT // 8 // self.threads):
            idx = it * self.threads + tid
            row = idx // (BT // 8)
            col = 8 * (idx % (BT // 8))
            if row < L:
                below = col < (row // BC + 1) * BC  # the 8 columns lie in one 16-column block
                for x in cutlass.range_constexpr(8):
                    xv = Float32(0.0)
                    if below:
                        xv = sL[row, col + x]
                    f[x] = xv.to(BFloat16)
                off = cute.assume(cute.crd2idx((t0 + row, hv, col), akk.layout), divby=8)
                cute.autovec_copy(f, cute.make_tensor(akk.iterator + off, cute.make_layout(8)))

    @cute.jit
    def mma_split_short(self, mma, acc, corr, a_hi, a_lo, b_hi, b_lo):
        """mma_split for a product on the dependent chain: the hi lo + lo hi passes go into `corr` (scratch) and
        are added after, so a new A operand meets two dependent mma.sync instead of three."""
        corr.fill(0.0)
        cute.gemm(mma, corr, a_hi, b_lo, corr)
        cute.gemm(mma, acc, a_hi, b_hi, acc)
        cute.gemm(mma, corr, a_lo, b_hi, corr)
        for e in cutlass.range_constexpr(cute.size(acc)):
            acc[e] = acc[e] + corr[e]

    @cute.jit
    def split_acc(self, acc, hi, lo, negate: cutlass.Constexpr):
        """The fp32 accumulator `acc` (or -acc) as an A operand split into bf16 hi + lo: element e of an m16n16
        accumulator fragment and of an m16k16 A fragment is the same (row, column)."""
        for e in cutlass.range_constexpr(cute.size(acc)):
            x = acc[e]
            if const_expr(negate):
                x = -x
            h = x.to(BFloat16)
            hi[e] = h
            lo[e] = (x - h.to(Float32)).to(BFloat16)

    @cute.jit
    def mma_split(self, mma, acc, a_hi, a_lo, b_hi, b_lo):
        """acc += A B^T from split operands: hi hi + hi lo + lo hi (lo lo is below fp32 rounding of the sum)."""
        cute.gemm(mma, acc, a_hi, b_hi, acc)
        cute.gemm(mma, acc, a_hi, b_lo, acc)
        cute.gemm(mma, acc, a_lo, b_hi, acc)
