"""Shared CuTe DSL helpers of the sm100 forward kernels: the MMA atom (chosen here, in one place), swizzled
shared-memory tiles, predicated global->shared copies, 16-byte register <-> memory row copies (vector loads of
element-wise operands, and the stores of MMA results staged through shared memory), and shared-memory GEMMs
through ldmatrix.

Every kernel multiplies with warp-level `mma.sync.m16n8k16` (bf16 x bf16 -> fp32), which runs on sm_90 and
sm_100 alike, so the H100 tests the code that serves Blackwell. A tcgen05/TMEM variant for sm_100 slots in
by replacing `mma_atom` / `make_tiled_mma` and the GEMM helpers below for that arch (a later issue).

Conventions: a GEMM computes `acc[M, N] += A[M, K] @ B[N, K]^T` with A and B views in shared memory whose
*logical* shapes are `(M, K)` and `(N, K)`. An operand stored the other way round (the contraction dim
not contiguous) is passed as a transposed view (`transposed(s)`) and loaded with `ldmatrix.trans`.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import CopyUniversalOp, cpasync, warp

from cula_core.reference.gates import L2NORM_EPS

LOG2E = math.log2(math.e)
COPY_BITS = 128  # 16-byte cp.async / vector accesses


def mma_atom(dtype=cutlass.BFloat16):
    """The MMA instruction every forward kernel uses (the per-arch switch point)."""
    return warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16))


def make_tiled_mma(warps_m: int, dtype=cutlass.BFloat16):
    """`warps_m` warps stacked along M (16 rows each); N in pairs of 8-column atoms so ldmatrix.x4 feeds B."""
    return cute.make_tiled_mma(mma_atom(dtype), (warps_m, 1, 1), permutation_mnk=(warps_m * 16, 16, 16))


def smem_layout(rows: int, cols: int, stages: int = 1):
    """Row-major bf16 tile with an XOR swizzle so ldmatrix (plain and transposed) is bank-conflict free;
    with `stages` > 1, a third mode selects the stage."""
    atom_cols = 64 if cols % 64 == 0 else 32
    bits = 3 if atom_cols == 64 else 2
    atom = cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_layout((8, atom_cols), stride=(atom_cols, 1)))
    if stages == 1:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def transposed(s: cute.Tensor, rows: int, cols: int):
    """View of a (rows, cols) tensor as (cols, rows): element (i, j) is s[j, i]."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


def g2s_tiled_copy(cols: int, num_threads: int, dtype=cutlass.BFloat16):
    """cp.async of 16-byte vectors for a row-major (rows, cols) bf16 tile."""
    vec = COPY_BITS // dtype.width
    per_row = cols // vec
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, vec)))


def vec_copy(cols: int, num_threads: int, dtype=cutlass.BFloat16):
    """Register <-> memory copy of a row-major (rows, cols) tile in 8-element vectors (one 16-byte access of
    bf16, two of fp32): cols / 8 threads per row, value e of a thread's fragment at column c0 + e, where
    c0 = 8 (tidx % (cols / 8)) is the same for every row the thread visits."""
    per_row = cols // 8
    atom = cute.make_copy_atom(CopyUniversalOp(), dtype, num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, 8), stride=(8, 1)))


@cute.jit
def store_rows_s2g(s: cute.Tensor, g: cute.Tensor, valid_rows, tidx, num_threads: cutlass.Constexpr):
    """Rows [0, valid_rows) of the shared tile `s` to the global tile `g` (same shape), 16 bytes per access:
    MMA results go to shared memory first (their fragments hold 2 adjacent columns per row), then out in
    full 16-byte vectors, so a warp writes whole 128-byte lines instead of 4-byte pieces."""
    vc = vec_copy(cute.size(s.shape[1]), num_threads, s.element_type)
    thr = vc.get_slice(tidx)
    ps = thr.partition_S(s)
    pg = thr.partition_D(g)
    coord = thr.partition_D(cute.make_identity_tensor(g.shape))
    frag = cute.make_fragment_like(ps[None, 0, None])
    for m in cutlass.range_constexpr(cute.size(ps.shape[1])):
        if coord[0, m, 0][0] < valid_rows:
            cute.copy(vc, ps[None, m, None], frag)
            cute.copy(vc, frag, pg[None, m, None])


@cute.jit
def store_acc_s(tiled_mma: cute.TiledMma, acc: cute.Tensor, s: cute.Tensor, tidx):
    """The fp32 accumulator fragment of this thread, rounded to s's dtype, into the shared tile s."""
    ps = tiled_mma.get_slice(tidx).partition_C(s)
    for i in cutlass.range_constexpr(cute.size(acc)):
        ps[i] = acc[i].to(s.element_type)


def head_rows(m: cute.Tensor, t0, h, rows: int):
    """The (rows, D) tile of a (T, H, D) row-major tensor starting at token t0, head h. The offset is formed
    in 64 bits (a tensor may exceed 2^31 elements; offsets inside a tile stay small) and, like the row
    stride, is a multiple of D, asserted so 16-byte vector copies stay legal."""
    H = m.shape[1]
    D = m.shape[2]
    off = cute.assume((cutlass.Int64(t0) * H + h) * D, divby=D)
    ld = cute.assume(H * D, divby=D)
    return cute.make_tensor(m.iterator + off, cute.make_layout((rows, D), stride=(ld, 1)))


@cute.jit
def copy_rows_g2s(tiled_copy: cute.TiledCopy, g: cute.Tensor, s: cute.Tensor, valid_rows, tidx):
    """Copy rows [0, valid_rows) of the global tile `g` into `s` asynchronously; zero the rows past them
    (they are never read from global memory, so a tile may hang over the end of its tensor)."""
    thr = tiled_copy.get_slice(tidx)
    src = thr.partition_S(g)
    dst = thr.partition_D(s)
    coord = thr.partition_S(cute.make_identity_tensor(g.shape))
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if coord[0, m, 0][0] < valid_rows:
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


def ldmatrix_copy_A(tiled_mma: cute.TiledMma, dtype, trans: bool):
    """The ldmatrix (x4) copy that loads an MMA A operand from shared memory (`trans`: the shared view is
    transposed with respect to storage, so the load transposes too)."""
    return cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(trans, 4), dtype), tiled_mma)


def ldmatrix_copy_B(tiled_mma: cute.TiledMma, dtype, trans: bool):
    """ldmatrix_copy_A for the B operand."""
    return cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(trans, 4), dtype), tiled_mma)


@cute.jit
def gemm_ss(tiled_mma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tidx,
            a_trans: cutlass.Constexpr, b_trans: cutlass.Constexpr):
    """acc += sA @ sB^T, operands loaded k-block by k-block with ldmatrix (`*_trans`: the view is transposed
    with respect to storage, so the load transposes too)."""
    thr_mma = tiled_mma.get_slice(tidx)
    rA = thr_mma.make_fragment_A(thr_mma.partition_A(sA))
    rB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
    cA = ldmatrix_copy_A(tiled_mma, sA.element_type, a_trans)
    cB = ldmatrix_copy_B(tiled_mma, sB.element_type, b_trans)
    tA = cA.get_slice(tidx)
    tB = cB.get_slice(tidx)
    sAp = tA.partition_S(sA)
    rAv = tA.retile(rA)
    sBp = tB.partition_S(sB)
    rBv = tB.retile(rB)
    for kb in cutlass.range_constexpr(cute.size(rA.shape[2])):
        cute.copy(cA, sAp[None, None, kb], rAv[None, None, kb])
        cute.copy(cB, sBp[None, None, kb], rBv[None, None, kb])
        cute.gemm(tiled_mma, acc, rA[None, None, kb], rB[None, None, kb], acc)


@cute.jit
def gemm_kb(tiled_mma: cute.TiledMma, acc: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tidx,
            a_trans: cutlass.Constexpr, b_trans: cutlass.Constexpr):
    """acc += sA @ sB^T like gemm_ss (`*_trans`: the view is transposed with respect to storage), but
    over the k-blocks in a runtime loop (unrolled by 2) with fragments of ONE k-block: ptxas cannot hoist every
    ldmatrix of the product ahead of the MMAs, which with the register-held dq / dk / dG spilled (255 registers,
    656 bytes of spill stores on sm_90a with the unrolled gemm_ss; none with this)."""
    thr_mma = tiled_mma.get_slice(tidx)
    rA = thr_mma.make_fragment_A(thr_mma.partition_A(cute.local_tile(sA, (cute.size(sA.shape[0]), 16), (0, 0))))
    rB = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(sB, (cute.size(sB.shape[0]), 16), (0, 0))))
    cA = ldmatrix_copy_A(tiled_mma, sA.element_type, a_trans)
    cB = ldmatrix_copy_B(tiled_mma, sB.element_type, b_trans)
    tA = cA.get_slice(tidx)
    tB = cB.get_slice(tidx)
    sAp = tA.partition_S(sA)
    sBp = tB.partition_S(sB)
    rAv = tA.retile(rA)
    rBv = tB.retile(rB)
    for kb in cutlass.range(cute.size(sAp.shape[2]), unroll=2):
        cute.copy(cA, sAp[None, None, kb], rAv[None, None, 0])
        cute.copy(cB, sBp[None, None, kb], rBv[None, None, 0])
        cute.gemm(tiled_mma, acc, rA[None, None, 0], rB[None, None, 0], acc)


@cute.jit
def gemm_rs(tiled_mma: cute.TiledMma, acc: cute.Tensor, rA: cute.Tensor, sB: cute.Tensor, tidx,
            b_trans: cutlass.Constexpr):
    """acc += A @ sB^T with A already in registers (an MMA A fragment, `partition_shape_A`), B through ldmatrix."""
    thr_mma = tiled_mma.get_slice(tidx)
    rB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
    cB = ldmatrix_copy_B(tiled_mma, sB.element_type, b_trans)
    tB = cB.get_slice(tidx)
    sBp = tB.partition_S(sB)
    rBv = tB.retile(rB)
    for kb in cutlass.range_constexpr(cute.size(rA.shape[2])):
        cute.copy(cB, sBp[None, None, kb], rBv[None, None, kb])
        cute.gemm(tiled_mma, acc, rA[None, None, kb], rB[None, None, kb], acc)


def exp2(x):
    return cute.math.exp2(x, fastmath=True)


@cute.jit
def scale_by_exp(fq: cute.Tensor, fg: cute.Tensor):
    """fq[e] = bf16(float(fq[e]) e^fg[e]) in place, the 8 values of a 16-byte vector: q e^G (qg, the first operand
    of fwd_o's GEMM) as fwd_o.py and chunk_intra_wu_gate.py (qg_out) both form it, one expression, so the same
    bits (fg fp32; fastmath exp)."""
    for e in cutlass.range_constexpr(8):
        fq[e] = (fq[e].to(cutlass.Float32) * cute.math.exp(fg[e].to(cutlass.Float32), fastmath=True)
                 ).to(cutlass.BFloat16)


def token_layout(TT, H, D):
    """Row-major (T_total, H, D): FLA's [B, T, H, D] with batch and time packed."""
    return cute.make_layout((TT, H, D), stride=(H * D, D, 1))


def beta_act(x, act: str):
    """beta after its activation ("none", "sigmoid", "2sigmoid"), fp32."""
    if cutlass.const_expr(act == "sigmoid"):
        return 1.0 / (1.0 + cute.math.exp(-x))
    if cutlass.const_expr(act == "2sigmoid"):
        return 2.0 / (1.0 + cute.math.exp(-x))
    return x


@cute.jit
def chunk_block(mT: cute.Tensor):
    """This CTA's (thread, chunk, value head, chunk's first token, chunk length) for grids (chunks, HV)."""
    tidx, _, _ = cute.arch.thread_idx()
    c, hv, _ = cute.arch.block_idx()
    return tidx, c, hv, mT[c, 0], mT[c, 1]


@cute.jit
def load_beta(sBeta: cute.Tensor, mBeta: cute.Tensor, t0, hv, n, tidx, act: cutlass.Constexpr):
    """sBeta[r] = activated beta of the chunk's row r (0 past its end); mBeta is (T_total, HV, 1)."""
    if tidx < cute.size(sBeta):
        b = cutlass.Float32(0.0)
        if tidx < n:
            b = beta_act(head_rows(mBeta, t0, hv, cute.size(sBeta))[tidx, 0].to(cutlass.Float32), act)
        sBeta[tidx] = b


@cute.jit
def l2norm_scale(vals: cute.Tensor):
    """rsqrt(sum of squares + eps) of a 128-wide row spread over a warp, 4 consecutive channels per lane in
    `vals` (fp32): the lane's squares summed in order, then a 5-level butterfly. The definition of the q/k L2
    norm's arithmetic: the backward's l2norm_bwd.py uses it, and the forward's l2norm.py (half a warp per row,
    8 channels per lane) computes bitwise the same sum in its own layout (its docstring says how)."""
    ss = cutlass.Float32(0.0)
    for i in cutlass.range_constexpr(4):
        ss += vals[i] * vals[i]
    for s in cutlass.range_constexpr(5):
        ss += cute.arch.shuffle_sync_bfly(ss, 1 << s)
    return cute.math.rsqrt(ss + L2NORM_EPS)
