"""chunk_delta_h_o: chunk_delta_h and fwd_o fused (OPT-IN, CULA_SM100_FUSED_O=1; compiled only, never run on a GPU).

One (sequence, value head, BV = 32 columns of V) per CTA, as chunk_delta_h. For each chunk, in order (h: the state
[K = 128, BV] at the chunk start, fp32 registers):

    v_new = u - w @ h                                      (bf16 as FLA; kept in shared memory, never written)
    o     = scale * (q * exp(G)) @ h + Aqk @ v_new         (this CTA's BV columns of o, bf16)
    h     = diag(exp(G_last)) h + kg^T @ v_new

starting from initial_state (or zeros) and ending in final_state (fp32) if asked. Neither h [NC, HV, K, V] nor
v_new [TT, HV, V] is written: at B = 2, T = 8192, HV = 64 they are ~1.6 GB of HBM traffic between the two
kernels, which only the public forward (`launch.chunk_kda`, no intermediates kept) can drop; `launch.forward`
without `fused_o` (tests, benchmark stages) and the backward's recompute (backward/launch.py) keep the two kernels.

Numerics as the two kernels: h and v_new rounded to bf16 as GEMM operands, qg = q * exp(G) rounded to bf16 as
FLA, fp32 accumulation, Aqk already holds scale and the causal mask; o rounded to bf16 once.

Tiling: 128 threads (4 warps along M), mma.sync m16n8k16 as chunk_delta_h; GQA/GVA: q read at head hv // group.
Grid (V / BV, HV, N) as clusters of the 4 V slices, so w, kg, q, G and Aqk come from HBM once per chunk and the
three other slices hit L2. Each slice forms all K = 128 channels of its chunk's qg itself (q bf16 and G fp32 in
16 / 32-byte vectors from global memory, mostly L2) rather than reading a qg written by recompute_w_u: no extra
[TT, HV, K] tensor, and the live recompute_w_u stays as it is.

Shared memory, 52.5 KiB, launch bound 4 CTAs per SM (128 registers), the occupancy chunk_delta_h has: at
B = 2, HV = 64 the grid's 512 CTAs still fit one wave of an H100 (528 slots); 3 CTAs per SM (396 slots) would
make it 1.3 waves, which costs more than the 1.6 GB saves. What that takes, against chunk_delta_h's 48.5 KiB:
  * sKg [64, 128] holds kg, then (after the state update) the chunk's qg: kg's next-chunk load waits for the o
    GEMM (it is needed only after the next chunk's w @ h);
  * sU [64, 32] has ONE stage (chunk_delta_h: two): u, then v_new in its place; the next chunk's u is loaded once
    the o GEMM has read v_new, so its latency is covered by o's stores, the h tile and the other CTAs;
  * sH [128, 32]: h at the chunk start (the GEMM operand of w @ h and of qg @ h), then o's staging tile;
  * sA [64, 64] Aqk (+8 KiB), loaded with kg; sW and exp(G_last) as chunk_delta_h (w's next-chunk load right
    after w @ h, a whole chunk ahead).
Pipeline per chunk:
  h -> sH; wait all, sync; v_new = u - w @ h; sync; cp.async w next; state update (reads kg, v_new; o needs only
  the chunk-start h, which stays in sH); sync; qg into sKg; sync; o = scale qg @ h + Aqk @ v_new; sync;
  cp.async kg, Aqk, u next; o -> sH; sync; o out (16-byte rows); sync.
The state update comes first so the next chunk's recurrence never waits for the o work's loads; within the CTA
the o work still adds to each chunk's serial time (the other 3 CTAs per SM fill its gaps).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.chunk_delta_h import ChunkDeltaH
from cula_sm100.forward.cute_utils import (copy_rows_g2s, g2s_tiled_copy, gemm_ss, head_rows, smem_layout,
                                          store_acc_s, store_rows_s2g, token_layout, transposed, vec_copy)


class ChunkDeltaHO(ChunkDeltaH):
    """Tiling, sequence table, state load / store as ChunkDeltaH (inherited); the fused loop below."""
    MIN_CTAS = 4  # 52.5 KiB + 1 KiB reserved per CTA: 4 fit an SM's 228 KiB; 128 registers

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, w_ptr: cute.Pointer, u_ptr: cute.Pointer, kg_ptr: cute.Pointer,
                 G_ptr: cute.Pointer, Aqk_ptr: cute.Pointer, h0_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 ht_ptr: cute.Pointer, seq_ptr: cute.Pointer, TT: cutlass.Int32, N: cutlass.Int32,
                 HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32, stream: cuda.CUstream):
        K, V, BT = self.K, self.V, self.BT
        hv_k = token_layout(TT, HV, K)
        hv_v = token_layout(TT, HV, V)
        mQ = cute.make_tensor(q_ptr, token_layout(TT, HQK, K))
        mW = cute.make_tensor(w_ptr, hv_k)
        mU = cute.make_tensor(u_ptr, hv_v)
        mKg = cute.make_tensor(kg_ptr, hv_k)
        mG = cute.make_tensor(G_ptr, hv_k)
        mA = cute.make_tensor(Aqk_ptr, token_layout(TT, HV, BT))
        mO = cute.make_tensor(o_ptr, hv_v)
        state = cute.make_layout((N * HV * K, 1, V), stride=(V, V, 1))
        mH0 = cute.make_tensor(h0_ptr, state)
        mHt = cute.make_tensor(ht_ptr, state)
        mS = cute.make_tensor(seq_ptr, cute.make_layout((N, 3), stride=(3, 1)))
        self.launch((mQ, mW, mU, mKg, mG, mA, mH0, mO, mHt, mS, HV, HV // HQK, scale), N, HV, stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mG: cute.Tensor,
               mA: cute.Tensor, mH0: cute.Tensor, mO: cute.Tensor, mHt: cute.Tensor, mS: cute.Tensor,
               HV: cutlass.Int32, group: cutlass.Int32, scale: cutlass.Float32):
        vb, hv, s = cute.arch.block_idx()  # V slices fastest: the 4 slices of a (sequence, head) are one cluster
        bos, eos, _, nchunks = self.sequence(mS, s)
        tidx, _, _ = cute.arch.thread_idx()
        K, BT, BV = self.K, self.BT, self.BV
        v0 = vb * BV
        hq = hv // group

        smem = cutlass.utils.SmemAllocator()
        sW = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)
        sKg = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, K), 128)  # kg, then qg of the same chunk
        sU = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BV), 128)  # u, then v_new in its place
        sH = smem.allocate_tensor(cutlass.BFloat16, smem_layout(K, BV), 128)  # h (chunk start), then o staged
        sO = cute.local_tile(sH, (BT, BV), (0, 0))
        sA = smem.allocate_tensor(cutlass.BFloat16, smem_layout(BT, BT), 128)
        sGl = smem.allocate_tensor(cutlass.Float32, cute.make_layout((K,)), 16)

        mma, thr, acc_h, coord_h, acc_v, coord_v = self.fragments(tidx)
        sH_part = thr.partition_C(sH)
        sU_part = thr.partition_C(sU)
        acc_o = cute.make_rmem_tensor(thr.partition_shape_C((BT, BV)), cutlass.Float32)
        self.init_state(acc_h, coord_h, mH0, s, hv, v0, HV)

        gl = cutlass.Float32(0.0)  # G at the last row of the current chunk, channel tidx (loaded one chunk ahead)
        cp_k = g2s_tiled_copy(K, self.threads)
        if nchunks > 0:
            self.load_rows(cp_k, mW, sW, bos, eos, 0, hv)
            self.load_rows(cp_k, mKg, sKg, bos, eos, 0, hv)
            self.load_aqk(mA, sA, bos, eos, 0, hv, tidx)
            self.load_u1(mU, sU, bos, eos, 0, hv, vb, tidx)
            gl = self.last_g(mG, bos, eos, hv, tidx)
        cute.arch.cp_async_commit_group()
        for ci in cutlass.range(nchunks, unroll=1):
            more = ci + 1 < nchunks
            t0 = bos + ci * BT
            n = cutlass.min(eos - t0, BT)
            sGl[tidx] = cute.math.exp(gl, fastmath=True)
            if more:  # the next chunk's last-row G: its latency hides behind this chunk's work
                gl = self.last_g(mG, t0 + BT, eos, hv, tidx)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                sH_part[i] = acc_h[i].to(cutlass.BFloat16)
            # every copy in flight is this chunk's (w from the previous chunk's middle, kg / Aqk / u from its end)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            acc_v.fill(0.0)
            gemm_ss(mma, acc_v, sW, transposed(sH, K, BV), tidx, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, _ = coord_v[i]
                x = cutlass.Float32(0.0)
                if r2 < n:
                    x = sU_part[i].to(cutlass.Float32) - acc_v[i]
                sU_part[i] = x.to(cutlass.BFloat16)  # v_new, bf16 as FLA (the GEMM operand); rows past n zero
            cute.arch.sync_threads()  # every warp is done with w; v_new is complete
            if more:
                self.load_rows(cp_k, mW, sW, bos, eos, ci + 1, hv)
            cute.arch.cp_async_commit_group()

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * sGl[k3]
            gemm_ss(mma, acc_h, transposed(sKg, BT, K), transposed(sU, BT, BV), tidx, True, True)
            cute.arch.sync_threads()  # every warp is done with kg

            self.form_qg(mQ, mG, sKg, t0, n, hq, hv, tidx)
            cute.arch.sync_threads()  # qg complete

            acc_o.fill(0.0)
            gemm_ss(mma, acc_o, sKg, transposed(sH, K, BV), tidx, False, True)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = acc_o[i] * scale
            gemm_ss(mma, acc_o, sA, transposed(sU, BT, BV), tidx, False, True)
            cute.arch.sync_threads()  # every warp is done with qg, Aqk, v_new and h
            if more:
                self.load_rows(cp_k, mKg, sKg, bos, eos, ci + 1, hv)
                self.load_aqk(mA, sA, bos, eos, ci + 1, hv, tidx)
                self.load_u1(mU, sU, bos, eos, ci + 1, hv, vb, tidx)
            cute.arch.cp_async_commit_group()
            # o staged in h's tile (its first 64 rows: the same swizzle as a [64, 32] tile), then out in 16-byte rows
            # (rows past n not stored); the closing barrier frees sH for the next chunk's h
            store_acc_s(mma, acc_o, sO, tidx)
            cute.arch.sync_threads()
            store_rows_s2g(sO, cute.local_tile(head_rows(mO, t0, hv, BT), (BT, BV), (0, vb)), n, tidx, self.threads)
            cute.arch.sync_threads()

        self.final_state(acc_h, coord_h, mHt, s, hv, v0, HV)

    @cute.jit
    def load_u1(self, mU, sU, bos, eos, ci, hv, vb, tidx):
        """cp.async of this CTA's columns of chunk ci's u into the one-stage sU (rows past the end zero)."""
        BT, BV = self.BT, self.BV
        t0 = bos + ci * BT
        copy_rows_g2s(g2s_tiled_copy(BV, self.threads), cute.local_tile(head_rows(mU, t0, hv, BT), (BT, BV), (0, vb)),
                       sU, cutlass.min(eos - t0, BT), tidx)

    @cute.jit
    def load_aqk(self, mA, sA, bos, eos, ci, hv, tidx):
        """cp.async of chunk ci's Aqk [64, 64] (rows past the end zero)."""
        BT = self.BT
        t0 = bos + ci * BT
        copy_rows_g2s(g2s_tiled_copy(BT, self.threads), head_rows(mA, t0, hv, BT), sA, cutlass.min(eos - t0, BT),
                      tidx)

    @cute.jit
    def form_qg(self, mQ, mG, sQg, t0, n, hq, hv, tidx):
        """sQg[r, :] = bf16(q[t0 + r, hq, :] * exp(G[t0 + r, hv, :])) for rows r < n, 8 channels per thread:
        q in 16-byte and G in two 16-byte vectors straight from global memory (the cluster's first slice brings
        them into L2). Rows past n keep kg's zero padding (their o rows are never stored)."""
        K, BT = self.K, self.BT
        vb = vec_copy(K, self.threads)
        vf = vec_copy(K, self.threads, cutlass.Float32)
        tb = vb.get_slice(tidx)
        pQ = tb.partition_S(head_rows(mQ, t0, hq, BT))
        pG = vf.get_slice(tidx).partition_S(head_rows(mG, t0, hv, BT))
        pD = tb.partition_D(sQg)
        coord = tb.partition_S(cute.make_identity_tensor((BT, K)))
        fq = cute.make_fragment_like(pQ[None, 0, None])
        fg = cute.make_fragment_like(pG[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(pQ.shape[1])):
            if coord[0, m, 0][0] < n:
                cute.copy(vb, pQ[None, m, None], fq)
                cute.copy(vf, pG[None, m, None], fg)
                for e in cutlass.range_constexpr(8):
                    fq[e] = (fq[e].to(cutlass.Float32) * cute.math.exp(fg[e].to(cutlass.Float32), fastmath=True)
                             ).to(cutlass.BFloat16)
                cute.copy(vb, fq, pD[None, m, None])
