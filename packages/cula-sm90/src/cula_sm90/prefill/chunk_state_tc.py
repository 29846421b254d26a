"""KDA prefill, stage 2 on tensor cores: the serial state recurrence over the chunks of a segment, and o.

One CTA per (segment, value head, BV-column slice of the state): BV = 64 (what forward.py compiles: 256 threads,
8 warps as 4 along M x 2 along N) or 32 (128 threads, 4 warps stacked along M). Per chunk of 64 tokens, with h the
fp32 state slice [K = 128, BV] (registers, mma accumulator layout) and the stage-1 intermediates (chunk_intra*.py;
bf16):

    v_new = u - w @ h                    [64 x 128] @ [128 x BV]
    o     = qg @ h + Aqk @ v_new         (qg carries scale)
    h     = diag(exp(gl)) h + kg^T @ v_new

Products: mma.sync m16n8k16, bf16 operands, fp32 accumulation. h and v_new are fp32 values split as hi + lo
bf16 pairs (tc.store_split), so they keep ~16 bits through the products: the state does not drift with its own
bf16 rounding, and the CP path (stage 2 in affine mode, a scan, stage 2 again) matches the serial walk closely.
Per k-block each operand fragment is read from shared memory once: the split one's for both w @ h and qg @ h,
the other one's for both halves of the split one (gemm_split).

Sized for two CTAs per SM (the launch asks for it: at most 128 registers per thread; at BV = 64, 96.5 KiB of
shared memory, 72.5 KiB in affine mode): every input tile has one buffer, refilled by cp.async as soon as the
chunk's last reader of it is past a barrier, so each load overlaps the other half of the step (and the other
CTA's work); the split v_new is written over the split h, which only the first products read:

    top     h -> split tile, exp(gl) -> decays; wait for w, u, qg                          barrier
    1       v_new = u - w @ h and o = qg @ h; wait for Aqk, kg                              barrier
            cp.async of the next chunk's w, u, qg; v_new -> split tile (over h's)           barrier
    2       o += Aqk @ v_new, stored; h = decay h + kg^T @ v_new                            barrier
            cp.async of the next chunk's Aqk, kg

Rows past the segment end are zero-filled in shared memory (w = u = kg = 0 there, so v_new = 0 and h is
untouched) and never read from global memory.

Modes (compile time): normal (h0_idx / ht_idx from the segment table, o written) or affine (the CP map pass over
the augmented state [M | c], K + V = 256 columns: the slices of M start from the identity with u = 0, the slices
of c from zero; no o, no qg / Aqk tiles). Segment table `seg` [S, 5] int32: (first token, end token, first global
chunk, h0_idx, ht_idx). Assumes K = V = 128 and 16-byte aligned intermediates (allocated by forward.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from cula_sm90.prefill import tc

BT = 64
DK = 128
BV = 32
CTAS_PER_SM = 2  # the launch bound: registers are capped so that this many CTAs fit an SM


@cute.jit
def gemm_split(tmma: cute.TiledMma, accs: tuple, sAs: tuple, sBh: cute.Tensor, sBl: cute.Tensor, tid,
               a_t: cutlass.Constexpr, b_t: cutlass.Constexpr):
    """accs[i] += sAs[i] @ (sBh + sBl)^T for each of the (one or two) pairs, tc.gemm's convention (`a_t` / `b_t`:
    ldmatrix.trans). Per k-block each fragment is read from shared memory once: the split operand's for every
    product, each A for both halves of the split one."""
    thr = tmma.get_slice(tid)
    ldA = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(a_t, 4), BFloat16), tmma)
    ldB = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(b_t, 4), BFloat16), tmma)
    tA = ldA.get_slice(tid)
    tB = ldB.get_slice(tid)
    rAs = [thr.make_fragment_A(thr.partition_A(sA)) for sA in sAs]
    rBs = [thr.make_fragment_B(thr.partition_B(sB)) for sB in (sBh, sBl)]
    srcAs = [tA.partition_S(sA) for sA in sAs]
    srcBs = [tB.partition_S(sB) for sB in (sBh, sBl)]
    dstAs = [tA.retile(rA) for rA in rAs]
    dstBs = [tB.retile(rB) for rB in rBs]
    for kb in cutlass.range_constexpr(cute.size(rAs[0].shape[2])):
        for j in cutlass.range_constexpr(2):
            cute.copy(ldB, srcBs[j][None, None, kb], dstBs[j][None, None, kb])
        for i in cutlass.range_constexpr(len(sAs)):
            cute.copy(ldA, srcAs[i][None, None, kb], dstAs[i][None, None, kb])
            for j in cutlass.range_constexpr(2):
                cute.gemm(tmma, accs[i], rAs[i][None, None, kb], rBs[j][None, None, kb], accs[i])


class ChunkStateTCKernel:
    """`bv`: state columns per CTA, 32 (4 warps stacked along M) or 64 (8 warps, 4 along M x 2 along N: each
    chunk's w, qg, kg, Aqk tiles are loaded once for twice the columns, half the CTAs)."""

    def __init__(self, affine: bool, bv: int = BV):
        self.affine = affine
        self.bv = bv
        self.wn = bv // 32  # warps along N
        self.threads = 128 * self.wn

    def tiled_mma(self):
        if self.wn == 1:
            return tc.tiled_mma_m(4)
        return tc.tiled_mma_mn(4, self.wn)

    @cute.jit
    def __call__(self, w_ptr: cute.Pointer, u_ptr: cute.Pointer, qg_ptr: cute.Pointer, kg_ptr: cute.Pointer,
                 aqk_ptr: cute.Pointer, gl_ptr: cute.Pointer, seg_ptr: cute.Pointer, h0_ptr: cute.Pointer,
                 ht_ptr: cute.Pointer, o_ptr: cute.Pointer, TT: Int32, NC: Int32, S: Int32, HV: Int32,
                 NH0: Int32, NHT: Int32, stream):
        tok = cute.make_layout((TT, HV, DK), stride=(HV * DK, DK, 1))
        w = cute.make_tensor(w_ptr, tok)
        u = cute.make_tensor(u_ptr, tok)
        qg = cute.make_tensor(qg_ptr, tok)
        kg = cute.make_tensor(kg_ptr, tok)
        o = cute.make_tensor(o_ptr, tok)
        aqk = cute.make_tensor(aqk_ptr, cute.make_layout((TT, HV, BT), stride=(HV * BT, BT, 1)))
        gl = cute.make_tensor(gl_ptr, cute.make_layout((NC, HV, DK), stride=(HV * DK, DK, 1)))
        seg = cute.make_tensor(seg_ptr, cute.make_layout((S, 5), stride=(5, 1)))
        h0 = cute.make_tensor(h0_ptr, cute.make_layout((NH0, HV, DK, DK), stride=(HV * DK * DK, DK * DK, DK, 1)))
        width = DK
        if const_expr(self.affine):
            width = 2 * DK
        ht = cute.make_tensor(ht_ptr, cute.make_layout((NHT, HV, DK, width),
                                                       stride=(HV * DK * width, DK * width, width, 1)))
        # min_blocks_per_mp caps the registers (65536 / (CTAS_PER_SM * threads)); the carveout is given so that
        # the compiler need not ask a device for it, and the whole carveout is shared memory: two CTAs' worth
        self.kernel(w, u, qg, kg, aqk, gl, seg, h0, ht, o).launch(
            grid=[S, HV, width // self.bv], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor,
               gl: cute.Tensor, seg: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, o: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        s, hv, vs = cute.arch.block_idx()
        BV = self.bv

        smem = cutlass.memory.SmemAllocator()
        # one buffer per input tile (see the module docstring for when each is refilled)
        sW = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, DK), 128)
        sKg = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, DK), 128)
        sU = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, BV), 128)
        sQg = sW
        sA = sU
        if const_expr(not self.affine):
            sQg = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, DK), 128)
            sA = smem.allocate_tensor(BFloat16, tc.bf16_tile(BT, BT), 128)
        # the split h is read by the first products only and the split v_new by the later ones: one region
        sHh = smem.allocate_tensor(BFloat16, tc.bf16_tile(DK, BV), 128)
        sHl = smem.allocate_tensor(BFloat16, tc.bf16_tile(DK, BV), 128)
        sVh = cute.make_tensor(sHh.iterator, tc.bf16_tile(BT, BV))
        sVl = cute.make_tensor(sHh.iterator + BT * BV, tc.bf16_tile(BT, BV))
        sDecay = smem.allocate_tensor(Float32, cute.make_layout(DK), 16)

        start = seg[s, 0]
        end = seg[s, 1]
        chunk0 = seg[s, 2]
        h0_idx = seg[s, 3]

        col0 = vs * BV  # column of the state (normal) or of the augmented [M | c] (affine)
        is_m = False
        ucol0 = col0
        if const_expr(self.affine):
            is_m = vs < DK // BV
            ucol0 = col0 - DK

        mma = self.tiled_mma()
        thr = mma.get_slice(tid)
        acc_h = cute.make_rmem_tensor(thr.partition_shape_C((DK, BV)), Float32)
        at_h = thr.partition_C(cute.make_identity_tensor((DK, BV)))
        acc_v = cute.make_rmem_tensor(thr.partition_shape_C((BT, BV)), Float32)
        acc_o = cute.make_rmem_tensor(thr.partition_shape_C((BT, BV)), Float32)
        at_v = thr.partition_C(cute.make_identity_tensor((BT, BV)))
        pHh = thr.partition_C(sHh)
        pHl = thr.partition_C(sHl)
        pVh = thr.partition_C(sVh)
        pVl = thr.partition_C(sVl)
        pU = thr.partition_C(sU)

        for i in cutlass.range_constexpr(cute.size(acc_h)):
            kr, c = at_h[i]
            x = Float32(0.0)
            if const_expr(self.affine):
                if is_m:
                    if kr == col0 + c:
                        x = Float32(1.0)
            else:
                if h0_idx >= 0:
                    x = h0[h0_idx, hv, kr, col0 + c]
            acc_h[i] = x

        n_chunks = (end - start + BT - 1) // BT
        # groups in flight, oldest first: (w, u, qg) of chunk ci, then (Aqk, kg) of chunk ci
        if n_chunks > 0:
            self.load_first(w, u, qg, sW, sU, sQg, start, end, hv, col0, ucol0, is_m, tid)
        cute.arch.cp_async_commit_group()
        if n_chunks > 0:
            self.load_second(kg, aqk, sKg, sA, start, end, hv, tid)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(n_chunks, unroll=1):
            t0 = start + ci * BT
            n = cutlass.min(end - t0, BT)
            if tid < DK:
                sDecay[tid] = cute.math.exp(gl[chunk0 + ci, hv, tid], fastmath=True)
            tc.store_split(acc_h, pHh, pHl)
            cute.arch.cp_async_wait_group(1)  # w, u, qg of chunk ci have landed
            cute.arch.sync_threads()

            # v_new = u - w @ h and o = qg @ h, against the split h
            acc_v.fill(0.0)
            if const_expr(not self.affine):
                acc_o.fill(0.0)
                gemm_split(mma, (acc_v, acc_o), (sW, sQg), tc.t_view(sHh, DK, BV), tc.t_view(sHl, DK, BV), tid,
                           False, True)
            else:
                gemm_split(mma, (acc_v,), (sW,), tc.t_view(sHh, DK, BV), tc.t_view(sHl, DK, BV), tid, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                uval = Float32(0.0)
                if const_expr(self.affine):
                    if not is_m:
                        uval = pU[i].to(Float32)
                else:
                    uval = pU[i].to(Float32)
                acc_v[i] = uval - acc_v[i]
            cute.arch.cp_async_wait_group(0)  # Aqk, kg of chunk ci have landed
            cute.arch.sync_threads()  # w, u, qg and the split h read by everyone
            if ci + 1 < n_chunks:
                self.load_first(w, u, qg, sW, sU, sQg, t0 + BT, end, hv, col0, ucol0, is_m, tid)
            cute.arch.cp_async_commit_group()  # (possibly empty) group: the counting stays uniform
            tc.store_split(acc_v, pVh, pVl)  # rows past the end: u = w = 0 there, so v_new = 0
            cute.arch.sync_threads()

            if const_expr(not self.affine):
                gemm_split(mma, (acc_o,), (sA,), tc.t_view(sVh, BT, BV), tc.t_view(sVl, BT, BV), tid, False, True)
                pO = thr.partition_C(tc.rows_at(o, t0, hv, col0, BT, BV))
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    r, _ = at_v[i]
                    if r < n:
                        pO[i] = acc_o[i].to(o.element_type)

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                kr, _ = at_h[i]
                acc_h[i] = acc_h[i] * sDecay[kr]
            gemm_split(mma, (acc_h,), (tc.t_view(sKg, BT, DK),), tc.t_view(sVh, BT, BV), tc.t_view(sVl, BT, BV),
                       tid, True, True)
            cute.arch.sync_threads()  # every reader of Aqk, kg, v_new and the decays is done
            if ci + 1 < n_chunks:
                self.load_second(kg, aqk, sKg, sA, t0 + BT, end, hv, tid)
            cute.arch.cp_async_commit_group()

        ht_idx = seg[s, 4]  # read here, not kept live through the walk
        if ht_idx >= 0:
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                kr, c = at_h[i]
                ht[ht_idx, hv, kr, col0 + c] = acc_h[i]

    @cute.jit
    def load_first(self, w, u, qg, sW, sU, sQg, t0, end, hv, col0, ucol0, is_m, tid):
        """cp.async of the chunk at t0's w, u slice and qg, the tiles of the first products (rows past `end`
        zero-filled, never read)."""
        n = cutlass.min(end - t0, BT)
        cp_k = tc.g2s_copy(DK, self.threads)
        cp_u = tc.g2s_copy(self.bv, self.threads)
        tc.copy_rows(cp_k, tc.rows_at(w, t0, hv, 0, BT, DK), sW, n, tid)
        if const_expr(not self.affine):
            tc.copy_rows(cp_k, tc.rows_at(qg, t0, hv, 0, BT, DK), sQg, n, tid)
            tc.copy_rows(cp_u, tc.rows_at(u, t0, hv, col0, BT, self.bv), sU, n, tid)
        else:
            if not is_m:  # the M columns see u = 0 (values [0 | v] of the augmented state)
                tc.copy_rows(cp_u, tc.rows_at(u, t0, hv, ucol0, BT, self.bv), sU, n, tid)

    @cute.jit
    def load_second(self, kg, aqk, sKg, sA, t0, end, hv, tid):
        """cp.async of the chunk at t0's kg and Aqk, the tiles of the second half of the step."""
        n = cutlass.min(end - t0, BT)
        tc.copy_rows(tc.g2s_copy(DK, self.threads), tc.rows_at(kg, t0, hv, 0, BT, DK), sKg, n, tid)
        if const_expr(not self.affine):
            tc.copy_rows(tc.g2s_copy(BT, self.threads), tc.rows_at(aqk, t0, hv, 0, BT, BT), sA, n, tid)
