"""KDA-specific CuTe DSL device helpers of the sm100 forward and backward kernels: the chunk a CTA owns, beta and
its activation, the token layout of FLA's [B, T, H, D] tensors, q e^G in bf16 and the q/k L2 norm's row arithmetic.
The warp-level MMA and the global <-> shared row copies every kernel uses are cula_core.cute_kernels'."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from cula_core.cute_kernels.copies import head_rows
from cula_core.reference.gates import L2NORM_EPS

LOG2E = math.log2(math.e)


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
