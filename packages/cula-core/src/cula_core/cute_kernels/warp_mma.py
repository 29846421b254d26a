"""Warp-level tensor-core GEMM for CuTe DSL kernels: mma.sync m16n8k16 (bf16 x bf16 -> fp32 accumulate), which
runs on sm_90 and sm_100 alike, over swizzled shared-memory tiles read with ldmatrix.

Convention: a GEMM computes ``acc[M, N] += A[M, K] @ B[N, K]^T`` where A and B are shared-memory views whose
*logical* shapes are (M, K) and (N, K). An operand stored the other way round (its contraction dim strided, e.g. a
state h stored [K, V] used as B = h^T) is passed as `transposed(s, rows, cols)` with its `*_trans` flag set, and
read with ldmatrix.trans.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import warp


def mma_atom(dtype=BFloat16):
    """The MMA instruction: mma.sync m16n8k16, `dtype` (bf16 or fp16) operands, fp32 accumulator."""
    return warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16))


def tiled_mma(warps_m: int, warps_n: int = 1, dtype=BFloat16):
    """`warps_m` x `warps_n` warps (M x N) of `mma_atom`, 16 rows of M per warp; each warp takes N in pairs of
    8-column atoms (16 columns), so one ldmatrix.x4 feeds its B operand."""
    return cute.make_tiled_mma(mma_atom(dtype), (warps_m, warps_n, 1),
                               permutation_mnk=(warps_m * 16, warps_n * 16, 16))


def smem_tile_layout(rows: int, cols: int, stages: int | None = None):
    """Layout of a row-major bf16 (rows, cols) shared-memory tile, XOR-swizzled in 8 x 64 atoms (8 x 32 when cols
    is not a multiple of 64): ldmatrix, plain and transposed, reads it without bank conflicts and 16-byte cp.async
    writes stay contiguous. `stages` given: that many such tiles, selected by a third mode (a multi-buffered
    pipeline; 1 keeps the mode, for kernels whose stage count is a compile-time choice). rows must be a multiple of
    8, cols of 32."""
    atom_cols = 64 if cols % 64 == 0 else 32
    bits = 3 if atom_cols == 64 else 2
    atom = cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_layout((8, atom_cols), stride=(atom_cols, 1)))
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def transposed(s: cute.Tensor, rows: int, cols: int):
    """The (cols, rows) view of a (rows, cols) tensor: element (i, j) of the view is s[j, i]."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


def ldmatrix_copy_A(mma: cute.TiledMma, dtype, trans: bool):
    """The ldmatrix (x4) copy that loads an A operand of `mma` from shared memory (`trans`: the shared view is
    transposed with respect to storage, so the load transposes too)."""
    return cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(trans, 4), dtype), mma)


def ldmatrix_copy_B(mma: cute.TiledMma, dtype, trans: bool):
    """`ldmatrix_copy_A` for the B operand."""
    return cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(trans, 4), dtype), mma)


@cute.jit
def gemm(mma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tidx,
         a_trans: cutlass.Constexpr, b_trans: cutlass.Constexpr, unroll_k: cutlass.Constexpr = True):
    """acc += sA @ sB^T, the operands read k-block (16) by k-block through ldmatrix (`a_trans` / `b_trans`: the
    view is transposed with respect to storage). `acc` is this thread's accumulator fragment of `mma` over
    (M, N) = (rows of sA, rows of sB).

    `unroll_k` True: the k-loop is unrolled at compile time with register fragments of every k-block, so ptxas
    may issue all of the ldmatrix ahead of the MMAs. False: a runtime loop (unrolled by 2) over fragments of one
    k-block, which bounds the registers the product holds (for kernels that keep large register-resident state
    across it)."""
    if const_expr(unroll_k):
        _gemm_unrolled(mma, acc, sA, sB, tidx, a_trans, b_trans)
    else:
        _gemm_rolled(mma, acc, sA, sB, tidx, a_trans, b_trans)


def _ldmatrix_operands(mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, tidx, a_trans: bool, b_trans: bool,
                       one_k_block: bool):
    """This thread's register fragments of the operands, for every k-block or (`one_k_block`) for one 16-wide
    k-block, and the ldmatrix copies that fill them: (mma slice, B's copy slice, ldA, ldB, rA, rB, the shared
    sources srcA / srcB and the fragments as the copies see them dstA / dstB)."""
    thr = mma.get_slice(tidx)
    fA, fB = sA, sB
    if one_k_block:
        fA = cute.local_tile(sA, (cute.size(sA.shape[0]), 16), (0, 0))
        fB = cute.local_tile(sB, (cute.size(sB.shape[0]), 16), (0, 0))
    rA = thr.make_fragment_A(thr.partition_A(fA))
    rB = thr.make_fragment_B(thr.partition_B(fB))
    ldA = ldmatrix_copy_A(mma, sA.element_type, a_trans)
    ldB = ldmatrix_copy_B(mma, sB.element_type, b_trans)
    tA = ldA.get_slice(tidx)
    tB = ldB.get_slice(tidx)
    return thr, tB, ldA, ldB, rA, rB, tA.partition_S(sA), tB.partition_S(sB), tA.retile(rA), tB.retile(rB)


@cute.jit
def _gemm_unrolled(mma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tidx,
                   a_trans: cutlass.Constexpr, b_trans: cutlass.Constexpr):
    """The compile-time k-loop of `gemm`: register fragments of every k-block (the 16-wide blocks of sA's second
    mode, the contraction)."""
    gemm_k_range(mma, acc, sA, sB, tidx, a_trans, b_trans, 0, cute.size(sA.shape[1]) // 16 - 1)


@cute.jit
def gemm_k_range(mma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tidx,
                 a_trans: cutlass.Constexpr, b_trans: cutlass.Constexpr, kb_first, kb_last):
    """`gemm` (unrolled) over the 16-wide k-blocks kb_first .. kb_last only (the same across each warp; runtime
    values, or compile-time ones where the whole range is wanted): for an A whose other k-blocks are zeros by
    construction. They are skipped, not multiplied, so B's rows there never meet them: 0 * Inf and 0 * NaN would
    be NaN."""
    _, _, ldA, ldB, rA, rB, srcA, srcB, dstA, dstB = _ldmatrix_operands(mma, sA, sB, tidx, a_trans, b_trans, False)
    for kb in cutlass.range_constexpr(cute.size(rA.shape[2])):
        if kb >= kb_first and kb <= kb_last:
            cute.copy(ldA, srcA[None, None, kb], dstA[None, None, kb])
            cute.copy(ldB, srcB[None, None, kb], dstB[None, None, kb])
            cute.gemm(mma, acc, rA[None, None, kb], rB[None, None, kb], acc)


@cute.jit
def _gemm_rolled(mma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tidx,
                 a_trans: cutlass.Constexpr, b_trans: cutlass.Constexpr):
    """The runtime k-loop of `gemm`: fragments of one 16-wide k-block, reloaded every iteration."""
    _, _, ldA, ldB, rA, rB, srcA, srcB, dstA, dstB = _ldmatrix_operands(mma, sA, sB, tidx, a_trans, b_trans, True)
    for kb in cutlass.range(cute.size(srcA.shape[2]), unroll=2):
        cute.copy(ldA, srcA[None, None, kb], dstA[None, None, 0])
        cute.copy(ldB, srcB[None, None, kb], dstB[None, None, 0])
        cute.gemm(mma, acc, rA[None, None, 0], rB[None, None, 0], acc)


@cute.jit
def store_acc_smem(mma: cute.TiledMma, acc: cute.Tensor, s: cute.Tensor, tidx):
    """This thread's fp32 accumulator fragment of `mma`, rounded to s's dtype, into the shared tile `s` (the shape
    of the accumulator)."""
    ps = mma.get_slice(tidx).partition_C(s)
    for i in cutlass.range_constexpr(cute.size(acc)):
        ps[i] = acc[i].to(s.element_type)
