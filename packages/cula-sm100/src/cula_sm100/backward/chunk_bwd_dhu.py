"""chunk_bwd_dhu: the reverse state recurrence of the backward, one (sequence, value head, slice of BV = 64 or 32
columns of V) per CTA. On the live path of the backward (launch.chunk_kda_backward); tests/sm100/test_backward_gpu.py
checks it against the PyTorch stage `tests/sm100/torch_stages.dhu` (test_chunk_bwd_dhu_matches_torch_stage) and
through the whole op.

For the chunks of the sequence from last to first (dh: gradient of the state at the END of the chunk, [K = 128,
BV] fp32 registers, starting from dht or zeros):

    dh_out[chunk] = dh                                        (bf16, for chunk_wy_dqkg)
    dv_tot = dv + kg @ dh                                     (bf16 out: total gradient of v_new)
    dh     = diag(exp(G_last)) dh + (scale q exp(G))^T @ do - w^T @ dv_tot

and dh0 = dh after the first chunk (fp32) if asked. FLA 0.6.0: `chunk_gated_delta_rule_bwd_dhu`.
BV (compile-time): the recurrence is serial over a sequence's chunks, so the grid N HV (V / BV) is all the
parallelism there is; with few (sequence, head) pairs BV = 32 doubles the CTAs (launch.dhu_slice_width picks).
GVA: q is read at head hv // (HV // HQK); everything else in HV space.

Tiling: 128 threads = 4 warps along M; kg @ dh is [64 x 128] @ [128 x BV], the two state updates
[128 x 64] @ [64 x BV], all mma.sync m16n8k16 (bf16 operands: dh, dv_tot and scale q e^G rounded as FLA; fp32
accumulation); token-major operands through ldmatrix.trans. Grid (V / BV, HV, N): the V slices of a (sequence,
head) are adjacent CTAs, so the q, kg, w and G tiles they all read come from HBM about once and from L2 after.

Pipeline. Every input tile has one shared-memory buffer, refilled by cp.async with the previous chunk's tile (the
next one the reverse walk needs, rows past the sequence end zero) as soon as this chunk's last reader of it is
done, so each load has most of a chunk's work to land in. A chunk's tiles arrive in three cp.async groups,
committed in this order: (1) G, (2) q, do, kg, (3) w, dv. Per chunk, in order:
  1. dh to shared memory as bf16 (the GEMM operand); wait for groups 1 and 2; dh out in 16-byte rows;
  2. q e^G scale in place (thread = channel), dh decayed by e^G_last in registers; then G is refilled (group 1 of
     the next chunk);
  3. dh += (scale q e^G)^T do and kg @ dh; wait for group 3; dv_tot = dv + kg @ dh in place of dv and out; then
     q, do and kg are refilled (group 2);
  4. dh -= w^T dv_tot (as -(-dh + w^T dv_tot): a sign flip is exact); then w and dv are refilled (group 3).
Shared memory: q, kg, w bf16 [64, 128] (16 KiB each), G fp32 [64, 128] (32 KiB), do and dv bf16 [64, BV], dh bf16
[128, BV]: 96 KiB at BV = 32, 112 KiB at 64, so two CTAs per SM either way.
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

    def __init__(self, has_dht: bool, want_dh0: bool, bv: int = 64):
        assert bv in (32, 64), bv
        self.has_dht = has_dht
        self.want_dh0 = want_dh0
        self.bv = bv

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kg_ptr: cute.Pointer, w_ptr: cute.Pointer, G_ptr: cute.Pointer,
                 do_ptr: cute.Pointer, dv_ptr: cute.Pointer, dht_ptr: cute.Pointer, dh_ptr: cute.Pointer,
                 dv2_ptr: cute.Pointer, dh0_ptr: cute.Pointer, seq_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, N: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        K, V = _K, _V
        hv_k = cute.make_layout((TT, HV, K), stride=(HV * K, K, 1))
        hv_v = cute.make_layout((TT, HV, V), stride=(HV * V, V, 1))
        state = cute.make_layout((N * HV * K, 1, V), stride=(V, V, 1))
        self.kernel(
            cute.make_tensor(q_ptr, cute.make_layout((TT, HQK, K), stride=(HQK * K, K, 1))),
            cute.make_tensor(kg_ptr, hv_k), cute.make_tensor(w_ptr, hv_k), cute.make_tensor(G_ptr, hv_k),
            cute.make_tensor(do_ptr, hv_v), cute.make_tensor(dv_ptr, hv_v), cute.make_tensor(dht_ptr, state),
            cute.make_tensor(dh_ptr, cute.make_layout((NC * HV * K, 1, V), stride=(V, V, 1))),
            cute.make_tensor(dv2_ptr, hv_v), cute.make_tensor(dh0_ptr, state),
            cute.make_tensor(seq_ptr, cute.make_layout((N, 3), stride=(3, 1))), HV, HV // HQK, scale,
        ).launch(grid=[V // self.bv, HV, N], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKg: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor, mDo: cute.Tensor,
               mDv: cute.Tensor, mDht: cute.Tensor, mDh: cute.Tensor, mDv2: cute.Tensor, mDh0: cute.Tensor,
               mS: cute.Tensor, HV: cutlass.Int32, group: cutlass.Int32, scale: cutlass.Float32):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        BV = self.bv
        tidx, _, _ = cute.arch.thread_idx()
        vb, hv, s = cute.arch.block_idx()  # V slices fastest: adjacent CTAs share every K-wide tile through L2
        hq = hv // group
        v0 = vb * BV
        bos = mS[s, 0]
        eos = mS[s, 1]
        first = mS[s, 2]
        nchunks = (eos - bos + _BT - 1) // _BT

        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)        # q, then scale q e^G in place
        sG = smem.allocate_tensor(f32, cute.make_layout((_BT, _K), stride=(_K, 1)), 128)
        sKg = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sW = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sDo = smem.allocate_tensor(bf16, smem_tile_layout(_BT, BV), 128)
        sDv = smem.allocate_tensor(bf16, smem_tile_layout(_BT, BV), 128)       # dv, then dv_tot in place
        sDh = smem.allocate_tensor(bf16, smem_tile_layout(_K, BV), 128)

        mma = tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc_h = cute.make_rmem_tensor(thr.partition_shape_C((_K, BV)), f32)
        coord_h = thr.partition_C(cute.make_identity_tensor((_K, BV)))
        acc_v = cute.make_rmem_tensor(thr.partition_shape_C((_BT, BV)), f32)
        coord_v = thr.partition_C(cute.make_identity_tensor((_BT, BV)))
        sDv_part = thr.partition_C(sDv)

        if cutlass.const_expr(self.has_dht):
            tHt = head_rows(mDht, (s * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k0, c0 = coord_h[i]
                acc_h[i] = tHt[k0, v0 + c0]
        else:
            acc_h.fill(0.0)

        cp_k = g2s_tiled_copy(_K, self.threads)
        cp_g = g2s_tiled_copy(_K, self.threads, f32)
        cp_v = g2s_tiled_copy(BV, self.threads)
        # the last chunk's tiles, in the three groups the loop waits for
        if nchunks > 0:
            t0 = bos + (nchunks - 1) * _BT
            n = eos - t0
            copy_rows_g2s(cp_g, head_rows(mG, t0, hv, _BT), sG, n, tidx)
            cute.arch.cp_async_commit_group()
            copy_rows_g2s(cp_k, head_rows(mQ, t0, hq, _BT), sQ, n, tidx)
            copy_rows_g2s(cp_v, head_rows(mDo, t0, hv, _BT, v0, BV), sDo, n, tidx)
            copy_rows_g2s(cp_k, head_rows(mKg, t0, hv, _BT), sKg, n, tidx)
            cute.arch.cp_async_commit_group()
            copy_rows_g2s(cp_k, head_rows(mW, t0, hv, _BT), sW, n, tidx)
            copy_rows_g2s(cp_v, head_rows(mDv, t0, hv, _BT, v0, BV), sDv, n, tidx)
            cute.arch.cp_async_commit_group()

        for step in cutlass.range(nchunks, unroll=1):
            ci = nchunks - 1 - step
            t0 = bos + ci * _BT
            n = cutlass.min(eos - t0, _BT)
            more = ci > 0
            tp = t0 - _BT                      # the previous chunk, next in the reverse walk: always _BT rows
            # 1. dh (gradient of this chunk's end state) to shared memory as bf16, and out
            store_acc_smem(mma, acc_h, sDh, tidx)
            cute.arch.cp_async_wait_group(1)   # G, q, do and kg landed (w and dv may still be in flight)
            cute.arch.sync_threads()
            store_rows_s2g(sDh, head_rows(mDh, ((first + ci) * HV + hv) * _K, 0, _K, v0, BV), _K, tidx, self.threads)

            # 2. scale q e^G in place (thread = channel; rows past the end are zero in q and G); dh decayed
            for r in cutlass.range_constexpr(_BT):
                e = cute.math.exp(sG[r, tidx], fastmath=True)
                sQ[r, tidx] = (sQ[r, tidx].to(f32) * e * scale).to(bf16)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * cute.math.exp(sG[n - 1, k3], fastmath=True)
            cute.arch.sync_threads()           # q e^G complete; every read of G done
            if more:
                copy_rows_g2s(cp_g, head_rows(mG, tp, hv, _BT), sG, _BT, tidx)
            cute.arch.cp_async_commit_group()

            # 3. dh += (scale q e^G)^T do; dv_tot = dv + kg @ dh (dh of step 1, in shared memory)
            gemm(mma, acc_h, transposed(sQ, _BT, _K), transposed(sDo, _BT, BV), tidx, True, True)
            acc_v.fill(0.0)
            gemm(mma, acc_v, sKg, transposed(sDh, _K, BV), tidx, False, True)
            cute.arch.cp_async_wait_group(1)   # w and dv landed (this thread's copies) ...
            cute.arch.sync_threads()           # ... and every thread's
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, _ = coord_v[i]
                x = f32(0.0)
                if r2 < n:
                    x = sDv_part[i].to(f32) + acc_v[i]
                sDv_part[i] = x.to(bf16)      # each element read and written by this thread only
            cute.arch.sync_threads()           # dv_tot complete; every read of q, do, kg done
            if more:
                copy_rows_g2s(cp_k, head_rows(mQ, tp, hq, _BT), sQ, _BT, tidx)
                copy_rows_g2s(cp_v, head_rows(mDo, tp, hv, _BT, v0, BV), sDo, _BT, tidx)
                copy_rows_g2s(cp_k, head_rows(mKg, tp, hv, _BT), sKg, _BT, tidx)
            cute.arch.cp_async_commit_group()
            store_rows_s2g(sDv, head_rows(mDv2, t0, hv, _BT, v0, BV), n, tidx, self.threads)

            # 4. dh -= w^T dv_tot, as -(-dh + w^T dv_tot) (negation is exact: the same sums as a subtraction)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                acc_h[i] = -acc_h[i]
            gemm(mma, acc_h, transposed(sW, _BT, _K), transposed(sDv, _BT, BV), tidx, True, True)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                acc_h[i] = -acc_h[i]
            cute.arch.sync_threads()           # every read of w, dv_tot and dh done
            if more:
                copy_rows_g2s(cp_k, head_rows(mW, tp, hv, _BT), sW, _BT, tidx)
                copy_rows_g2s(cp_v, head_rows(mDv, tp, hv, _BT, v0, BV), sDv, _BT, tidx)
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(self.want_dh0):
            tH0 = head_rows(mDh0, (s * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k4, c4 = coord_h[i]
                tH0[k4, v0 + c4] = acc_h[i]
