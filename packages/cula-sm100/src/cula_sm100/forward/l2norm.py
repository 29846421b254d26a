"""L2 normalisation of q and k rows (use_qk_l2norm_in_kernel): `x * rsqrt(sum(x^2) + 1e-6)` per row of K.

Tiling: one warp per row of K = 128 bf16 (4 elements per lane), 4 rows per 128-thread CTA; rows are the
flattened `[T_total * HQK]` token-heads (q and k stay in their HQK heads: GVA never expands them).
Pipeline: load, warp-butterfly sum of squares in fp32, scale, store bf16. Assumes contiguous rows of K.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import l2norm_scale


class L2Norm:
    K = 128
    ROWS_PER_CTA = 4
    threads = 128

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, y_ptr: cute.Pointer, rows: cutlass.Int32, stream: cuda.CUstream):
        lay = cute.make_layout((rows, self.K), stride=(self.K, 1))
        mX = cute.make_tensor(x_ptr, lay)
        mY = cute.make_tensor(y_ptr, lay)
        self.kernel(mX, mY, rows).launch(grid=[cute.ceil_div(rows, self.ROWS_PER_CTA), 1, 1],
                                         block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * self.ROWS_PER_CTA + tidx // 32
        if row < rows:
            vals = cute.make_rmem_tensor((4,), cutlass.Float32)
            for i in cutlass.range_constexpr(4):
                vals[i] = mX[row, lane * 4 + i].to(cutlass.Float32)
            r = l2norm_scale(vals)  # shared with the backward's l2norm_bwd.py
            for i in cutlass.range_constexpr(4):
                mY[row, lane * 4 + i] = (vals[i] * r).to(mY.element_type)
