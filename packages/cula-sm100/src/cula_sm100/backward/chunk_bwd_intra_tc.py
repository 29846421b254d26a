"""chunk_bwd_intra_tc: chunk_bwd_intra's contract (chunk_bwd_intra.py's docstring has the math) with the pair sums
on tensor cores. One CTA per (chunk of 64, q/k head), looping over the value heads of the q/k head's group (GVA:
dq, dk summed in a fixed order by the thread that owns each element, no atomics: deterministic).

Per value head, with dSq = scale dAqk (causal, diagonal included), dL strictly lower, E_ij = exp(G_i - G_j):

    dq_i = sum_j dSq_ij k_j E_ij       R_i = sum_{j<i} dL_ij k_j E_ij       (row side)
    C_j  = sum_{i>=j} (dSq_ij q_i + beta_i dL_ij k_i) E_ij                   (column side)
    dq += dq_i;  dk += beta R + C;  dbeta += <k, R>;  dG += q dq_i + beta k R - k C;  dG <- reverse cumsum of dG

Factorisation (FLA 0.6.0's chunk_kda_bwd_intra): the chunk is 4 row blocks of 16. For row block I, with a
reference row r on the row side and r' on the column side:

    dq[I] = (dSq[I, :] @ (k exp(G_r - G)))  * exp(G_I - G_r)        (columns j <= 16 I + 15)
    C[I]  = (dSq[:, I]^T @ (q exp(G - G_r')) + dL[:, I]^T @ (beta k exp(G - G_r'))) * exp(G_r' - G_I)   (rows >= 16 I)

The references are the block's middle row m = 16 I + 8 on both sides when the block is "mild": its half spans
G_{16 I} - G_m and G_m - G_{16 I + 15} (log2 units, max over the warp's channels) both below MILD_LOG2. Then every
factor, on and off the diagonal, is at most 2^MILD_LOG2 (G is non-increasing in a chunk: g <= 0, as the forward
assumes; off the diagonal the operand factors are <= 1) and the diagonal block goes through the same MMA (dSq / dL
are zero above the diagonal, so no masked term can be inf * 0). The safe gate at lower_bound >= -5 is always mild
(8 steps of at most 5 nats: 57.7 < 60 in log2 units). An underflow to 0 drops only terms whose decay to the
block's first row (row side) or from its last row (column side) is below 2^-(126 - MILD_LOG2), against 2^-126
with those rows as references. Otherwise ("strong") the references are the block's first row
(row side) and last row (column side), so the operand factors off the diagonal are <= 1 however strong the decay,
and that warp does the diagonal block exactly on CUDA cores (fp32 arithmetic, one exp per (pair, element), FLA's
non-safe-gate diagonal loop) from the same bf16 dSq / dL tiles. Correct for any decay either way.

Precision: mma.sync m16n8k16 with bf16 operands (dSq, dL rounded to bf16 as FLA does; the decayed q / k / beta k
rounded to bf16) and fp32 accumulation; the output scalings, the exact diagonal path and everything after the
products in fp32. Relative error of a product term ~2^-9: the GPU test holds 1e-2 (dq, dk, dbeta) and 2e-2 (dG,
whose chunk sums cancel) against the fp64 PyTorch stage, where the fp32 CUDA-core kernel holds 1e-4.

Tiling: 8 warps; warp w owns channels 16 w .. 16 w + 15 of every row (the sums are per channel, so a warp builds
its own decayed B operands: no sharing, no barrier between the warps inside a value head). Per row block I
(processed 3, 2, 1, 0 so the reverse cumsum of dG runs along), one 16 x 16 fp32 accumulator each for dq, R, C
(24 registers): A = 16 x 16 tiles of dSq / dL (bf16, shared memory, ldmatrix; ldmatrix.trans for the column side),
B = decayed k / q / beta k built element by element from shared memory straight into MMA fragments (8 exp2 per
thread per k-block). dq / dk: read-add-write of global memory by the owning thread per value head, as 64-bit pairs
(the accumulator fragment holds channels cc, cc + 1 of a row in consecutive elements); dG and dbeta
leave through a per-warp 16 x 33 scratch: the lanes 0..15 (one channel each) walk the block's rows from the last
to the first adding the global dG (chunk_wy_dqkg's) and the running suffix sum, lanes 16..31 sum a row's k R over
the warp's channels into a per-(row, warp) partial, summed over the 8 warps in a fixed order at the end.
Shared memory 104.7 KiB (room for 2 CTAs per SM; the registers allow 1): q, k (bf16, rows padded to 136:
conflict-free fragment loads), G (fp32 log2 units, rows of 132), dSq / dL (bf16, rows of 72: conflict-free
ldmatrix), beta, the scratch, the dbeta partials and each warp's reference G (2 x 16). Launch bound: 1 CTA per
SM, so ptxas may take 255 registers (it keeps eleven 64-bit values in local memory, stored once per CTA and
reloaded once per row block, outside the products); a block's dq / dk / dG targets are loaded before its products
(latency hidden). At 2 CTAs per SM the 128-register cap spills in the hot loops and the kernel was slower than the
CUDA-core one (docs/benchmarks/bwd_intra.md).
Pipeline per value head: G by cp.async; dAqk / dL as 16-byte loads converted to bf16 (masked to the lower /
strictly lower triangle, dSq scaled); one barrier; G padded (rows >= n take row n - 1's: exponents stay
bounded; q = k = dSq = dL = beta = 0 there, so padding adds exactly 0) and scaled to log2 units; one barrier;
the 4 row blocks. Blocks wholly past the chunk end are skipped. Assumes K = 128, chunks that never cross a
sequence (the chunk table), n >= 1 per chunk.

One configuration serves every size (sizes and the scale are runtime arguments). chunk_bwd_intra.py (CUDA cores,
fp32 throughout) is its tests' oracle, reached with launch.chunk_bwd_intra(..., tc=False). Measurements:
docs/benchmarks/bwd_intra.md, docs/benchmarks/train_bwd.md; static resources: docs/kernel_report.md.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows
from cula_core.cute_kernels.warp_mma import ldmatrix_copy_A, tiled_mma, transposed

# tile sizes as module constants (names bound inside the kernel would be traced as dynamic)
_BT, _K, _BC = 64, 128, 16
_NB = _BT // _BC  # row blocks per chunk
_LOG2E = math.log2(math.e)


def _exp2(x):
    return cute.math.exp2(x, fastmath=True)


class ChunkBwdIntraTC:
    threads = 256  # 8 warps; warp w = channels 16 w .. 16 w + 15
    QK_STRIDE = 136  # bf16 row stride of q, k: B-fragment element loads (4 rows x 8 channels a warp) hit 32 banks
    G_STRIDE = 132  # fp32 row stride of G, same reason (rows 2t: 4 t + channel / 1 distinct banks)
    A_STRIDE = 72  # bf16 row stride of dSq, dL: the 8 rows of an ldmatrix 8 x 8 fall in distinct 16-byte bank groups
    S_STRIDE = 33  # per-warp scratch rows: 16 dG values, 16 k R values, 1 pad
    MILD_LOG2 = 60.0  # diagonal block by MMA when both half spans stay below 2^60 (no overflow anywhere)

    # shared memory bytes, in allocation order (tests/sm100/test_chunk_bwd_intra_tc_cpu.py checks 2 CTAs per SM)
    SMEM = (2 * _BT * QK_STRIDE * 2 + _BT * G_STRIDE * 4 + 2 * _BT * A_STRIDE * 2
            + _BT * 4 + _BT * 8 * 4 + 8 * _BC * S_STRIDE * 4 + 8 * 2 * _BC * 4)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, G_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 dA_ptr: cute.Pointer, dL_ptr: cute.Pointer, dq_ptr: cute.Pointer, dk_ptr: cute.Pointer,
                 db_ptr: cute.Pointer, dg_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        # token layouts (T_total, heads, width): q/k-head tensors, value-head tensors of K, 64 and 1 columns
        def tok(H, D):
            return cute.make_layout((TT, H, D), stride=(H * D, D, 1))

        ptrs = (q_ptr, k_ptr, G_ptr, beta_ptr, dA_ptr, dL_ptr, dq_ptr, dk_ptr, db_ptr, dg_ptr)
        lays = (tok(HQK, _K), tok(HQK, _K), tok(HV, _K), tok(HV, 1), tok(HV, _BT), tok(HV, _BT), tok(HQK, _K),
                tok(HQK, _K), tok(HV, 1), tok(HV, _K))
        tensors = [cute.make_tensor(p, lay) for p, lay in zip(ptrs, lays, strict=True)]
        table = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(*tensors, table, HV // HQK, scale).launch(
            grid=[NC, HQK, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1,
            preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mDA: cute.Tensor,
               mDL: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDb: cute.Tensor, mDg: cute.Tensor,
               mT: cute.Tensor, group: cutlass.Int32, scale: cutlass.Float32):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        c, hq, _ = cute.arch.block_idx()
        wid = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        d0 = wid * _BC  # this warp's channels
        t0 = mT[c, 0]
        n = mT[c, 1]

        smem = cutlass.utils.SmemAllocator()
        sK = smem.allocate_tensor(bf16, cute.make_layout((_BT, _K), stride=(self.QK_STRIDE, 1)), 16)
        sQ = smem.allocate_tensor(bf16, cute.make_layout((_BT, _K), stride=(self.QK_STRIDE, 1)), 16)
        sG = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(self.G_STRIDE, 1)), 16)
        sSq = smem.allocate_tensor(bf16, cute.make_layout((_BT, _BT), stride=(self.A_STRIDE, 1)), 16)
        sSl = smem.allocate_tensor(bf16, cute.make_layout((_BT, _BT), stride=(self.A_STRIDE, 1)), 16)
        sBeta = smem.allocate_tensor(f32, cute.make_layout((_BT,)), 16)
        sPart = smem.allocate_tensor(f32, cute.make_layout((_BT, 8), stride=(8, 1)), 16)
        sScr = smem.allocate_tensor(f32, cute.make_layout((8, _BC, 2 * _BC + 1),
                                                          stride=(_BC * self.S_STRIDE, self.S_STRIDE, 1)), 16)
        sRef = smem.allocate_tensor(f32, cute.make_layout((8, 2, _BC), stride=(2 * _BC, _BC, 1)), 16)
        scr = sScr[wid, None, None]
        ref = sRef[wid, None, None]  # this warp's reference G of the current row block: row side, column side

        tDq = head_rows(mDq, t0, hq, _BT)
        tDk = head_rows(mDk, t0, hq, _BT)
        # q and k once per CTA (the group's value heads share them); rows past the end zero-filled, never read
        cp_bf = g2s_tiled_copy(_K, self.threads)
        cp_f = g2s_tiled_copy(_K, self.threads, f32)
        copy_rows_g2s(cp_bf, head_rows(mK, t0, hq, _BT), sK, n, tidx)
        copy_rows_g2s(cp_bf, head_rows(mQ, t0, hq, _BT), sQ, n, tidx)

        mma = tiled_mma(1)
        thr = mma.get_slice(lane)
        coordC = thr.partition_C(cute.make_identity_tensor((_BC, _BC)))  # (row, channel) in the block
        coordB = thr.partition_B(cute.make_identity_tensor((_BC, _BC)))  # (channel, row) of a B k-block
        accQ = cute.make_rmem_tensor(thr.partition_shape_C((_BC, _BC)), f32)
        accR = cute.make_rmem_tensor(thr.partition_shape_C((_BC, _BC)), f32)
        accC = cute.make_rmem_tensor(thr.partition_shape_C((_BC, _BC)), f32)
        rB = cute.make_rmem_tensor(thr.partition_shape_B((_BC, _BC)), bf16)
        rB2 = cute.make_rmem_tensor(thr.partition_shape_B((_BC, _BC)), bf16)
        rBl = cute.make_rmem_tensor(thr.partition_shape_B((_BC, _BC)), bf16)  # the low halves (split)
        rB2l = cute.make_rmem_tensor(thr.partition_shape_B((_BC, _BC)), bf16)
        rA = cute.make_rmem_tensor(thr.partition_shape_A((_BC, _BC)), bf16)
        rA2 = cute.make_rmem_tensor(thr.partition_shape_A((_BC, _BC)), bf16)
        dv4 = cute.make_rmem_tensor((4,), f32)
        lv4 = cute.make_rmem_tensor((4,), f32)
        sq4 = cute.make_rmem_tensor((4,), bf16)
        sl4 = cute.make_rmem_tensor((4,), bf16)

        ch = tidx % _K
        par = tidx // _K
        for hj in cutlass.range(group, unroll=1):
            hv = hq * group + hj
            cute.arch.sync_threads()  # the previous value head's readers of sG, sSq, sSl, sBeta, sPart are done
            copy_rows_g2s(cp_f, head_rows(mG, t0, hv, _BT), sG, n, tidx)
            cute.arch.cp_async_commit_group()
            # dAqk, dL: 16 threads per row, 4 columns (one 16-byte load) each, 16 rows per step; dSq = scale dAqk
            # masked to j <= i, dL to j < i, rows >= n zero (a row >= n reads row n - 1: in the chunk)
            tA = head_rows(mDA, t0, hv, _BT)
            tL = head_rows(mDL, t0, hv, _BT)
            c4 = (tidx % 16) * 4
            for s in cutlass.range_constexpr(_BT // 16):
                r = s * 16 + tidx // 16
                rs = cutlass.min(r, n - 1)
                cute.autovec_copy(cute.local_tile(tA, (1, 4), (rs, tidx % 16))[0, None], dv4)
                cute.autovec_copy(cute.local_tile(tL, (1, 4), (rs, tidx % 16))[0, None], lv4)
                for e in cutlass.range_constexpr(4):
                    col = c4 + e
                    a = f32(cutlass.select_(col <= r, dv4[e] * scale, f32(0.0)))
                    lw = f32(cutlass.select_(col < r, lv4[e], f32(0.0)))
                    a = f32(cutlass.select_(r < n, a, f32(0.0)))
                    lw = f32(cutlass.select_(r < n, lw, f32(0.0)))
                    sq4[e] = a.to(bf16)
                    sl4[e] = lw.to(bf16)
                cute.autovec_copy(sq4, cute.local_tile(sSq, (1, 4), (r, tidx % 16))[0, None])
                cute.autovec_copy(sl4, cute.local_tile(sSl, (1, 4), (r, tidx % 16))[0, None])
            if tidx < _BT:
                b = f32(0.0)
                if tidx < n:
                    b = head_rows(mBeta, t0, hv, _BT)[tidx, 0]
                sBeta[tidx] = b
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            # G to log2 units; rows >= n take row n - 1's (thread = (channel, row parity))
            g_last = sG[n - 1, ch]
            cute.arch.sync_threads()
            for rr in cutlass.range_constexpr(_BT // 2):
                r = 2 * rr + par
                sG[r, ch] = f32(cutlass.select_(r < n, sG[r, ch], g_last)) * _LOG2E
            cute.arch.sync_threads()

            tDg = head_rows(mDg, t0, hv, _BT)
            run = f32(0.0)  # lanes 0..15: the reverse cumsum of dG of channel d0 + lane, over the rows done
            for bb in cutlass.range_constexpr(_NB):
                blk = _NB - 1 - bb
                if blk * _BC < n:  # blocks wholly past the chunk end: nothing to add, nothing stored
                    run = self.row_block(blk, n, d0, lane, wid, run, mma, coordC, coordB, accQ, accR, accC, rA,
                                         rA2, rB, rB2, rBl, rB2l, sK, sQ, sG, sSq, sSl, sBeta, sPart, scr, ref, tDq,
                                         tDk, tDg)
            cute.arch.sync_threads()  # sPart complete
            if tidx < n:
                tDb = head_rows(mDb, t0, hv, _BT)
                p = sPart[tidx, 0]
                for w in cutlass.range_constexpr(1, 8):
                    p += sPart[tidx, w]
                tDb[tidx, 0] = tDb[tidx, 0] + p

    @cute.jit
    def row_block(self, blk: cutlass.Constexpr, n, d0, lane, wid, run, mma, coordC, coordB, accQ, accR, accC, rA,
                  rA2, rB, rB2, rBl, rB2l, sK, sQ, sG, sSq, sSl, sBeta, sPart, scr, ref, tDq, tDk,
                  tDg):
        """Row block blk of this warp's 16 channels: dq, R (row side) and C (column side) of rows 16 blk .. 16 blk + 15,
        added to dq, dk, dG (and dbeta's partials); returns the running suffix sum of dG (lanes 0..15)."""
        f32 = cutlass.Float32
        r0 = blk * _BC
        r1 = r0 + _BC - 1
        rm = r0 + _BC // 2
        # the block's half spans over the warp's channels (log2 units): lanes l and l + 16 read the same channel
        cd = d0 + lane % _BC
        span = cute.arch.fmax(sG[r0, cd] - sG[rm, cd], sG[rm, cd] - sG[r1, cd])
        for sh in cutlass.range_constexpr(5):
            span = cute.arch.fmax(span, cute.arch.shuffle_sync_bfly(span, 1 << sh))
        mild = span < self.MILD_LOG2
        strong = span >= self.MILD_LOG2
        # the reference rows' G of the warp's channels (module docstring): the middle row when mild, else the first
        # (row side) and the last (column side); read back from shared memory by the products and the scalings
        if lane < _BC:
            ref[0, lane] = f32(cutlass.select_(mild, sG[rm, cd], sG[r0, cd]))
            ref[1, lane] = f32(cutlass.select_(mild, sG[rm, cd], sG[r1, cd]))
        cute.arch.sync_warp()
        # what this block adds to (dq, dk: the thread's fragment elements; dG: channel d0 + lane % 16, every row),
        # loaded before the products so that their latency hides behind them (rows clamped into the chunk)
        oq = cute.make_rmem_tensor((cute.size(accQ),), f32)
        ok = cute.make_rmem_tensor((cute.size(accQ),), f32)
        gin = cute.make_rmem_tensor((_BC,), f32)
        self.load_targets(r0, n, d0, lane, coordC, oq, ok, gin, tDq, tDk, tDg)
        accQ.fill(0.0)
        accR.fill(0.0)
        accC.fill(0.0)
        # row side: B = k_j exp2(G_ref - G_j) over column blocks jb <= blk (the diagonal one when mild)
        for jb in cutlass.range_constexpr(blk + 1):
            if cutlass.const_expr(jb < blk):
                self.row_mma(blk, jb, ref, d0, lane, mma, coordB, accQ, accR, rA, rA2, rB, rBl, sK, sG, sSq, sSl)
            else:
                if mild:
                    self.row_mma(blk, jb, ref, d0, lane, mma, coordB, accQ, accR, rA, rA2, rB, rBl, sK, sG, sSq, sSl)
        # column side: B = q_i exp2(G_i - G_ref), beta_i k_i exp2(G_i - G_ref) over row blocks ib >= blk
        for ib in cutlass.range_constexpr(blk, _NB):
            if cutlass.const_expr(ib > blk):
                self.col_mma(blk, ib, ref, d0, lane, mma, coordB, accC, rA, rA2, rB, rB2, rBl, rB2l, sK, sQ, sG,
                             sSq, sSl, sBeta)
            else:
                if mild:
                    self.col_mma(blk, ib, ref, d0, lane, mma, coordB, accC, rA, rA2, rB, rB2, rBl, rB2l, sK, sQ,
                                 sG, sSq, sSl, sBeta)
        # the factors taken out: exp2(G_i - G_ref) (row side), exp2(G_ref - G_j) (column side)
        for v in cutlass.range_constexpr(cute.size(accQ)):
            rr, cc = coordC[v]
            g = sG[r0 + rr, d0 + cc]
            eq = _exp2(g - ref[0, cc])
            accQ[v] = accQ[v] * eq
            accR[v] = accR[v] * eq
            accC[v] = accC[v] * _exp2(ref[1, cc] - g)
        if strong:
            self.exact_diagonal(blk, d0, coordC, accQ, accR, accC, sK, sQ, sG, sSq, sSl, sBeta)

        # outputs: dq, dk read-added-written by the owning thread; dG's and dbeta's row terms to the scratch
        for v in cutlass.range_constexpr(cute.size(accQ)):
            rr, cc = coordC[v]
            i = r0 + rr
            d = d0 + cc
            qi = sQ[i, d].to(f32)
            ki = sK[i, d].to(f32)
            bi = sBeta[i]
            br = bi * accR[v]
            oq[v] = oq[v] + accQ[v]
            ok[v] = ok[v] + (br + accC[v])
            scr[rr, cc] = (qi * accQ[v] + ki * br) - ki * accC[v]
            scr[rr, _BC + cc] = ki * accR[v]
        # stored as 64-bit pairs (fragment elements 2 pr, 2 pr + 1: channels cc, cc + 1 of one row; see load_targets)
        for pr in cutlass.range_constexpr(cute.size(oq) // 2):
            rr, cc = coordC[2 * pr]
            if r0 + rr < n:
                col = (d0 + cc) // 2
                cute.autovec_copy(cute.local_tile(oq, (2,), (pr,)),
                                  cute.local_tile(tDq, (1, 2), (r0 + rr, col))[0, None])
                cute.autovec_copy(cute.local_tile(ok, (2,), (pr,)),
                                  cute.local_tile(tDk, (1, 2), (r0 + rr, col))[0, None])
        cute.arch.sync_warp()
        if lane < _BC:
            # the block's rows, last to first: dG (chunk_wy_dqkg's + this kernel's) into the running suffix sum
            d = d0 + lane
            for k in cutlass.range_constexpr(_BC):
                rr = _BC - 1 - k
                if r0 + rr < n:
                    run = run + (gin[rr] + scr[rr, lane])
                    tDg[r0 + rr, d] = run
        else:
            # row lane - 16: sum over the warp's channels of k R (dbeta's partial), fixed order
            rr = lane - _BC
            p = scr[rr, _BC]
            for cc in cutlass.range_constexpr(1, _BC):
                p += scr[rr, _BC + cc]
            sPart[r0 + rr, wid] = p
        cute.arch.sync_warp()  # the scratch is free for the next block
        return run

    @cute.jit
    def load_targets(self, r0, n, d0, lane, coordC, oq, ok, gin, tDq, tDk, tDg):
        """The dq, dk (the thread's fragment elements) and dG (channel d0 + lane % 16, the block's 16 rows) this
        block adds to; rows clamped into the chunk (a padding row reads row n - 1, never stored)."""
        for pr in cutlass.range_constexpr(cute.size(oq) // 2):
            rr, cc = coordC[2 * pr]  # elements 2 pr, 2 pr + 1: channels cc, cc + 1 (cc even) of one row
            rs = cutlass.min(r0 + rr, n - 1)
            col = (d0 + cc) // 2
            cute.autovec_copy(cute.local_tile(tDq, (1, 2), (rs, col))[0, None], cute.local_tile(oq, (2,), (pr,)))
            cute.autovec_copy(cute.local_tile(tDk, (1, 2), (rs, col))[0, None], cute.local_tile(ok, (2,), (pr,)))
        for rr in cutlass.range_constexpr(_BC):
            gin[rr] = tDg[cutlass.min(r0 + rr, n - 1), d0 + lane % _BC]

    @cute.jit
    def load_a(self, mma, lane, s, trans: cutlass.Constexpr, rA):
        """rA = the 16 x 16 bf16 tile s (a view: transposed with respect to storage when `trans`) by ldmatrix."""
        cp = ldmatrix_copy_A(mma, cutlass.BFloat16, trans)
        tc = cp.get_slice(lane)
        cute.copy(cp, tc.partition_S(s), tc.retile(rA))

    @cute.jit
    def row_mma(self, blk: cutlass.Constexpr, jb: cutlass.Constexpr, ref, d0, lane, mma, coordB, accQ, accR, rA, rA2,
                rB, rBl, sK, sG, sSq, sSl):
        """accQ += dSq[blk, jb] @ B, accR += dL[blk, jb] @ B, B[d, j] = k_j exp2(G_ref - G_j) over column block jb
        (B = rB + rBl; G_ref of channel d0 + c: ref[0, c])."""
        for e in cutlass.range_constexpr(cute.size(rB)):
            cc, jj = coordB[e]
            j = jb * _BC + jj
            d = d0 + cc
            self.split(sK[j, d].to(cutlass.Float32) * _exp2(ref[0, cc] - sG[j, d]), rB, rBl, e)
        self.load_a(mma, lane, cute.local_tile(sSq, (_BC, _BC), (blk, jb)), False, rA)
        self.load_a(mma, lane, cute.local_tile(sSl, (_BC, _BC), (blk, jb)), False, rA2)
        cute.gemm(mma, accQ, rA, rB, accQ)
        cute.gemm(mma, accR, rA2, rB, accR)
        cute.gemm(mma, accQ, rA, rBl, accQ)
        cute.gemm(mma, accR, rA2, rBl, accR)

    @cute.jit
    def col_mma(self, blk: cutlass.Constexpr, ib: cutlass.Constexpr, ref, d0, lane, mma, coordB, accC, rA, rA2, rB,
                rB2, rBl, rB2l, sK, sQ, sG, sSq, sSl, sBeta):
        """accC += dSq[ib, blk]^T @ Bq + dL[ib, blk]^T @ Bk: Bq[d, i] = q_i exp2(G_i - G_ref), Bk = beta_i k_i
        (same; G_ref of channel d0 + c: ref[1, c])."""
        for e in cutlass.range_constexpr(cute.size(rB)):
            cc, ii = coordB[e]
            i = ib * _BC + ii
            d = d0 + cc
            x = _exp2(sG[i, d] - ref[1, cc])
            self.split(sQ[i, d].to(cutlass.Float32) * x, rB, rBl, e)
            self.split((sBeta[i] * sK[i, d].to(cutlass.Float32)) * x, rB2, rB2l, e)
        # A[j, i] = dSq[i, j]: the (ib, blk) tile seen transposed, loaded with ldmatrix.trans
        self.load_a(mma, lane, transposed(cute.local_tile(sSq, (_BC, _BC), (ib, blk)), _BC, _BC), True, rA)
        self.load_a(mma, lane, transposed(cute.local_tile(sSl, (_BC, _BC), (ib, blk)), _BC, _BC), True, rA2)
        cute.gemm(mma, accC, rA, rB, accC)
        cute.gemm(mma, accC, rA2, rB2, accC)
        cute.gemm(mma, accC, rA, rBl, accC)
        cute.gemm(mma, accC, rA2, rB2l, accC)

    @cute.jit
    def split(self, x, rhi, rlo, e):
        """rhi[e] = bf16(x), rlo[e] = bf16(x - rhi[e]): x to ~16 bits in two bf16 operands (two MMAs each). Their
        rounding is what dG's cancellation amplifies: a CPU emulation of this algorithm against fp64 (mild decay)
        gives dG 6.5e-3 with one bf16 and 1.8e-3 with the pair, the dSq / dL rounding left."""
        h = x.to(cutlass.BFloat16)
        rhi[e] = h
        rlo[e] = (x - h.to(cutlass.Float32)).to(cutlass.BFloat16)

    @cute.jit
    def exact_diagonal(self, blk: cutlass.Constexpr, d0, coordC, accQ, accR, accC, sK, sQ, sG, sSq, sSl, sBeta):
        """The diagonal block's pairs in fp32 with one exp2 per (pair, element) (the decay is too strong for the
        factorisation): element (i, d) of the thread's fragments adds sum_{j <= i} (dSq_ij, dL_ij) k_j E_ij to
        (dq, R) and sum_{i' >= i} (dSq_i'i q_i' + beta_i' dL_i'i k_i') E_i'i to C, j and i' in the block.

        One exponential serves both sides: exp2(-|G_i - G_j|) is E_ij for j <= i and E_ji for j >= i (G is
        non-increasing), and <= 1, so the pairs outside a side's triangle, whose dSq / dL entries are zero in the
        tiles, add exactly 0 (no inf * 0, no select)."""
        f32 = cutlass.Float32
        r0 = blk * _BC
        for jj in cutlass.range(_BC, unroll=1):
            j = r0 + jj
            bj = sBeta[j]
            for v in cutlass.range_constexpr(cute.size(accQ)):
                rr, cc = coordC[v]
                d = d0 + cc
                i = r0 + rr
                gi = sG[i, d]
                gj = sG[j, d]
                kj = sK[j, d].to(f32)
                e = _exp2(f32(cutlass.select_(jj <= rr, gi - gj, gj - gi)))
                accQ[v] = accQ[v] + sSq[i, j].to(f32) * kj * e
                accR[v] = accR[v] + sSl[i, j].to(f32) * kj * e
                accC[v] = accC[v] + (sSq[j, i].to(f32) * sQ[j, d].to(f32) + bj * sSl[j, i].to(f32) * kj) * e
