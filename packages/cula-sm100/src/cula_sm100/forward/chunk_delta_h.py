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
fp32 accumulation; transposed operands read with ldmatrix.trans. Pipeline (cp.async, rows past the end zero):
w and kg have one shared buffer each, refilled with chunk ci + 1's tile as soon as chunk ci's GEMM that reads
it is done (w after `w @ h`, kg after the state update), u has two stages and v_new takes u's place; G at
chunk ci + 1's last row is loaded during chunk ci. h and v_new leave from their bf16 shared tiles (the GEMM
operands) in 16-byte rows. Grid (V / BV, HV, N), V slices fastest so that the CTAs of one (sequence, head) run
together and read w and kg once from HBM; 48.5 KiB of shared memory and a 4-CTAs-per-SM launch bound (128
registers) so that N * HV * V / BV CTAs up to 528 run in one wave on an H100.
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
        # CTAs per SM the launch bound asks for (caps registers at 65536 / (128 x that)): 4 at BV = 32, 2 at 64
        self.MIN_CTAS = 4 if BV == 32 else 2

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
        # the V slices of one (sequence, head) are neighbouring CTAs: they run together and share w and kg in L2.
        # 48.5 KiB of shared memory and <= 128 registers (min_blocks_per_mp) let 4 CTAs share an SM, so the
        # N * HV * V / 32 CTAs of the common shapes run in one wave (each CTA walks its whole sequence)
        self.kernel(mW, mU, mKg, mG, mH0, mH, mVn, mHt, mS, HV).launch(
            grid=[V // self.BV, HV, N], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.MIN_CTAS, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
               mH: cute.Tensor, mVn: cute.Tensor, mHt: cute.Tensor, mS: cute.Tensor, HV: cutlass.Int32):
        K, BT, BV = self.K, self.BT, self.BV
        tidx, _, _ = cute.arch.thread_idx()
        vb, hv, s = cute.arch.block_idx()
        v0 = vb * BV
        bos = mS[s, 0]
        eos = mS[s, 1]
        first = mS[s, 2]
        nchunks = (eos - bos + BT - 1) // BT

        smem = cutlass.utils.SmemAllocator()
        # w and kg single-buffered, each refilled for chunk ci + 1 as soon as chunk ci's GEMM is done with it;
        # u in two stages; v_new replaces u in its stage (each element read and written by the same thread)
        sW = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)
        sKg = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)
        sU = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BV, 2), 128)
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_layout(K, BV), 128)
        sGl = smem.allocate_tensor(cutlass.Float32, cute.make_layout((K,)), 16)

        mma = make_tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc_h = cute.make_rmem_tensor(thr.partition_shape_C((K, BV)), cutlass.Float32)
        coord_h = thr.partition_C(cute.make_identity_tensor((K, BV)))
        acc_v = cute.make_rmem_tensor(thr.partition_shape_C((BT, BV)), cutlass.Float32)
        coord_v = thr.partition_C(cute.make_identity_tensor((BT, BV)))
        sH_part = thr.partition_C(sH)

        if cutlass.const_expr(self.has_h0):
            tH0 = head_rows(mH0, (s * HV + hv) * K, 0, K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k0, c0 = coord_h[i]
                acc_h[i] = tH0[k0, v0 + c0]
        else:
            acc_h.fill(0.0)

        gl = cutlass.Float32(0.0)  # G at the last row of the current chunk, channel tidx (loaded one chunk ahead)
        cp_k = g2s_tiled_copy(K, self.threads)
        if nchunks > 0:
            self.load_rows(cp_k, mW, sW, bos, eos, 0, hv)
            self.load_rows(cp_k, mKg, sKg, bos, eos, 0, hv)
            self.load_u(mU, sU, bos, eos, 0, 0, hv, vb, tidx)
            gl = head_rows(mG, bos, hv, BT)[cutlass.min(eos - bos, BT) - 1, tidx].to(cutlass.Float32)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(nchunks, unroll=1):
            stage = ci % 2
            t0 = bos + ci * BT
            n = cutlass.min(eos - t0, BT)
            more = ci + 1 < nchunks
            # cp.async groups: each chunk commits [u next], [w next], [kg next], in that order; waiting for all
            # but the newest group here leaves this chunk's w, kg and u landed
            if more:
                self.load_u(mU, sU, bos, eos, ci + 1, 1 - stage, hv, vb, tidx)
            cute.arch.cp_async_commit_group()
            sGl[tidx] = cute.math.exp(gl, fastmath=True)
            if more:  # the next chunk's last-row G: its latency hides behind this chunk's work
                gl = head_rows(mG, t0 + BT, hv, BT)[cutlass.min(eos - t0 - BT, BT) - 1, tidx].to(cutlass.Float32)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                sH_part[i] = acc_h[i].to(cutlass.BFloat16)
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()
            # h out in 16-byte rows (from the bf16 copy the GEMM reads)
            store_rows_s2g(sH, cute.local_tile(head_rows(mH, ((first + ci) * HV + hv) * K, 0, K), (K, BV), (0, vb)),
                           K, tidx, self.threads)

            sU_s = sU[None, None, stage]
            sU_part = thr.partition_C(sU_s)
            acc_v.fill(0.0)
            gemm_ss(mma, acc_v, sW, transposed(sH, K, BV), tidx, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, _ = coord_v[i]
                x = cutlass.Float32(0.0)
                if r2 < n:
                    x = sU_part[i].to(cutlass.Float32) - acc_v[i]
                sU_part[i] = x.to(cutlass.BFloat16)  # v_new, bf16 as FLA (GEMM operand and output)
            cute.arch.sync_threads()  # every warp is done with w; v_new is complete
            if more:
                self.load_rows(cp_k, mW, sW, bos, eos, ci + 1, hv)
            cute.arch.cp_async_commit_group()
            store_rows_s2g(sU_s, cute.local_tile(head_rows(mVn, t0, hv, BT), (BT, BV), (0, vb)), n, tidx, self.threads)

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * sGl[k3]
            gemm_ss(mma, acc_h, transposed(sKg, BT, K), transposed(sU_s, BT, BV), tidx, True, True)
            cute.arch.sync_threads()  # every warp is done with kg and v_new
            if more:
                self.load_rows(cp_k, mKg, sKg, bos, eos, ci + 1, hv)
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(self.store_ht):
            tHt = head_rows(mHt, (s * HV + hv) * K, 0, K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k4, c4 = coord_h[i]
                tHt[k4, v0 + c4] = acc_h[i]

    @cute.jit
    def load_rows(self, cp, m, s, bos, eos, ci, hv):
        """cp.async of chunk ci's [64, 128] tile of m (w or kg) into s (rows past the end zero)."""
        tidx, _, _ = cute.arch.thread_idx()
        t0 = bos + ci * self.BT
        copy_rows_g2s(cp, head_rows(m, t0, hv, self.BT), s, cutlass.min(eos - t0, self.BT), tidx)

    @cute.jit
    def load_u(self, mU, sU, bos, eos, ci, stage, hv, vb, tidx):
        """cp.async of this CTA's columns of chunk ci's u into `stage` (rows past the end zero)."""
        BT, BV = self.BT, self.BV
        t0 = bos + ci * BT
        copy_rows_g2s(g2s_tiled_copy(BV, self.threads), cute.local_tile(head_rows(mU, t0, hv, BT), (BT, BV), (0, vb)),
                      sU[None, None, stage], cutlass.min(eos - t0, BT), tidx)
