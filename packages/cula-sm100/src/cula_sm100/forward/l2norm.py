"""L2 normalisation of q and k rows (use_qk_l2norm_in_kernel): `x * rsqrt(sum(x^2) + 1e-6)` per row of K.

Tiling: one HALF-warp per row of K = 128 bf16, 8 consecutive channels (one 16-byte vector) per lane, so a
128-thread CTA touches 8 consecutive rows (2 KB) per access and each thread handles ROWS_PER_THREAD rows
(those rows' loads are all issued before any arithmetic: ROWS_PER_THREAD x 16 bytes in flight per lane).
A CTA covers 8 x ROWS_PER_THREAD consecutive rows of the flattened `[T_total * HQK]` token-heads (q and k stay
in their HQK heads: GVA never expands them). Why half-warps and vectors: a warp per row with 4 two-byte loads per
lane keeps too few bytes in flight per SM to reach HBM bandwidth.
Arithmetic (bitwise that of `cute_utils.l2norm_scale`, which the backward's l2norm_bwd.py recomputes r with):
there a lane sums the squares of 4 channels in order, then a 5-level butterfly adds lanes l ^ 1, ^ 2, .. ^ 16.
Here a lane holds two such quads: it sums each quad in order and adds the two (level 1 of that butterfly, as
fp32 addition is commutative), then butterflies over the half-warp with xor 1, 2, 4, 8 (levels 2..5); every
lane ends with the same sum, rsqrt(sum + eps), scale, round to bf16, 16-byte store.
Rows past the end: loads are skipped (zeros) and stores predicated; the shuffles run on every lane (the two
rows of a warp may straddle the end), so no lane leaves the warp-synchronous butterfly.
Assumes contiguous rows of K and 16-byte aligned bases (torch allocations).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import CopyUniversalOp

from cula_core.reference.gates import L2NORM_EPS


class L2Norm:
    K = 128
    VEC = 8                    # bf16 channels per lane: one 16-byte access
    LANES_PER_ROW = 16         # K / VEC
    threads = 128
    ROWS_PER_THREAD = 4        # 8 rows per CTA-wide access x 4 = 32 rows per CTA
    ROWS_PER_CTA = threads // LANES_PER_ROW * ROWS_PER_THREAD

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, y_ptr: cute.Pointer, rows: cutlass.Int32, stream: cuda.CUstream):
        lay = cute.make_layout((rows, self.K), stride=(self.K, 1))
        mX = cute.make_tensor(x_ptr, lay)
        mY = cute.make_tensor(y_ptr, lay)
        self.kernel(mX, mY, rows).launch(grid=[cute.ceil_div(rows, self.ROWS_PER_CTA), 1, 1],
                                         block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def lane_vec(self, m: cute.Tensor, row, col):
        """The VEC channels of row `row` from column `col` (a multiple of VEC); 64-bit offset (q may exceed
        2^31 elements)."""
        off = cute.assume(cutlass.Int64(row) * self.K + col, divby=self.VEC)
        return cute.make_tensor(m.iterator + off, cute.make_layout((self.VEC,)))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        col = (tidx % self.LANES_PER_ROW) * self.VEC
        rows_per_pass = self.threads // self.LANES_PER_ROW
        row0 = bidx * self.ROWS_PER_CTA + tidx // self.LANES_PER_ROW
        atom = cute.make_copy_atom(CopyUniversalOp(), mX.element_type, num_bits_per_copy=self.VEC * 16)
        RP = self.ROWS_PER_THREAD
        vec_rows = cute.make_layout((RP, self.VEC), stride=(self.VEC, 1))  # a row = one contiguous vector
        raw = cute.make_rmem_tensor(vec_rows, mX.element_type)
        res = cute.make_rmem_tensor(vec_rows, mY.element_type)
        raw.fill(0.0)
        for i in cutlass.range_constexpr(RP):
            if row0 + i * rows_per_pass < rows:
                cute.copy(atom, self.lane_vec(mX, row0 + i * rows_per_pass, col), raw[i, None])
        for i in cutlass.range_constexpr(RP):
            vals = cute.make_rmem_tensor((self.VEC,), cutlass.Float32)
            for e in cutlass.range_constexpr(self.VEC):
                vals[e] = raw[i, e].to(cutlass.Float32)
            lo = cutlass.Float32(0.0)
            hi = cutlass.Float32(0.0)
            for e in cutlass.range_constexpr(4):
                lo += vals[e] * vals[e]
                hi += vals[4 + e] * vals[4 + e]
            ss = lo + hi
            for s in cutlass.range_constexpr(4):
                ss += cute.arch.shuffle_sync_bfly(ss, 1 << s)
            r = cute.math.rsqrt(ss + L2NORM_EPS)
            for e in cutlass.range_constexpr(self.VEC):
                res[i, e] = (vals[e] * r).to(mY.element_type)
        for i in cutlass.range_constexpr(RP):
            if row0 + i * rows_per_pass < rows:
                cute.copy(atom, res[i, None], self.lane_vec(mY, row0 + i * rows_per_pass, col))
