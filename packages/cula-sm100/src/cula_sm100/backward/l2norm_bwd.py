"""l2norm_bwd: the backward of the q/k L2 normalisation (use_qk_l2norm_in_kernel), y = x r, r = rsqrt(sum x^2 + eps):

    dx = r (dy - y <y, dy>)          (dy: the gradient of the normalised row, fp32; dx in x's dtype)

Tiling: one warp per row of K = 128 (4 consecutive channels per lane), 4 rows per 128-thread CTA; rows are the
flattened [T_total * HQK] token-heads. r comes from `cute_utils.l2norm_scale` (bitwise the forward l2norm.py's r),
<y, dy> from a 5-level warp butterfly. No shared memory, no barriers. Assumes contiguous rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import l2norm_scale

_K = 128


class L2NormBwd:
    ROWS_PER_CTA = 4
    threads = 128

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, dy_ptr: cute.Pointer, dx_ptr: cute.Pointer, rows: cutlass.Int32,
                 stream: cuda.CUstream):
        lay = cute.make_layout((rows, _K), stride=(_K, 1))
        self.kernel(cute.make_tensor(x_ptr, lay), cute.make_tensor(dy_ptr, lay), cute.make_tensor(dx_ptr, lay),
                    rows).launch(grid=[cute.ceil_div(rows, self.ROWS_PER_CTA), 1, 1], block=[self.threads, 1, 1],
                                 stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mDy: cute.Tensor, mDx: cute.Tensor, rows: cutlass.Int32):
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * self.ROWS_PER_CTA + tidx // 32
        if row < rows:
            x = cute.make_rmem_tensor((4,), f32)
            dy = cute.make_rmem_tensor((4,), f32)
            for i in cutlass.range_constexpr(4):
                x[i] = mX[row, lane * 4 + i].to(f32)
                dy[i] = mDy[row, lane * 4 + i]
            r = l2norm_scale(x)
            p = f32(0.0)
            for i in cutlass.range_constexpr(4):
                p += x[i] * r * dy[i]
            for s in cutlass.range_constexpr(5):
                p += cute.arch.shuffle_sync_bfly(p, 1 << s)
            for i in cutlass.range_constexpr(4):
                mDx[row, lane * 4 + i] = (r * (dy[i] - x[i] * r * p)).to(mDx.element_type)
