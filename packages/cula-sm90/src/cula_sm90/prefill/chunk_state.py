"""KDA prefill, stage 2 of 2: the serial state recurrence over the chunks of a segment, and the outputs.

One CTA per (segment, value head, 32-column slice of the state), 128 threads. A segment is a token range
[start, end) that starts at a chunk boundary: a whole sequence, or one piece of a sequence under intra-card
context parallel (CP). Per chunk of 64 tokens, with h the state slice [K = 128, 32] (fp32) at the chunk start
and the stage-1 intermediates (chunk_intra.py):

    v_new = u - w @ h                                   [64, 32]
    o     = qg @ h + Aqk @ v_new                        (qg already carries scale)
    h     = diag(exp(gl)) h + kg^T @ v_new

Thread k owns row k of h in registers for the update; a copy in shared memory feeds the two products with
h (4x4 register blocks per thread). Slices of the state are independent (each column of the state evolves on
its own), hence the V / 32 slices per head.

Modes (compile time):
  * normal: h starts from initial_state[h0_idx] (zeros when h0_idx < 0), o is written, the final state goes
    to final_state[ht_idx] when ht_idx >= 0.
  * affine (the CP map pass): the state is the augmented [M | c] of width K + V (8 slices): slices of M start
    from the identity with u = 0, slices of c from zero with the real u; no o. The result is the piece's affine
    map, state_out = M @ state_in + c (cula_core.reference.context_parallel.piece_affine_map).

Segment table `seg` [S, 5] int32: (first token, end token, first global chunk, h0_idx, ht_idx).
Everything is SIMT fp32 for now (no tensor cores, no TMA): the correct first version. Assumes K = V = 128.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

BT = 64
DK = 128
BV = 32  # state columns per CTA
PAD = DK + 1
VPAD = BV + 1


class ChunkStateKernel:
    threads = 128

    def __init__(self, affine: bool):
        self.affine = affine

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
            grid=[S, HV, width // BV], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor,
               gl: cute.Tensor, seg: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, o: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        s, hv, vs = cute.arch.block_idx()

        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(PAD, 1)), 16)
        sQg = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(PAD, 1)), 16)
        sKg = smem.allocate_tensor(Float32, cute.make_layout((BT, DK), stride=(PAD, 1)), 16)
        sA = smem.allocate_tensor(Float32, cute.make_layout((BT, BT), stride=(BT + 1, 1)), 16)
        sH = smem.allocate_tensor(Float32, cute.make_layout((DK, BV), stride=(VPAD, 1)), 16)
        sU = smem.allocate_tensor(Float32, cute.make_layout((BT, BV), stride=(VPAD, 1)), 16)

        start = seg[s, 0]
        end = seg[s, 1]
        chunk0 = seg[s, 2]
        h0_idx = seg[s, 3]
        ht_idx = seg[s, 4]

        # column range of this CTA: in the value dim (normal), or of the augmented [M | c] (affine)
        col0 = vs * BV
        is_m = False
        ucol0 = col0
        if const_expr(self.affine):
            is_m = vs < DK // BV
            ucol0 = col0 - DK

        kr = tid  # the state row this thread owns
        h = cute.make_rmem_tensor(cute.make_layout(BV), Float32)
        for c in cutlass.range_constexpr(BV):
            x = Float32(0.0)
            if const_expr(self.affine):
                if is_m:
                    if kr == col0 + c:
                        x = Float32(1.0)
            else:
                if h0_idx >= 0:
                    x = h0[h0_idx, hv, kr, col0 + c]
            h[c] = x
            sH[kr, c] = x

        # 4x4 register blocks of the [64, 32] products: rows ib + 16 m, columns vb + 8 n
        ib = tid // 8
        vb = tid % 8
        n_chunks = (end - start + BT - 1) // BT
        for ci in cutlass.range(n_chunks):
            t0 = start + ci * BT
            L = end - t0
            if L > BT:
                L = Int32(BT)
            cute.arch.sync_threads()  # the previous chunk's readers of the shared tiles are done
            # loads unrolled in groups of 16 rows so that many are in flight at once (latency, not bandwidth,
            # bounds this serial loop)
            for grp in cutlass.range_constexpr(BT // 16):
                for ii in cutlass.range_constexpr(16):
                    i = grp * 16 + ii
                    xw = Float32(0.0)
                    xk = Float32(0.0)
                    xq = Float32(0.0)
                    if i < L:
                        xw = w[t0 + i, hv, tid].to(Float32)
                        xk = kg[t0 + i, hv, tid].to(Float32)
                        if const_expr(not self.affine):
                            xq = qg[t0 + i, hv, tid].to(Float32)
                    sW[i, tid] = xw
                    sKg[i, tid] = xk
                    sQg[i, tid] = xq
            for m in cutlass.range_constexpr(BT * BV // self.threads):
                i = m * (self.threads // BV) + tid // BV
                c = tid % BV
                xu = Float32(0.0)
                if i < L:
                    if const_expr(self.affine):
                        if not is_m:
                            xu = u[t0 + i, hv, ucol0 + c].to(Float32)
                    else:
                        xu = u[t0 + i, hv, col0 + c].to(Float32)
                sU[i, c] = xu
            if const_expr(not self.affine):
                for m in cutlass.range_constexpr(BT * BT // self.threads):
                    i = m * (self.threads // BT) + tid // BT
                    jc = tid % BT
                    xa = Float32(0.0)
                    if i < L:
                        xa = aqk[t0 + i, hv, jc].to(Float32)
                    sA[i, jc] = xa
            decay = cute.math.exp(gl[chunk0 + ci, hv, kr], fastmath=True)
            cute.arch.sync_threads()

            # v_new = u - w @ h ; o = qg @ h (accumulated here, Aqk @ v_new added below)
            acc_v = cute.make_rmem_tensor(cute.make_layout((4, 4)), Float32)
            acc_o = cute.make_rmem_tensor(cute.make_layout((4, 4)), Float32)
            for m in cutlass.range_constexpr(4):
                for nn in cutlass.range_constexpr(4):
                    acc_v[m, nn] = Float32(0.0)
                    acc_o[m, nn] = Float32(0.0)
            for d in cutlass.range(DK, unroll=4):
                hd = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                for nn in cutlass.range_constexpr(4):
                    hd[nn] = sH[d, vb + 8 * nn]
                for m in cutlass.range_constexpr(4):
                    xw = sW[ib + 16 * m, d]
                    for nn in cutlass.range_constexpr(4):
                        acc_v[m, nn] += xw * hd[nn]
                    if const_expr(not self.affine):
                        xq = sQg[ib + 16 * m, d]
                        for nn in cutlass.range_constexpr(4):
                            acc_o[m, nn] += xq * hd[nn]
            cute.arch.sync_threads()  # every reader of sU's old role is done: it becomes v_new in place
            for m in cutlass.range_constexpr(4):
                for nn in cutlass.range_constexpr(4):
                    r = ib + 16 * m
                    cc = vb + 8 * nn
                    sU[r, cc] = sU[r, cc] - acc_v[m, nn]
            cute.arch.sync_threads()

            if const_expr(not self.affine):
                for jj in cutlass.range(BT, unroll=4):
                    vn = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                    for nn in cutlass.range_constexpr(4):
                        vn[nn] = sU[jj, vb + 8 * nn]
                    for m in cutlass.range_constexpr(4):
                        a = sA[ib + 16 * m, jj]
                        for nn in cutlass.range_constexpr(4):
                            acc_o[m, nn] += a * vn[nn]
                for m in cutlass.range_constexpr(4):
                    r = ib + 16 * m
                    if r < L:
                        for nn in cutlass.range_constexpr(4):
                            o[t0 + r, hv, col0 + vb + 8 * nn] = acc_o[m, nn].to(o.element_type)

            # h = diag(exp(gl)) h + kg^T v_new  (row kr of h)
            for c in cutlass.range_constexpr(BV):
                h[c] = h[c] * decay
            for i in cutlass.range(BT, unroll=2):
                kgi = sKg[i, kr]
                for c in cutlass.range_constexpr(BV):
                    h[c] += kgi * sU[i, c]
            cute.arch.sync_threads()  # all readers of the old sH are done
            for c in cutlass.range_constexpr(BV):
                sH[kr, c] = h[c]

        if ht_idx >= 0:
            for c in cutlass.range_constexpr(BV):
                ht[ht_idx, hv, kr, col0 + c] = h[c]
