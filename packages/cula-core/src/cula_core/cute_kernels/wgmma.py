"""Warpgroup tensor-core GEMM for CuTe DSL kernels on Hopper (sm_90a): wgmma m64nNk16, bf16 operands read from
shared memory through descriptors, fp32 accumulators in registers.

Convention (the instruction's): a GEMM computes ``acc[M, N] (+)= A[M, K] @ B[N, K]^T`` for one warpgroup (128
threads), A and B shared-memory tiles of logical shapes (M, K) and (N, K). Each operand is K-major (contiguous
along the contraction) or M/N-major (contiguous along M or N: a tile stored the other way round, read without a
transpose). Operand tiles come from `alloc_operand_tile`, which puts the tile's swizzle on its shared-memory
pointer as the descriptors need; `rows_view` gives the token-row view of an M/N-major tile for the copies and
the accumulator stores that fill it.

fp32 operands that must keep more than bf16's accuracy are split as x = hi + lo with hi = bf16(x) and
lo = bf16(x - hi) (`store_split`) and multiplied as both halves (two `gemm` calls on one accumulator): about 16
mantissa bits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup

K_MAJOR = OperandMajorMode.K
MN_MAJOR = OperandMajorMode.MN


def operand_tile_layout(kind: warpgroup.SmemLayoutAtomKind, shape: tuple):
    """The (swizzled) layout of a bf16 operand tile of `shape`: swizzle atoms of `kind` tiled mode by mode (the
    first two modes are the operand's (M or N, K); further modes index stages or warpgroups). What
    `alloc_operand_tile` allocates, and what a TMA copy into such a tile is built for."""
    atom = warpgroup.make_smem_layout_atom(kind, BFloat16)
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))


def alloc_operand_tile(smem, kind: warpgroup.SmemLayoutAtomKind, shape: tuple):
    """A bf16 shared-memory tensor of `shape` (`operand_tile_layout`) from `smem` (a cutlass.memory.SmemAllocator),
    1024-byte aligned, the swizzle on the pointer."""
    layout = operand_tile_layout(kind, shape)
    return smem.allocate_tensor(BFloat16, layout.outer, 1024, layout.inner)


def rows_view(s: cute.Tensor, rows: int, cols: int):
    """The (rows, cols) view, column index fastest, of a (cols, rows) M/N-major operand tile: e.g. the
    (token, column) view of a (column, token) B tile, or the (token, k) view of a (k, token) A tile."""
    return cute.composition(s, cute.make_ordered_layout((rows, cols), order=(1, 0)))


def tiled_mma(a_major: OperandMajorMode, b_major: OperandMajorMode, n: int) -> cute.TiledMma:
    """One warpgroup's wgmma m64nNk16 (N = `n`), both operands from shared memory, bf16 x bf16 -> fp32."""
    op = warpgroup.MmaF16BF16Op(BFloat16, Float32, (64, n, 16), warpgroup.OperandSource.SMEM, a_major, b_major)
    return cute.make_tiled_mma(cute.make_mma_atom(op))


@cute.jit
def gemm(mma: cute.TiledMma, acc: cute.Tensor, rA: cute.Tensor, rB: cute.Tensor, accumulate: cutlass.Constexpr):
    """acc (+)= A @ B^T over every k-block of the descriptor fragments rA, rB (`accumulate` False: acc is
    overwritten). Issued, not waited for: the caller fences before (`warpgroup.fence()` when it wrote acc),
    commits and waits."""
    atom = cute.make_mma_atom(mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(rA.shape[2])):
        cute.gemm(atom, acc, rA[None, None, k], rB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)


def _stmatrix(mma: cute.TiledMma, tidx):
    """This thread's slice of the stmatrix (four 8 x 8 bf16 matrices per warp instruction) copy of `mma`'s
    accumulator into a row-major shared tile."""
    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BFloat16)
    return cute.make_tiled_copy_C(atom, mma).get_slice(tidx)


@cute.jit
def store_acc(mma: cute.TiledMma, acc: cute.Tensor, s: cute.Tensor, tidx):
    """This thread's fp32 accumulator fragment of `mma`, rounded to bf16, into the shared tile `s` of the
    accumulator's (M, N) shape, columns contiguous in 16-byte groups (a `rows_view`), by stmatrix."""
    thr = _stmatrix(mma, tidx)
    frag = cute.make_fragment_like(acc, BFloat16)
    for i in cutlass.range_constexpr(cute.size(acc)):
        frag[i] = acc[i].to(BFloat16)
    cute.copy(thr, thr.retile(frag), thr.partition_D(s))


@cute.jit
def store_split(mma: cute.TiledMma, acc: cute.Tensor, s_hi: cute.Tensor, s_lo: cute.Tensor, tidx):
    """`store_acc` of hi = bf16(x) into `s_hi` and lo = bf16(x - hi) into `s_lo`."""
    thr = _stmatrix(mma, tidx)
    hi = cute.make_fragment_like(acc, BFloat16)
    lo = cute.make_fragment_like(acc, BFloat16)
    for i in cutlass.range_constexpr(cute.size(acc)):
        x = acc[i]
        h = x.to(BFloat16)
        hi[i] = h
        lo[i] = (x - h.to(Float32)).to(BFloat16)
    cute.copy(thr, thr.retile(hi), thr.partition_D(s_hi))
    cute.copy(thr, thr.retile(lo), thr.partition_D(s_lo))
