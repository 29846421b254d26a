"""Row copies between global and shared memory for CuTe DSL kernels: tiles of (T, H, D) row-major tensors,
cp.async (16-byte vectors) into shared memory with the rows past a tensor's end zeroed, and 16-byte vector copies
between registers and memory for stores out of shared memory."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int64
from cutlass.cute.nvgpu import CopyUniversalOp, cpasync

COPY_BITS = 128  # one 16-byte cp.async / vector access


def head_rows(m: cute.Tensor, t0, h, rows: int, col0=None, cols: int | None = None):
    """The (rows, cols) tile of the (T, H, D) row-major tensor `m` at token t0, head h, columns
    [col0, col0 + cols) (default: the whole row, cols = D). The offset is formed in 64 bits (a tensor may exceed
    2^31 elements; offsets inside a tile stay small) and asserted, like the row stride H * D, to be a multiple of
    `cols` (col0 a multiple of cols): 16-byte vector copies of the tile stay legal."""
    H = m.shape[1]
    D = m.shape[2]
    if cols is None:
        cols = D
    off = (Int64(t0) * H + h) * D
    if col0 is not None:
        off = off + col0
    off = cute.assume(off, divby=cols)
    ld = cute.assume(H * D, divby=D)
    return cute.make_tensor(m.iterator + off, cute.make_layout((rows, cols), stride=(ld, 1)))


def g2s_atom(dtype=BFloat16):
    """The cp.async copy atom of one 16-byte vector of `dtype` from global to shared memory (L2 only: .cg)."""
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=COPY_BITS)


def g2s_tiled_copy(cols: int, threads: int, dtype=BFloat16):
    """cp.async in 16-byte vectors of a row-major (rows, cols) tile by `threads` threads: cols / vector threads per
    row, each thread's rows `threads` / (cols / vector) apart."""
    vec = COPY_BITS // dtype.width
    per_row = cols // vec
    atom = g2s_atom(dtype)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, vec)))


@cute.jit
def copy_rows_g2s(tiled_copy: cute.TiledCopy, g: cute.Tensor, s: cute.Tensor, valid_rows, tidx):
    """Asynchronous copy (a `g2s_tiled_copy`) of rows [0, valid_rows) of the global tile `g` into the shared tile
    `s`; the rows past them are zeroed in shared memory and never read from global memory, so a tile may hang
    over the end of its tensor. The caller commits and waits for the cp.async group."""
    thr = tiled_copy.get_slice(tidx)
    src = thr.partition_S(g)
    dst = thr.partition_D(s)
    coord = thr.partition_S(cute.make_identity_tensor(g.shape))
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if coord[0, m, 0][0] < valid_rows:
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


def vec_copy(cols: int, threads: int, dtype=BFloat16):
    """Register <-> memory copy of a row-major (rows, cols) tile in 8-element vectors (one 16-byte access of bf16,
    two of fp32): cols / 8 threads per row, value e of a thread's fragment at column c0 + e, where
    c0 = 8 (tidx % (cols / 8)) is the same for every row the thread visits."""
    per_row = cols // 8
    atom = cute.make_copy_atom(CopyUniversalOp(), dtype, num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, 8), stride=(8, 1)))


@cute.jit
def store_rows_s2g(s: cute.Tensor, g: cute.Tensor, valid_rows, tidx, threads: cutlass.Constexpr):
    """Rows [0, valid_rows) of the shared tile `s` to the global tile `g` (same shape), 16 bytes per access, by
    `threads` threads: MMA results go to shared memory first (their fragments hold 2 adjacent columns per row),
    then out in whole 16-byte vectors, so a warp writes whole 128-byte lines instead of 4-byte pieces."""
    vc = vec_copy(cute.size(s.shape[1]), threads, s.element_type)
    thr = vc.get_slice(tidx)
    ps = thr.partition_S(s)
    pg = thr.partition_D(g)
    coord = thr.partition_D(cute.make_identity_tensor(g.shape))
    frag = cute.make_fragment_like(ps[None, 0, None])
    for m in cutlass.range_constexpr(cute.size(ps.shape[1])):
        if coord[0, m, 0][0] < valid_rows:
            cute.copy(vc, ps[None, m, None], frag)
            cute.copy(vc, frag, pg[None, m, None])
