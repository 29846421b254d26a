"""chunk_bwd_dhu: the reverse state recurrence of the backward, one (sequence, value head, slice of BV = 64 or 32
columns of V) per CTA. On the live path of the backward (launch.chunk_kda_backward); tests/sm100/test_backward_gpu.py
checks it against the PyTorch stage `tests/sm100/torch_stages.dhu` (test_chunk_bwd_dhu_matches_torch_stage) and through the
whole op.

For the chunks of the sequence from last to first (dh: gradient of the state at the END of the chunk, [K = 128,
64] fp32 registers, starting from dht or zeros):

    dh_out[chunk] = dh                                        (bf16, for chunk_wy_dqkg)
    dv_tot = dv + kg @ dh                                     (bf16 out: total gradient of v_new)
    dh     = diag(exp(G_last)) dh + (scale q exp(G))^T @ do - w^T @ dv_tot

and dh0 = dh after the first chunk (fp32) if asked. FLA 0.6.0: `chunk_gated_delta_rule_bwd_dhu`.
BV (compile-time): the recurrence is serial over a sequence's chunks, so the grid N HV (V / BV) is all the
parallelism there is; with few (sequence, head) pairs BV = 32 doubles the CTAs (launch.dhu_slice_width picks),
each CTA still loading kg, w and q whole. Shared memory ~80 KiB at BV = 64, ~64 KiB at 32.
GVA: q is read at head hv // (HV // HQK); everything else in HV space.
Tiling: 128 threads = 4 warps along M; kg @ dh is [64 x 128] @ [128 x 64], the two state updates
[128 x 64] @ [64 x 64], all mma.sync m16n8k16 (bf16 operands: dh, dv_tot and scale q e^G rounded as FLA; fp32
accumulation); token-major operands through ldmatrix.trans. Pipeline per chunk: cp.async kg, w, q (full K) and
the do / dv column slices (rows past the chunk end zero), q e^G scale in place (thread = channel), GEMMs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows
from cula_core.cute_kernels.warp_mma import gemm, smem_tile_layout, tiled_mma, transposed

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
        ).launch(grid=[N, HV, V // self.bv], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKg: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor, mDo: cute.Tensor,
               mDv: cute.Tensor, mDht: cute.Tensor, mDh: cute.Tensor, mDv2: cute.Tensor, mDh0: cute.Tensor,
               mS: cute.Tensor, HV: cutlass.Int32, group: cutlass.Int32, scale: cutlass.Float32):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        s, hv, vb = cute.arch.block_idx()
        hq = hv // group
        v0 = vb * self.bv
        bos = mS[s, 0]
        eos = mS[s, 1]
        first = mS[s, 2]
        nchunks = (eos - bos + _BT - 1) // _BT

        smem = cutlass.utils.SmemAllocator()
        sKg = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sW = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sQg = smem.allocate_tensor(bf16, smem_tile_layout(_BT, _K), 128)
        sDo = smem.allocate_tensor(bf16, smem_tile_layout(_BT, self.bv), 128)
        sDv = smem.allocate_tensor(bf16, smem_tile_layout(_BT, self.bv), 128)     # dv, then -dv_tot
        sDh = smem.allocate_tensor(bf16, smem_tile_layout(_K, self.bv), 128)
        sGl = smem.allocate_tensor(f32, cute.make_layout((_K,)), 16)

        mma = tiled_mma(4)
        thr = mma.get_slice(tidx)
        acc_h = cute.make_rmem_tensor(thr.partition_shape_C((_K, self.bv)), f32)
        coord_h = thr.partition_C(cute.make_identity_tensor((_K, self.bv)))
        acc_v = cute.make_rmem_tensor(thr.partition_shape_C((_BT, self.bv)), f32)
        coord_v = thr.partition_C(cute.make_identity_tensor((_BT, self.bv)))
        sDh_part = thr.partition_C(sDh)

        if cutlass.const_expr(self.has_dht):
            tHt = head_rows(mDht, (s * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k0, c0 = coord_h[i]
                acc_h[i] = tHt[k0, v0 + c0]
        else:
            acc_h.fill(0.0)

        cp = g2s_tiled_copy(_K, self.threads)
        cp_v = g2s_tiled_copy(self.bv, self.threads)
        for step in cutlass.range(nchunks, unroll=1):
            ci = nchunks - 1 - step
            t0 = bos + ci * _BT
            n = cutlass.min(eos - t0, _BT)
            cute.arch.sync_threads()  # the previous chunk's readers of the shared tiles are done
            copy_rows_g2s(cp, head_rows(mKg, t0, hv, _BT), sKg, n, tidx)
            copy_rows_g2s(cp, head_rows(mW, t0, hv, _BT), sW, n, tidx)
            copy_rows_g2s(cp, head_rows(mQ, t0, hq, _BT), sQg, n, tidx)
            copy_rows_g2s(cp_v, head_rows(mDo, t0, hv, _BT, v0, self.bv), sDo, n, tidx)
            copy_rows_g2s(cp_v, head_rows(mDv, t0, hv, _BT, v0, self.bv), sDv, n, tidx)
            cute.arch.cp_async_commit_group()
            tG = head_rows(mG, t0, hv, _BT)
            sGl[tidx] = cute.math.exp(tG[n - 1, tidx].to(f32), fastmath=True)
            # this chunk's dh (gradient of its end state) out, and into shared memory as a GEMM operand
            tDh = head_rows(mDh, ((first + ci) * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k1, c1 = coord_h[i]
                hb = acc_h[i].to(bf16)
                tDh[k1, v0 + c1] = hb
                sDh_part[i] = hb
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            # scale q exp(G) in place (thread = channel; rows past the end stay zero)
            for r in cutlass.range_constexpr(_BT):
                if r < n:
                    e = cute.math.exp(tG[r, tidx].to(f32), fastmath=True)
                    sQg[r, tidx] = (sQg[r, tidx].to(f32) * e * scale).to(bf16)

            # dv_tot = dv + kg @ dh
            acc_v.fill(0.0)
            gemm(mma, acc_v, sKg, transposed(sDh, _K, self.bv), tidx, False, True)
            tDv2 = head_rows(mDv2, t0, hv, _BT, v0, self.bv)
            cute.arch.sync_threads()  # every warp is done reading dh; q exp(G) complete
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                r2, c2 = coord_v[i]
                x = f32(0.0)
                if r2 < n:
                    x = sDv[r2, c2].to(f32) + acc_v[i]
                    tDv2[r2, c2] = x.to(mDv2.element_type)
                sDv[r2, c2] = (-x).to(bf16)
            cute.arch.sync_threads()

            # dh = diag(exp(G_last)) dh + (scale q e^G)^T do - w^T dv_tot
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k3, _ = coord_h[i]
                acc_h[i] = acc_h[i] * sGl[k3]
            gemm(mma, acc_h, transposed(sQg, _BT, _K), transposed(sDo, _BT, self.bv), tidx, True, True)
            gemm(mma, acc_h, transposed(sW, _BT, _K), transposed(sDv, _BT, self.bv), tidx, True, True)

        if cutlass.const_expr(self.want_dh0):
            tH0 = head_rows(mDh0, (s * HV + hv) * _K, 0, _K)
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                k4, c4 = coord_h[i]
                tH0[k4, v0 + c4] = acc_h[i]
