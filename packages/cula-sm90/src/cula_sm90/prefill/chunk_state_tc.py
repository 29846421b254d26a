"""KDA prefill, stage 2 on tensor cores: the serial state recurrence over the chunks of a segment, and o.

One CTA per (segment, value head, BV-column slice of the state): BV = 64 (what forward.py compiles: 256 threads,
8 warps as 4 along M x 2 along N) or 32 (128 threads, 4 warps stacked along M). Per chunk of 64 tokens, with h the fp32
state slice [K = 128, BV] (registers, mma accumulator layout) and the stage-1 intermediates (chunk_intra*.py;
bf16):

    v_new = u - w @ h                    [64 x 128] @ [128 x BV]
    o     = qg @ h + Aqk @ v_new         (qg carries scale)
    h     = diag(exp(gl)) h + kg^T @ v_new

Products: mma.sync m16n8k16, bf16 operands, fp32 accumulation. In the two products that feed the state (w @ h,
kg^T @ v_new), h and v_new are fp32 values split as hi + lo bf16 pairs (store_split, gemm_split), so they
keep ~16 bits: the state does not drift with its own bf16 rounding, and the CP path (stage 2 in affine mode, a
scan, stage 2 again) matches the serial walk closely. The output products (qg @ h, Aqk @ v_new) take the hi
halves only: o is bf16 and its rounding does not feed back.
Pipeline per chunk: cp.async of w, qg, kg, Aqk and the u slice (rows past the segment end zero-filled) for the
next chunk while this one is computed (two stages), the split h written to shared memory meanwhile; then the
GEMMs. BV = 64 loads each chunk's w, qg, kg, Aqk once for 64 columns (half the CTAs and the L2 traffic of BV =
32): 176.5 KiB of shared memory, one CTA (8 warps) per SM.

Modes (compile time): normal (h0_idx / ht_idx from the segment table, o written) or affine
(the CP map pass over the augmented state [M | c], K + V = 256 columns: the slices of M start from the identity
with u = 0, the slices of c from zero; no o). Segment table `seg` [S, 5] int32: (first token, end token, first
global chunk, h0_idx, ht_idx). Assumes K = V = 128 and 16-byte aligned intermediates (allocated by forward.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows
from cula_core.cute_kernels.warp_mma import gemm, gemm_split, smem_tile_layout, store_split, tiled_mma, transposed

BT = 64
DK = 128
BV = 32


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
            return tiled_mma(4)
        return tiled_mma(4, self.wn)

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
        self.kernel(w, u, qg, kg, aqk, gl, seg, h0, ht, o).launch(
            grid=[S, HV, width // self.bv], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor,
               gl: cute.Tensor, seg: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, o: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        s, hv, vs = cute.arch.block_idx()
        BV = self.bv

        smem = cutlass.memory.SmemAllocator()
        # two stages of the per-chunk inputs: chunk ci + 1 loads while chunk ci is computed
        sW2 = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, DK, 2), 128)
        sKg2 = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, DK, 2), 128)
        sU2 = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, BV, 2), 128)
        sQg2 = sW2
        sA2 = sU2
        if const_expr(not self.affine):
            sQg2 = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, DK, 2), 128)
            sA2 = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, BT, 2), 128)
        sHh = smem.allocate_tensor(BFloat16, smem_tile_layout(DK, BV), 128)
        sHl = smem.allocate_tensor(BFloat16, smem_tile_layout(DK, BV), 128)
        sVh = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, BV), 128)
        sVl = smem.allocate_tensor(BFloat16, smem_tile_layout(BT, BV), 128)
        sDecay = smem.allocate_tensor(Float32, cute.make_layout(DK), 16)

        start = seg[s, 0]
        end = seg[s, 1]
        chunk0 = seg[s, 2]
        h0_idx = seg[s, 3]
        ht_idx = seg[s, 4]

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
        if n_chunks > 0:
            self.load_chunk(w, u, qg, kg, aqk, sW2, sKg2, sQg2, sA2, sU2, start, end, hv, col0, ucol0, is_m, 0, tid)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(n_chunks, unroll=1):
            t0 = start + ci * BT
            n = cutlass.min(end - t0, BT)
            st = ci % 2
            if ci + 1 < n_chunks:
                self.load_chunk(w, u, qg, kg, aqk, sW2, sKg2, sQg2, sA2, sU2, t0 + BT, end, hv, col0, ucol0, is_m,
                                1 - st, tid)
            cute.arch.cp_async_commit_group()  # (possibly empty) group: the counting stays uniform
            if tid < DK:
                sDecay[tid] = cute.math.exp(gl[chunk0 + ci, hv, tid], fastmath=True)
            store_split(acc_h, pHh, pHl)
            cute.arch.cp_async_wait_group(1)  # chunk ci has landed; ci + 1 may still be in flight
            cute.arch.sync_threads()
            sW = sW2[None, None, st]
            sKg = sKg2[None, None, st]
            sU = sU2[None, None, st]
            sQg = sQg2[None, None, st]
            sA = sA2[None, None, st]
            pU = thr.partition_C(sU)

            # v_new = u - w @ h (split h: v_new feeds the state) and o = qg @ h
            acc_v.fill(0.0)
            gemm_split(mma, acc_v, sW, transposed(sHh, DK, BV), transposed(sHl, DK, BV), tid, False, True)
            if const_expr(not self.affine):
                acc_o.fill(0.0)
                gemm(mma, acc_o, sQg, transposed(sHh, DK, BV), tid, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                uval = Float32(0.0)
                if const_expr(self.affine):
                    if not is_m:
                        uval = pU[i].to(Float32)
                else:
                    uval = pU[i].to(Float32)
                acc_v[i] = uval - acc_v[i]
            store_split(acc_v, pVh, pVl)  # rows past the end: u = w = 0 there, so v_new = 0
            cute.arch.sync_threads()

            if const_expr(not self.affine):
                gemm(mma, acc_o, sA, transposed(sVh, BT, BV), tid, False, True)
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    r, c = at_v[i]
                    if r < n:
                        o[t0 + r, hv, col0 + c] = acc_o[i].to(o.element_type)

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                kr, _ = at_h[i]
                acc_h[i] = acc_h[i] * sDecay[kr]
            gemm_split(mma, acc_h, transposed(sKg, BT, DK), transposed(sVh, BT, BV), transposed(sVl, BT, BV), tid,
                          True, True)
            cute.arch.sync_threads()  # every reader of this chunk's tiles is done before the next copies

        if ht_idx >= 0:
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                kr, c = at_h[i]
                ht[ht_idx, hv, kr, col0 + c] = acc_h[i]

    @cute.jit
    def load_chunk(self, w, u, qg, kg, aqk, sW2, sKg2, sQg2, sA2, sU2, t0, end, hv, col0, ucol0, is_m, st, tid):
        """cp.async of one chunk's tiles into stage `st` (rows past `end` zero-filled, never read)."""
        n = cutlass.min(end - t0, BT)
        BV = self.bv
        cp_k = g2s_tiled_copy(DK, self.threads)
        copy_rows_g2s(cp_k, head_rows(w, t0, hv, BT), sW2[None, None, st], n, tid)
        copy_rows_g2s(cp_k, head_rows(kg, t0, hv, BT), sKg2[None, None, st], n, tid)
        cp_u = g2s_tiled_copy(BV, self.threads)
        if const_expr(not self.affine):
            copy_rows_g2s(cp_k, head_rows(qg, t0, hv, BT), sQg2[None, None, st], n, tid)
            copy_rows_g2s(g2s_tiled_copy(BT, self.threads), head_rows(aqk, t0, hv, BT), sA2[None, None, st], n,
                         tid)
            copy_rows_g2s(cp_u, head_rows(u, t0, hv, BT, col0, BV), sU2[None, None, st], n, tid)
        else:
            if not is_m:  # the M columns see u = 0 (values [0 | v] of the augmented state)
                copy_rows_g2s(cp_u, head_rows(u, t0, hv, BT, ucol0, BV), sU2[None, None, st], n, tid)
