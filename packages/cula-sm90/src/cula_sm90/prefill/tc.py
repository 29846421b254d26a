"""Tensor-core building blocks of the sm90 prefill kernels (CuTe DSL): warp-level mma.sync m16n8k16 (bf16 in,
fp32 accumulate) over shared-memory tiles read with ldmatrix, swizzled bf16 tiles, and cp.async row copies.

GEMM convention: ``acc[M, N] += A[M, K] @ B[N, K]^T`` where A and B are shared-memory views whose logical shapes
are (M, K) and (N, K). A tile stored with the contraction dim strided (e.g. h stored [K, V] used as B = h^T) is
passed through `t_view` and read with ldmatrix.trans.

fp32 operands that must keep fp32 accuracy (the state h, v_new) are split as x = hi + lo with hi = bf16(x) and
lo = bf16(x - hi) and multiplied twice (`store_split`): ~16 mantissa bits, so the recurrence does not drift with
the bf16 rounding of its own state, and CP (which reorders the arithmetic) agrees with the serial walk to a
few ulp of bf16^2 rather than of bf16.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warp

VEC = 8  # bf16 elements per 16-byte cp.async


def tiled_mma_m(warps: int):
    """mma.sync m16n8k16 bf16 -> fp32, `warps` warps stacked along M; N in pairs of atoms (ldmatrix.x4)."""
    atom = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
    return cute.make_tiled_mma(atom, (warps, 1, 1), permutation_mnk=(warps * 16, 16, 16))


def tiled_mma_mn(wm: int, wn: int):
    """mma.sync m16n8k16 bf16 -> fp32, `wm` x `wn` warps (M x N); each warp takes N in pairs of atoms."""
    atom = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
    return cute.make_tiled_mma(atom, (wm, wn, 1), permutation_mnk=(wm * 16, wn * 16, 16))


def bf16_tile(rows: int, cols: int, stages: int = 0):
    """Row-major bf16 (rows, cols) tile, XOR-swizzled in 8x(32|64) atoms: ldmatrix (plain and .trans) reads it
    without bank conflicts, and 16-byte cp.async writes stay contiguous. `stages` > 0: that many such tiles,
    indexed by a third mode (a multi-buffered pipeline)."""
    wide = cols % 64 == 0
    atom_cols = 64 if wide else 32
    sw = cute.make_swizzle(3 if wide else 2, 3, 3)
    atom = cute.make_composed_layout(sw, 0, cute.make_layout((8, atom_cols), stride=(atom_cols, 1)))
    if stages:
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def t_view(s: cute.Tensor, rows: int, cols: int):
    """The (cols, rows) transposed view of a (rows, cols) row-major tile."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


def g2s_copy(cols: int, threads: int):
    """cp.async (16-byte vectors) of a row-major bf16 tile `cols` wide by `threads` threads."""
    per_row = cols // VEC
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                               num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, VEC)))


def rows_at(m: cute.Tensor, t0, h, col0, rows: int, cols: int):
    """(rows, cols) view of the (T, H, D) row-major tensor `m` at token t0, head h, column col0: a 64-bit
    offset, asserted a multiple of 8 elements (16 bytes) like the row stride, so cp.async may vectorise."""
    H = m.shape[1]
    D = m.shape[2]
    off = cute.assume((Int64(t0) * H + h) * D + col0, divby=VEC)
    ld = cute.assume(H * D, divby=VEC)
    return cute.make_tensor(m.iterator + off, cute.make_layout((rows, cols), stride=(ld, 1)))


@cute.jit
def copy_rows(tcopy: cute.TiledCopy, g: cute.Tensor, s: cute.Tensor, valid, tid):
    """Asynchronous copy of rows [0, valid) of the global tile `g` into `s`; the rows past them are zeroed
    in shared memory and never read from global memory (a tile may hang over the end of its tensor)."""
    thr = tcopy.get_slice(tid)
    src = thr.partition_S(g)
    dst = thr.partition_D(s)
    coord = thr.partition_S(cute.make_identity_tensor(g.shape))
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if coord[0, m, 0][0] < valid:
            cute.copy(tcopy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


@cute.jit
def gemm(tmma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tid,
         a_t: cutlass.Constexpr, b_t: cutlass.Constexpr):
    """acc += sA @ sB^T from shared memory, k-block by k-block through ldmatrix (`a_t`/`b_t`: the view is
    transposed with respect to storage: ldmatrix.trans)."""
    gemm_sum(tmma, acc, sA, sB, sB, tid, a_t, b_t, False)


@cute.jit
def gemm_split(tmma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB_hi: cute.Tensor, sB_lo: cute.Tensor, tid,
               a_t: cutlass.Constexpr, b_t: cutlass.Constexpr):
    """acc += sA @ (sB_hi + sB_lo)^T: `gemm` against a split operand (store_split), each k-block of A read once
    for both halves."""
    gemm_sum(tmma, acc, sA, sB_hi, sB_lo, tid, a_t, b_t, True)


@cute.jit
def gemm_sum(tmma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB_hi: cute.Tensor, sB_lo: cute.Tensor, tid,
             a_t: cutlass.Constexpr, b_t: cutlass.Constexpr, split: cutlass.Constexpr):
    """The body of `gemm` (split False: sB_lo is not read) and `gemm_split`."""
    thr = tmma.get_slice(tid)
    rA = thr.make_fragment_A(thr.partition_A(sA))
    rH = thr.make_fragment_B(thr.partition_B(sB_hi))
    ldA = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(a_t, 4), BFloat16), tmma)
    ldB = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(b_t, 4), BFloat16), tmma)
    tA = ldA.get_slice(tid)
    tB = ldB.get_slice(tid)
    srcA = tA.partition_S(sA)
    srcH = tB.partition_S(sB_hi)
    dstA = tA.retile(rA)
    dstH = tB.retile(rH)
    rL = rH
    srcL = srcH
    dstL = dstH
    if const_expr(split):
        rL = thr.make_fragment_B(thr.partition_B(sB_lo))
        srcL = tB.partition_S(sB_lo)
        dstL = tB.retile(rL)
    for kb in cutlass.range_constexpr(cute.size(rA.shape[2])):
        cute.copy(ldA, srcA[None, None, kb], dstA[None, None, kb])
        cute.copy(ldB, srcH[None, None, kb], dstH[None, None, kb])
        if const_expr(split):
            cute.copy(ldB, srcL[None, None, kb], dstL[None, None, kb])
        cute.gemm(tmma, acc, rA[None, None, kb], rH[None, None, kb], acc)
        if const_expr(split):
            cute.gemm(tmma, acc, rA[None, None, kb], rL[None, None, kb], acc)


@cute.jit
def store_split(acc: cute.Tensor, s_hi: cute.Tensor, s_lo: cute.Tensor):
    """Partitioned fp32 values -> two bf16 tiles, hi = bf16(x) and lo = bf16(x - hi)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        x = acc[i]
        hi = x.to(BFloat16)
        s_hi[i] = hi
        s_lo[i] = (x - hi.to(Float32)).to(BFloat16)
