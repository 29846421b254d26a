"""chunk_delta_h, lean pipeline: the same recurrence as chunk_delta_h.py (read its docstring for the math and the
tiling), one (sequence, value head, BV = 32 columns of V) per CTA, with fewer bytes of shared memory per CTA
and a grid order that lets the V slices of one (sequence, head) share w and kg in L2.

Why (docs/sm100.md, measured on the H100 with the default pipeline): at 84.5 KiB and 168 registers the default
runs 2 CTAs per SM, so its N HV V/32 CTAs take 2 (HV = 64) or 4 (HV = 128) waves of whole-sequence
recurrences, and its grid (N, HV, V/BV) puts a (sequence, head)'s 4 V slices in different waves, each reading
w and kg from HBM. Here:
  * grid (V / BV, HV, N): the V slices are neighbouring CTAs, run together, and read w and kg once from HBM;
  * w and kg have one shared buffer each, refilled with chunk ci + 1's tile (cp.async, rows past the end
    zero) as soon as chunk ci's GEMM that reads it is done: w after `w @ h`, kg after the state update;
  * u has two stages, and v_new replaces u in its stage (each element is read and written by one thread);
  * 48.5 KiB of shared memory and a launch bound of 4 CTAs per SM (128 registers), so up to 528 CTAs run in
    one wave on an H100.
Status: compiled for sm_90a / sm_100a and checked on the CPU only; `tests/sm100/test_sm100_forward_gpu.py::
test_delta_h_lean_equals_default` compares it with the default (it should agree bitwise: the same operands
reach the same MMAs) and the benchmark times it as `delta_h[lean]`. Not on the live path until both ran.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from cula_sm100.forward.chunk_delta_h import ChunkDeltaH
from cula_sm100.forward.cute_utils import (copy_rows_g2s, g2s_tiled_copy, gemm_ss, head_rows, smem_layout,
                                          store_rows_s2g, transposed)


class ChunkDeltaHLean(ChunkDeltaH):
    MIN_CTAS = 4  # per SM: the launch bound caps registers at 65536 / (128 x 4) = 128

    def __init__(self, has_initial_state: bool, output_final_state: bool):
        super().__init__(has_initial_state, output_final_state, 32)

    @cute.jit
    def launch(self, args, N, HV, stream):
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
        sW = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)
        sKg = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)
        sU = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BV, 2), 128)  # u, then v_new in its place
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_layout(K, BV), 128)
        sGl = smem.allocate_tensor(cutlass.Float32, cute.make_layout((K,)), 16)

        mma, thr, acc_h, coord_h, acc_v, coord_v = self.fragments(tidx)
        sH_part = thr.partition_C(sH)
        self.init_state(acc_h, coord_h, mH0, s, hv, v0, HV)

        gl = cutlass.Float32(0.0)  # G at the last row of the current chunk, channel tidx (loaded one chunk ahead)
        cp_k = g2s_tiled_copy(K, self.threads)
        if nchunks > 0:
            self.load_rows(cp_k, mW, sW, bos, eos, 0, hv)
            self.load_rows(cp_k, mKg, sKg, bos, eos, 0, hv)
            self.load_u(mU, sU, bos, eos, 0, 0, hv, vb, tidx)
            gl = self.last_g(mG, bos, eos, hv, tidx)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(nchunks, unroll=1):
            stage = ci % 2
            more = ci + 1 < nchunks
            t0 = bos + ci * BT
            n = cutlass.min(eos - t0, BT)
            # cp.async groups: each chunk commits [u next], [w next], [kg next], in that order; waiting for all
            # but the newest group below leaves this chunk's w, kg and u landed
            if more:
                self.load_u(mU, sU, bos, eos, ci + 1, 1 - stage, hv, vb, tidx)
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
