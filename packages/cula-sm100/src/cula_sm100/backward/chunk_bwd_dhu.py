"""chunk_bwd_dhu: the reverse state recurrence of the backward, one (sequence, value head, slice of BV = 64 or 32
columns of V) per CTA. On the live path of the backward (launch.chunk_kda_backward); tests/sm100/test_backward_gpu.py
checks it against the PyTorch stage `tests/sm100/torch_stages.dhu` (test_chunk_bwd_dhu_matches_torch_stage) and
through the whole op.

For the chunks of the sequence from last to first (dh: gradient of the state at the END of the chunk, [K = 128,
BV] fp32 registers, starting from dht or zeros):

    dh_out[chunk] = dh                                        (bf16, for chunk_wy_dqkg)
    dv_tot = dv + kg @ dh                                     (bf16 out: total gradient of v_new)
    dh     = diag(exp(G_last)) dh + qg^T @ do - w^T @ dv_tot

and dh0 = dh after the first chunk (fp32) if asked. qg = bf16(q exp(G) scale) per value head comes precomputed
(cula_sm100.forward.launch.gate_cumsum_qg, as FLA rounds it), so the serial walk does no per-token exponentials;
of G it reads one row per chunk, the last (the chunk's decay). FLA 0.6.0: `chunk_gated_delta_rule_bwd_dhu`.
BV (compile-time): the recurrence is serial over a sequence's chunks, so the grid N HV (V / BV) is all the
parallelism there is; with few (sequence, head) pairs BV = 32 doubles the CTAs (launch.dhu_slice_width picks).

Tiling: 128 threads = 4 warps along M; kg @ dh is [64 x 128] @ [128 x BV], the two state updates
[128 x 64] @ [64 x BV], all mma.sync m16n8k16 (bf16 operands: dh and dv_tot rounded as FLA; fp32 accumulation);
token-major operands through ldmatrix.trans. Grid (V / BV, HV, N): the V slices of a (sequence, head) are adjacent
CTAs, so the qg, kg and w tiles they all read come from HBM about once and from L2 after.

Pipeline (`stages`, compile-time). A chunk's input tiles come in two cp.async groups: A = qg, do, kg (read by the
first two products), B = w, dv (read by dv_tot and the last product); the next chunk's last-row G is read into a
register a chunk ahead. With 2 stages (forward.launch.walk_stages: when the grid fits the SMs at one CTA each,
the walk is latency-bound), every tile has two buffers and the previous chunk's groups are issued when a chunk
starts, so their loads have a whole chunk of work to land in. With 1 stage (many CTAs, two or three per SM hide
each other's latency), group A is refilled once the first two products are done and group B at the chunk's end.
Per chunk:
  1. dh to shared memory as bf16 (the GEMM operand); this chunk's group A landed; dh out in 16-byte rows;
  2. dh decayed by e^G_last in registers; dh += qg^T do; kg @ dh;
  3. group B landed; dv_tot = dv + kg @ dh in place of dv, and out;
  4. dh -= w^T dv_tot (as -(-dh + w^T dv_tot): a sign flip is exact).
Shared memory per stage: qg, kg, w bf16 [64, 128] (16 KiB each), do and dv bf16 [64, BV]; plus dh bf16 [128, BV]
and G_last [128] fp32 once: 1 stage 65 KiB (BV = 32) / 81 KiB (64), two or three CTAs per SM; 2 stages 121 / 145
KiB, one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, store_acc_smem, tiled_mma, transposed

# tile sizes as module constants (and BV read from self): names bound inside the kernel's runtime loop would be
# traced as dynamic
_BT, _K, _V = 64, 128, 128


class ChunkBwdDhu:
    threads = 128

    def __init__(self, has_dht: bool, want_dh0: bool, bv: int = 64, stages: int = 1):
        assert bv in (32, 64), bv
        assert stages in (1, 2), stages
        self.has_dht = has_dht
        self.want_dh0 = want_dh0
        self.bv = bv
        self.stages = stages

    @cute.jit
    def __call__(self, qg_ptr: cute.Pointer, kg_ptr: cute.Pointer, w_ptr: cute.Pointer, G_ptr: cute.Pointer,
                 do_ptr: cute.Pointer, dv_ptr: cute.Pointer, dht_ptr: cute.Pointer, dh_ptr: cute.Pointer,
                 dv2_ptr: cute.Pointer, dh0_ptr: cute.Pointer, seq_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, N: cutlass.Int32, HV: cutlass.Int32, stream: cuda.CUstream):
        K, V = _K, _V
        hv_k = cute.make_layout((TT, HV, K), stride=(HV * K, K, 1))
        hv_v = cute.make_layout((TT, HV, V), stride=(HV * V, V, 1))
        state = cute.make_layout((N * HV * K, 1, V), stride=(V, V, 1))
        self.kernel(
            cute.make_tensor(qg_ptr, hv_k), cute.make_tensor(kg_ptr, hv_k), cute.make_tensor(w_ptr, hv_k),
            cute.make_tensor(G_ptr, hv_k), cute.make_tensor(do_ptr, hv_v), cute.make_tensor(dv_ptr, hv_v),
            cute.make_tensor(dht_ptr, state),
            cute.make_tensor(dh_ptr, cute.make_layout((NC * HV * K, 1, V), stride=(V, V, 1))),
            cute.make_tensor(dv2_ptr, hv_v), cute.make_tensor(dh0_ptr, state),
            cute.make_tensor(seq_ptr, cute.make_layout((N, 3), stride=(3, 1))), HV,
        ).launch(grid=[V // self.bv, HV, N], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQg: cute.Tensor, mKg: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor, mDo: cute.Tensor,
               mDv: cute.Tensor, mDht: cute.Tensor, mDh: cute.Tensor, mDv2: cute.Tensor, mDh0: cute.Tensor,
               mS: cute.Tensor, HV: cutlass.Int32):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        BV, S = self.bv, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        vb, hv, s = cute.arch.block_idx()  # V slices fastest: adjacent CTAs share every K-wide tile through L2
        v0 = vb * BV
        bos = mS[s, 0]
        eos = mS[s, 1]
        first = mS[s, 2]
        nchunks = (eos - bos + _BT - 1) // _BT

        smem = cutlass.utils.SmemAllocator()
        sQg = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K, S), 128)
        sKg = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K, S), 128)
        sW = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K, S), 128)
        sDo = smem.allocate_tensor(bf16, smem_tile_layout(_BT, BV, S), 128)
        sDv = smem.allocate_tensor(bf16, smem_tile_layout(_BT, BV, S), 128)   # dv, then dv_tot in place
        sDh = smem.allocate_tensor(bf16, smem_tile_layout(_K, BV), 128)
        sGl = smem.allocate_tensor(f32, cute.make_layout((_K,)), 16)         # e^G at the chunk's last row

        mma = tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc_h = cute.make_rmem_tensor(thr.partition_shape_C((_K, BV)), f32)
        coord_h = thr.partition_C(cute.make_identity_tensor((_K, BV)))
        acc_v = cute.make_rmem_tensor(thr.partition_shape_C((_BT, BV)), f32)
        coord_v = thr.partition_C(cute.make_identity_tensor((_BT, BV)))

        if cutlass.const_expr(self.has_dht):
            tHt = head_rows(mDht, (s * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k0, c0 = coord_h[i]
                acc_h[i] = tHt[k0, v0 + c0]
        else:
            acc_h.fill(0.0)

        cp_k = g2s_tiled_copy(_K, self.threads)
        cp_v = g2s_tiled_copy(BV, self.threads)
        gl = f32(0.0)  # G at the last row of the chunk the walk takes next, channel tidx
        # the last chunk's tiles into stage 0, in the two groups
        if nchunks > 0:
            t0 = bos + (nchunks - 1) * _BT
            n = eos - t0
            self.load_a(cp_k, cp_v, mQg, mDo, mKg, sQg, sDo, sKg, t0, n, hv, v0, 0, tidx)
            cute.arch.cp_async_commit_group()
            self.load_b(cp_k, cp_v, mW, mDv, sW, sDv, t0, n, hv, v0, 0, tidx)
            cute.arch.cp_async_commit_group()
            gl = head_rows(mG, t0 + n - 1, hv, 1)[0, tidx]

        for step in cutlass.range(nchunks, unroll=1):
            ci = nchunks - 1 - step
            st = step % S
            t0 = bos + ci * _BT
            n = cutlass.min(eos - t0, _BT)
            more = ci > 0
            tp = t0 - _BT                      # the previous chunk, next in the reverse walk: always _BT rows
            if cutlass.const_expr(S == 2):     # the previous chunk's tiles into the other stage, now
                if more:
                    self.load_a(cp_k, cp_v, mQg, mDo, mKg, sQg, sDo, sKg, tp, _BT, hv, v0, 1 - st, tidx)
                cute.arch.cp_async_commit_group()
                if more:
                    self.load_b(cp_k, cp_v, mW, mDv, sW, sDv, tp, _BT, hv, v0, 1 - st, tidx)
                cute.arch.cp_async_commit_group()
            sGl[tidx] = cute.math.exp(gl, fastmath=True)
            if more:  # the previous chunk's last-row G: its latency hides behind this chunk's work
                gl = head_rows(mG, t0 - 1, hv, 1)[0, tidx]
            sQg_s, sKg_s, sW_s = sQg[None, None, st], sKg[None, None, st], sW[None, None, st]
            sDo_s, sDv_s = sDo[None, None, st], sDv[None, None, st]

            # 1. dh (gradient of this chunk's end state) to shared memory as bf16, and out
            store_acc_smem(mma, acc_h, sDh, tidx)
            cute.arch.cp_async_wait_group(2 if S == 2 else 1)   # this chunk's group A landed (this thread's) ...
            cute.arch.sync_threads()                             # ... and every thread's; dh and e^G_last complete
            store_rows_s2g(sDh, head_rows(mDh, ((first + ci) * HV + hv) * _K, 0, _K, v0, BV), _K, tidx, self.threads)

            # 2. dh decayed; dh += qg^T do; kg @ dh (dh of step 1, in shared memory)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * sGl[k3]
            gemm(mma, acc_h, transposed(sQg_s, _BT, _K), transposed(sDo_s, _BT, BV), tidx, True, True)
            acc_v.fill(0.0)
            gemm(mma, acc_v, sKg_s, transposed(sDh, _K, BV), tidx, False, True)

            # 3. dv_tot = dv + kg @ dh in place of dv, and out (2 stages: group B landed with A, at step 1)
            if cutlass.const_expr(S == 1):
                cute.arch.cp_async_wait_group(0)   # group B landed (this thread's copies) ...
                cute.arch.sync_threads()           # ... and every thread's; every read of qg, do, kg, dh, e^G done
                if more:
                    self.load_a(cp_k, cp_v, mQg, mDo, mKg, sQg, sDo, sKg, tp, _BT, hv, v0, 0, tidx)
                cute.arch.cp_async_commit_group()
            sDv_part = thr.partition_C(sDv_s)
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, _ = coord_v[i]
                x = f32(0.0)
                if r2 < n:
                    x = sDv_part[i].to(f32) + acc_v[i]
                sDv_part[i] = x.to(bf16)          # each element read and written by this thread only
            cute.arch.sync_threads()               # dv_tot complete
            store_rows_s2g(sDv_s, head_rows(mDv2, t0, hv, _BT, v0, BV), n, tidx, self.threads)

            # 4. dh -= w^T dv_tot, as -(-dh + w^T dv_tot) (negation is exact: the same sums as a subtraction)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                acc_h[i] = -acc_h[i]
            gemm(mma, acc_h, transposed(sW_s, _BT, _K), transposed(sDv_s, _BT, BV), tidx, True, True)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                acc_h[i] = -acc_h[i]
            cute.arch.sync_threads()               # every read of w and dv_tot done: the stage may be refilled
            if cutlass.const_expr(S == 1):
                if more:
                    self.load_b(cp_k, cp_v, mW, mDv, sW, sDv, tp, _BT, hv, v0, 0, tidx)
                cute.arch.cp_async_commit_group()

        if cutlass.const_expr(self.want_dh0):
            tH0 = head_rows(mDh0, (s * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k4, c4 = coord_h[i]
                tH0[k4, v0 + c4] = acc_h[i]

    @cute.jit
    def load_a(self, cp_k, cp_v, mQg, mDo, mKg, sQg, sDo, sKg, t0, n, hv, v0, st, tidx):
        """cp.async of group A (qg, do, kg) of the chunk at token t0 (n rows; the rest zero) into stage st."""
        copy_rows_g2s(cp_k, head_rows(mQg, t0, hv, _BT), sQg[None, None, st], n, tidx)
        copy_rows_g2s(cp_v, head_rows(mDo, t0, hv, _BT, v0, self.bv), sDo[None, None, st], n, tidx)
        copy_rows_g2s(cp_k, head_rows(mKg, t0, hv, _BT), sKg[None, None, st], n, tidx)

    @cute.jit
    def load_b(self, cp_k, cp_v, mW, mDv, sW, sDv, t0, n, hv, v0, st, tidx):
        """cp.async of group B (w, dv) of the chunk at token t0 (n rows; the rest zero) into stage st."""
        copy_rows_g2s(cp_k, head_rows(mW, t0, hv, _BT), sW[None, None, st], n, tidx)
        copy_rows_g2s(cp_v, head_rows(mDv, t0, hv, _BT, v0, self.bv), sDv[None, None, st], n, tidx)
