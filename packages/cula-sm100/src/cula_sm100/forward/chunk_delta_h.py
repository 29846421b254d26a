"""chunk_delta_h: the inter-chunk state recurrence, one (sequence, value head, BV = 32 columns of V) per CTA.

For each chunk of the sequence, in order (h: the state [K = 128, BV] at the chunk start, fp32 registers):

    h_out[chunk] = h                                  (saved, bf16 as FLA, for fwd_o and the backward)
    v_new = u - w @ h                                 (bf16 out)
    h     = diag(exp(G_last)) h + kg^T @ v_new

starting from initial_state (or zeros) and ending in final_state (fp32) if asked. Sequences come from the
sequence table (first token, end, first global chunk), so varlen and empty sequences need nothing more.

Tiling: 128 threads (4 warps along M); `w @ h` is [64 x 128] @ [128 x 32] and `kg^T @ v_new` is
[128 x 64] @ [64 x 32], both mma.sync m16n8k16 with bf16 operands (h and v_new rounded to bf16 as FLA) and
fp32 accumulation; transposed operands read with ldmatrix.trans.
Grid (V / BV, HV, N), launched as clusters of the 4 V slices of one (sequence, head): the hardware starts them
together in every wave, so they walk the chunks in step, w and kg come from HBM once and the other three slices
hit L2. (Without clusters the slices drift apart in later waves and the time grows super-linearly with the number
of waves; below launch.DELTA_H_CLUSTER_MIN_PAIRS pairs plain CTAs are faster: docs/benchmarks/train_fwd.md.)
Pipeline, 48.5 KiB of shared memory and a launch bound of 4 CTAs per SM (128 registers), so 528 CTAs run at
once on an H100's 132 SMs (N HV 4 CTAs: one wave at B = 2, HV = 64; see docs/sm100.md for HV >= 128):
  * w and kg have one buffer each (`stages` = 1), refilled by cp.async with chunk ci + 1's tile (rows past the end
    zero) as soon as chunk ci's GEMM that reads it is done: w after `w @ h`, kg after the state update;
  * u has two stages, and v_new replaces u in its stage (each element is read and written by one thread);
  * G at chunk ci + 1's last row is loaded during chunk ci;
  * h and v_new leave from their bf16 shared tiles (the GEMM operands) in 16-byte rows.
(Chosen over double-buffered w / kg / u at 2 CTAs per SM by measurement where several CTAs share an SM:
docs/sm100.md.) `stages` = 2 (launch.walk_stages: when the grid fits the SMs, no cluster): w and kg get two
buffers too, and chunk ci + 1's w, kg and u are all issued when chunk ci starts, so each chunk's loads have a
whole chunk of work to land in; 80.5 KiB of shared memory. A CTA alone on its SM has nobody to hide its load
latency behind, and that latency is then the walk's time.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, tiled_mma, transposed
from cula_sm100.forward.cute_utils import token_layout


class ChunkDeltaH:
    BT = 64
    K = 128
    V = 128
    BV = 32  # columns of V per CTA: 4 CTAs per (sequence, head), sharing w and kg through L2
    threads = 128
    MIN_CTAS = 4  # per SM: the launch bound caps registers at 65536 / (128 x 4) = 128

    def __init__(self, has_initial_state: bool, output_final_state: bool, cluster: bool = True, stages: int = 1):
        assert stages in (1, 2) and not (cluster and stages == 2), (cluster, stages)
        self.stages = stages
        self.has_h0 = has_initial_state
        self.store_ht = output_final_state
        # the 4 V slices of a (sequence, head) as one thread-block cluster: launched together in every wave, so
        # they stay in step and share w / kg through L2 (see the module docstring)
        self.cluster = cluster

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
        if cutlass.const_expr(self.cluster):
            self.kernel(*args).launch(grid=[self.V // self.BV, HV, N], block=[self.threads, 1, 1], stream=stream,
                                      cluster=[self.V // self.BV, 1, 1], min_blocks_per_mp=self.MIN_CTAS,
                                      preferred_smem_carveout=100)
        else:
            self.kernel(*args).launch(grid=[self.V // self.BV, HV, N], block=[self.threads, 1, 1], stream=stream,
                                      min_blocks_per_mp=self.MIN_CTAS, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mG: cute.Tensor, mH0: cute.Tensor,
               mH: cute.Tensor, mVn: cute.Tensor, mHt: cute.Tensor, mS: cute.Tensor, HV: cutlass.Int32):
        vb, hv, s = cute.arch.block_idx()  # V slices fastest (see launch)
        bos, eos, first, nchunks = self.sequence(mS, s)
        tidx, _, _ = cute.arch.thread_idx()
        K, BT, BV = self.K, self.BT, self.BV
        v0 = vb * BV

        smem = cutlass.utils.SmemAllocator()
        S = self.stages
        sW = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K, S), 128)
        sKg = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, K, S), 128)
        sU = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(BT, BV, 2), 128)  # u, then v_new in its place
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_tile_layout(K, BV), 128)
        sGl = smem.allocate_tensor(cutlass.Float32, cute.make_layout((K,)), 16)

        mma, thr, acc_h, coord_h, acc_v, coord_v = self.fragments(tidx)
        sH_part = thr.partition_C(sH)
        self.init_state(acc_h, coord_h, mH0, s, hv, v0, HV)

        gl = cutlass.Float32(0.0)  # G at the last row of the current chunk, channel tidx (loaded one chunk ahead)
        cp_k = g2s_tiled_copy(K, self.threads)
        if nchunks > 0:
            self.load_rows(cp_k, mW, sW[None, None, 0], bos, eos, 0, hv)
            self.load_rows(cp_k, mKg, sKg[None, None, 0], bos, eos, 0, hv)
            self.load_u(mU, sU, bos, eos, 0, 0, hv, vb, tidx)
            gl = self.last_g(mG, bos, eos, hv, tidx)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(nchunks, unroll=1):
            stage = ci % 2
            more = ci + 1 < nchunks
            t0 = bos + ci * BT
            n = cutlass.min(eos - t0, BT)
            # cp.async groups: each chunk commits [u next], [w next], [kg next] (1 stage) or [u, w, kg next]
            # (2 stages); waiting for all but the newest group below leaves this chunk's w, kg and u landed
            wst = stage if S == 2 else 0      # the stage of w and kg
            sW_s, sKg_s = sW[None, None, wst], sKg[None, None, wst]
            if more:
                self.load_u(mU, sU, bos, eos, ci + 1, 1 - stage, hv, vb, tidx)
                if cutlass.const_expr(S == 2):
                    self.load_rows(cp_k, mW, sW[None, None, 1 - stage], bos, eos, ci + 1, hv)
                    self.load_rows(cp_k, mKg, sKg[None, None, 1 - stage], bos, eos, ci + 1, hv)
            cute.arch.cp_async_commit_group()
            sGl[tidx] = cute.math.exp(gl, fastmath=True)
            if more:  # the next chunk's last-row G: its latency hides behind this chunk's work
                gl = self.last_g(mG, t0 + BT, eos, hv, tidx)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                sH_part[i] = acc_h[i].to(cutlass.BFloat16)
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()
            store_rows_s2g(sH, cute.local_tile(head_rows(mH, ((first + ci) * HV + hv) * K, 0, K), (K, BV), (0, vb)),
                           K, tidx, self.threads)

            sU_s = sU[None, None, stage]
            sU_part = thr.partition_C(sU_s)
            acc_v.fill(0.0)
            gemm(mma, acc_v, sW_s, transposed(sH, K, BV), tidx, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, _ = coord_v[i]
                x = cutlass.Float32(0.0)
                if r2 < n:
                    x = sU_part[i].to(cutlass.Float32) - acc_v[i]
                sU_part[i] = x.to(cutlass.BFloat16)  # v_new, bf16 as FLA (GEMM operand and output)
            cute.arch.sync_threads()  # every warp is done with w; v_new is complete
            if cutlass.const_expr(S == 1):
                if more:
                    self.load_rows(cp_k, mW, sW_s, bos, eos, ci + 1, hv)
                cute.arch.cp_async_commit_group()
            store_rows_s2g(sU_s, cute.local_tile(head_rows(mVn, t0, hv, BT), (BT, BV), (0, vb)), n, tidx, self.threads)

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * sGl[k3]
            gemm(mma, acc_h, transposed(sKg_s, BT, K), transposed(sU_s, BT, BV), tidx, True, True)
            cute.arch.sync_threads()  # every warp is done with kg and v_new
            if cutlass.const_expr(S == 1):
                if more:
                    self.load_rows(cp_k, mKg, sKg_s, bos, eos, ci + 1, hv)
                cute.arch.cp_async_commit_group()

        self.final_state(acc_h, coord_h, mHt, s, hv, v0, HV)

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
        mma = tiled_mma(4)
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
