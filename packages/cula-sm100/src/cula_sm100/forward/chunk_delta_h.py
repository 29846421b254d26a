"""chunk_delta_h: the inter-chunk state recurrence, one (sequence, value head, BV-column slice of V) per CTA.

For each chunk of the sequence, in order (h: the state [K = 128, BV] at the chunk start, fp32 registers;
BV = 32 by default):

    h_out[chunk] = h                                  (saved, bf16 as FLA, for fwd_o and the backward)
    v_new = u - w @ h                                 (bf16 out)
    h     = diag(exp(G_last)) h + kg^T @ v_new

starting from initial_state (or zeros) and ending in final_state (fp32) if asked. Sequences come from the
sequence table (first token, end, first global chunk), so varlen and empty sequences need nothing more.
Tiling: 128 threads (4 warps along M); `w @ h` is [64 x 128] @ [128 x BV] and `kg^T @ v_new` is
[128 x 64] @ [64 x BV], both mma.sync m16n8k16 with bf16 operands (h and v_new rounded to bf16 as FLA) and
fp32 accumulation; transposed operands read with ldmatrix.trans. Pipeline: two shared-memory stages;
chunk ci + 1's w, kg and u load (cp.async, rows past the end zero) while chunk ci stores h, multiplies,
writes v_new and updates h; G at chunk ci + 1's last row is loaded during chunk ci. h and v_new leave from
their bf16 shared tiles (the GEMM operands) in 16-byte rows. chunk_delta_h_lean.py subclasses this one with
a pipeline of fewer bytes per CTA (not on the live path yet).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import (copy_rows_g2s, g2s_tiled_copy, gemm_ss, head_rows, make_tiled_mma,
                                          smem_layout, store_rows_s2g, token_layout, transposed)


class ChunkDeltaH:
    BT = 64
    K = 128
    V = 128
    threads = 128

    def __init__(self, has_initial_state: bool, output_final_state: bool, BV: int = 32):
        self.has_h0 = has_initial_state
        self.store_ht = output_final_state
        # columns of V per CTA: 32 gives 4 CTAs per (sequence, head), so N * HV * 4 CTAs (3 per SM by shared
        # memory) keep the SMs busy; each re-reads w and kg, which mostly hit in L2 (FLA's autotuner picks 32 too)
        self.BV = BV

    @cute.jit
    def __call__(self, w_ptr: cute.Pointer, u_ptr: cute.Pointer, kg_ptr: cute.Pointer, G_ptr: cute.Pointer,
                 h0_ptr: cute.Pointer, h_ptr: cute.Pointer, vnew_ptr: cute.Pointer, ht_ptr: cute.Pointer,
                 seq_ptr: cute.Pointer, TT: cutlass.Int32, NT: cutlass.Int32, N: cutlass.Int32, HV: cutlass.Int32,
                 stream: cuda.CUstream):
        K, V = self.K, self.V
        hv_k = token_layout(TT, HV, K)
        hv_v = token_layout(TT, HV, V)
        mW = cute.make_tensor(w_ptr, hv_k)
        mU = cute.make_tensor(u_ptr, hv_v)
        mKg = cute.make_tensor(kg_ptr, hv_k)
        mG = cute.make_tensor(G_ptr, hv_k)
        mVn = cute.make_tensor(vnew_ptr, hv_v)
        # states [*, HV, K, V] viewed as (* HV K, 1, V) so head_rows tiles (state, head) with 64-bit offsets
        state = cute.make_layout((N * HV * K, 1, V), stride=(V, V, 1))
        mH0 = cute.make_tensor(h0_ptr, state)
        mHt = cute.make_tensor(ht_ptr, state)
        mH = cute.make_tensor(h_ptr, cute.make_layout((NT * HV * K, 1, V), stride=(V, V, 1)))
        mS = cute.make_tensor(seq_ptr, cute.make_layout((N, 3), stride=(3, 1)))
        self.launch((mW, mU, mKg, mG, mH0, mH, mVn, mHt, mS, HV), N, HV, stream)

    @cute.jit
    def launch(self, args, N, HV, stream):
        self.kernel(*args).launch(grid=[N, HV, self.V // self.BV], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
               mH: cute.Tensor, mVn: cute.Tensor, mHt: cute.Tensor, mS: cute.Tensor, HV: cutlass.Int32):
        K, BT, BV = self.K, self.BT, self.BV
        tidx, _, _ = cute.arch.thread_idx()
        s, hv, vb = cute.arch.block_idx()
        v0 = vb * BV
        bos, eos, first, nchunks = self.sequence(mS, s)

        smem = cutlass.utils.SmemAllocator()
        # two stages of the chunk inputs: chunk ci + 1 loads while chunk ci computes
        sW = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K, 2), 128)
        sKg = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K, 2), 128)
        sU = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BV, 2), 128)
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_layout(K, BV), 128)
        sVn = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BV), 128)
        sGl = smem.allocate_tensor(cutlass.Float32, cute.make_layout((K,)), 16)

        mma, thr, acc_h, coord_h, acc_v, coord_v = self.fragments(tidx)
        sH_part = thr.partition_C(sH)
        sVn_part = thr.partition_C(sVn)

        self.init_state(acc_h, coord_h, mH0, s, hv, v0, HV)

        gl = cutlass.Float32(0.0)  # G at the last row of the current chunk, channel tidx (loaded one chunk ahead)
        if nchunks > 0:
            self.load_chunk(mW, mKg, mU, sW, sKg, sU, bos, eos, 0, 0, hv, vb, tidx)
            gl = self.last_g(mG, bos, eos, hv, tidx)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(nchunks, unroll=1):
            stage = ci % 2
            t0 = bos + ci * BT
            n = cutlass.min(eos - t0, BT)
            if ci + 1 < nchunks:
                self.load_chunk(mW, mKg, mU, sW, sKg, sU, bos, eos, ci + 1, 1 - stage, hv, vb, tidx)
            cute.arch.cp_async_commit_group()
            sGl[tidx] = cute.math.exp(gl, fastmath=True)
            if ci + 1 < nchunks:  # the next chunk's last-row G: its latency hides behind this chunk's work
                gl = self.last_g(mG, t0 + BT, eos, hv, tidx)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                sH_part[i] = acc_h[i].to(cutlass.BFloat16)
            cute.arch.cp_async_wait_group(1)  # this chunk's stage has landed; the next one may still fly
            cute.arch.sync_threads()
            # h out in 16-byte rows (from the bf16 copy the GEMM reads)
            store_rows_s2g(sH, cute.local_tile(head_rows(mH, ((first + ci) * HV + hv) * K, 0, K), (K, BV), (0, vb)),
                           K, tidx, self.threads)

            sU_s = sU[None, None, stage]
            acc_v.fill(0.0)
            gemm_ss(mma, acc_v, sW[None, None, stage], transposed(sH, K, BV), tidx, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, c2 = coord_v[i]
                x = cutlass.Float32(0.0)
                if r2 < n:
                    x = sU_s[r2, c2].to(cutlass.Float32) - acc_v[i]
                sVn_part[i] = x.to(cutlass.BFloat16)
            cute.arch.sync_threads()
            store_rows_s2g(sVn, cute.local_tile(head_rows(mVn, t0, hv, BT), (BT, BV), (0, vb)), n, tidx, self.threads)

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * sGl[k3]
            gemm_ss(mma, acc_h, transposed(sKg[None, None, stage], BT, K), transposed(sVn, BT, BV), tidx, True, True)
            cute.arch.sync_threads()

        self.final_state(acc_h, coord_h, mHt, s, hv, v0, HV)

    @cute.jit
    def sequence(self, mS, s):
        """(first token, end, first global chunk, number of chunks) of sequence s."""
        bos = mS[s, 0]
        eos = mS[s, 1]
        return bos, eos, mS[s, 2], (eos - bos + self.BT - 1) // self.BT

    @cute.jit
    def fragments(self, tidx):
        """The 4-warp MMA, this thread's slice, and the accumulators (with coordinates) of h [K, BV] and of
        w @ h [BT, BV]."""
        mma = make_tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc_h = cute.make_rmem_tensor(thr.partition_shape_C((self.K, self.BV)), cutlass.Float32)
        coord_h = thr.partition_C(cute.make_identity_tensor((self.K, self.BV)))
        acc_v = cute.make_rmem_tensor(thr.partition_shape_C((self.BT, self.BV)), cutlass.Float32)
        coord_v = thr.partition_C(cute.make_identity_tensor((self.BT, self.BV)))
        return mma, thr, acc_h, coord_h, acc_v, coord_v

    @cute.jit
    def last_g(self, mG, t0, eos, hv, tidx):
        """G (fp32) at the last row of the chunk that starts at token t0, channel tidx."""
        return head_rows(mG, t0, hv, self.BT)[cutlass.min(eos - t0, self.BT) - 1, tidx].to(cutlass.Float32)

    @cute.jit
    def init_state(self, acc_h, coord_h, mH0, s, hv, v0, HV):
        """acc_h = this CTA's slice of the initial state (fp32), or zeros."""
        if cutlass.const_expr(self.has_h0):
            tH0 = head_rows(mH0, (s * HV + hv) * self.K, 0, self.K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k0, c0 = coord_h[i]
                acc_h[i] = tH0[k0, v0 + c0]
        else:
            acc_h.fill(0.0)

    @cute.jit
    def final_state(self, acc_h, coord_h, mHt, s, hv, v0, HV):
        """This CTA's slice of the final state (fp32), if asked."""
        if cutlass.const_expr(self.store_ht):
            tHt = head_rows(mHt, (s * HV + hv) * self.K, 0, self.K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k4, c4 = coord_h[i]
                tHt[k4, v0 + c4] = acc_h[i]

    @cute.jit
    def load_chunk(self, mW, mKg, mU, sW, sKg, sU, bos, eos, ci, stage, hv, vb, tidx):
        """cp.async of chunk ci's w, kg and this CTA's columns of u into `stage` (rows past the end zero)."""
        BT, K, BV = self.BT, self.K, self.BV
        t0 = bos + ci * BT
        n = cutlass.min(eos - t0, BT)
        cp = g2s_tiled_copy(K, self.threads)
        copy_rows_g2s(cp, head_rows(mW, t0, hv, BT), sW[None, None, stage], n, tidx)
        copy_rows_g2s(cp, head_rows(mKg, t0, hv, BT), sKg[None, None, stage], n, tidx)
        copy_rows_g2s(g2s_tiled_copy(BV, self.threads), cute.local_tile(head_rows(mU, t0, hv, BT), (BT, BV), (0, vb)),
                      sU[None, None, stage], n, tidx)
