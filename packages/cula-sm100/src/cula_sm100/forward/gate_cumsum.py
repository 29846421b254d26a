"""Preprocessing of the log decay: the gate (precomputed, softplus or safe) and its chunk-local cumsum.

    x_t = g_t                                                   (gate="precomputed")
    x_t = -exp(A_log[hv]) * softplus(g_t + dt_bias[hv])         (gate="softplus", softplus(x) = x for x > 20)
    x_t = lower_bound * sigmoid(exp(A_log[hv]) * (g_t + dt_bias[hv]))   (gate="safe"; no A_log: factor 1)
    G_t = x_{t0} + ... + x_t   within each 64-token chunk (natural log; FLA stores G / ln 2)
    qg_t = bf16(q_t exp(G_t) scale)                             (qg_out only: the backward's chunk_bwd_dhu operand)

Tiling: one WARP per (chunk, value head), 4 warps per CTA on 4 consecutive value heads of one chunk (a token's
4 head rows are 2 KB of contiguous memory), grid (chunks, ceil(HV / 4)). Lane l owns channels 4l .. 4l+3, so
every access is one vector per lane per row (16 bytes of fp32 g / G, 8 of bf16 g) and a warp moves a whole
512-byte row per instruction (one thread per channel would issue 64 4-byte loads and stores per thread).
Pipeline: the chunk's rows in batches of ROWS_PER_BATCH: all of a batch's loads first (independent, so
ROWS_PER_BATCH x 16 bytes per lane are in flight), then per channel the gate and the running sum in row order,
then the batch's stores. Each channel is summed sequentially, in row order, whatever ROWS_PER_BATCH is (and as
chunk_intra_wu_gate sums it: the same G bitwise).
Gate arithmetic: exp / log through the MUFU approximations (ex2.approx, lg2.approx), as FLA's softplus (its
inline PTX) and sigmoid do: the precise libdevice exp + log1p cost ~40 instructions per element and made this
pass instruction-bound rather than HBM-bound. softplus keeps relative accuracy where log(1 + e) would lose it
(e = exp(z) < 2^-6: the series e - e^2/2 + e^3/3 - e^4/4, truncation < 1e-8 relative); elsewhere the error is
lg2.approx's (absolute ~2^-22 in log2), i.e. about 1e-7 absolute per token on the softplus value.
qg_out: q [TT, HQK, K] bf16 is read at head hv // (HV // HQK), qg [TT, HV, K] bf16 written beside G (8 bytes of
each per lane and row).
Varlen: the chunk table gives each chunk's first token and length (1..64); chunks never cross a sequence, and
rows at or past the length are neither read nor written. G is within the fp64 reference's tolerance in every
gate mode (test_gate_cumsum_modes).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import CopyUniversalOp

from cula_sm100.forward.cute_utils import token_layout

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class GateCumsum:
    BT = 64
    K = 128
    VEC = 4                    # channels per lane: 16 bytes of fp32
    WARPS = 4                  # value heads per CTA (one warp each)
    # rows loaded ahead per lane: more bytes in flight per lane against fewer warps per SM (registers); 8 chosen
    # over 4 and 16 by measurement (docs/sm100.md)
    ROWS_PER_BATCH = 8
    SERIES_BELOW = 2.0 ** -6   # softplus: e = exp(z) below this uses the log1p series

    def __init__(self, gate: str, has_A_log: bool, has_dt_bias: bool, lower_bound: float | None,
                 qg_out: bool = False):
        self.gate = gate
        self.qg_out = qg_out
        self.has_A_log = has_A_log
        self.has_dt_bias = has_dt_bias
        self.lower_bound = float(lower_bound) if lower_bound is not None else 0.0

    @cute.jit
    def __call__(self, g_ptr: cute.Pointer, a_ptr: cute.Pointer, b_ptr: cute.Pointer, G_ptr: cute.Pointer,
                 table_ptr: cute.Pointer, q_ptr: cute.Pointer, qg_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        lay = token_layout(TT, HV, self.K)
        mg = cute.make_tensor(g_ptr, lay)
        mG = cute.make_tensor(G_ptr, lay)
        mq = cute.make_tensor(q_ptr, token_layout(TT, HQK, self.K))
        mqg = cute.make_tensor(qg_ptr, lay)
        mA = cute.make_tensor(a_ptr, cute.make_layout((HV,)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((HV, self.K), stride=(self.K, 1)))
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(mg, mA, mB, mG, mT, mq, mqg, HQK, HV, scale).launch(
            grid=[NC, cute.ceil_div(HV, self.WARPS), 1], block=[32 * self.WARPS, 1, 1], stream=stream)

    @cute.jit
    def lane_vec(self, m: cute.Tensor, off):
        """The VEC contiguous elements of m at element offset `off` (a multiple of VEC: one vector access)."""
        return cute.make_tensor(m.iterator + cute.assume(off, divby=self.VEC), cute.make_layout((self.VEC,)))

    @cute.kernel
    def kernel(self, mg: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mG: cute.Tensor, mT: cute.Tensor,
               mq: cute.Tensor, mqg: cute.Tensor, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        c, hb, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        hv = hb * self.WARPS + warp
        if hv < HV:  # warp-uniform: the last CTA column may hold fewer than WARPS heads
            t0 = mT[c, 0]
            n = mT[c, 1]
            ld = cute.assume(HV * self.K, divby=self.K)     # elements between consecutive tokens
            # 64-bit: the tensor may exceed 2^31 elements; offsets inside a chunk fit in 32 bits
            base = cute.assume((cutlass.Int64(t0) * HV + hv) * self.K + lane * self.VEC, divby=self.VEC)
            g_atom = cute.make_copy_atom(CopyUniversalOp(), mg.element_type,
                                         num_bits_per_copy=self.VEC * mg.element_type.width)
            G_atom = cute.make_copy_atom(CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=self.VEC * 32)
            q_atom = cute.make_copy_atom(CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=self.VEC * 16)
            hq = hv // (HV // HQK)
            ldq = cute.assume(HQK * self.K, divby=self.K)
            base_q = cute.assume((cutlass.Int64(t0) * HQK + hq) * self.K + lane * self.VEC, divby=self.VEC)
            rate, bias = self.rate_bias(mA, mB, hv, lane)
            acc = cute.make_rmem_tensor((self.VEC,), cutlass.Float32)
            acc.fill(0.0)
            R = self.ROWS_PER_BATCH
            rows = cute.make_layout((R, self.VEC), stride=(self.VEC, 1))  # a row = one contiguous vector
            raw = cute.make_rmem_tensor(rows, mg.element_type)
            out = cute.make_rmem_tensor(rows, cutlass.Float32)
            qv = cute.make_rmem_tensor(rows, cutlass.BFloat16)   # q, then qg in place (qg_out)
            for b in cutlass.range_constexpr(self.BT // R):
                if b * R < n:  # a short (varlen) chunk skips its empty batches
                    for i in cutlass.range_constexpr(R):
                        if b * R + i < n:
                            cute.copy(g_atom, self.lane_vec(mg, base + (b * R + i) * ld), raw[i, None])
                            if cutlass.const_expr(self.qg_out):
                                cute.copy(q_atom, self.lane_vec(mq, base_q + (b * R + i) * ldq), qv[i, None])
                    for i in cutlass.range_constexpr(R):
                        for j in cutlass.range_constexpr(self.VEC):
                            # rows past the end add garbage to acc but are never stored (and nothing follows them)
                            acc[j] += self.gate_of(raw[i, j].to(cutlass.Float32), rate, bias[j])
                            out[i, j] = acc[j]
                    if cutlass.const_expr(self.qg_out):
                        for i in cutlass.range_constexpr(R):
                            for j in cutlass.range_constexpr(self.VEC):
                                e = cute.math.exp(out[i, j], fastmath=True)
                                qv[i, j] = (qv[i, j].to(cutlass.Float32) * e * scale).to(cutlass.BFloat16)
                    for i in cutlass.range_constexpr(R):
                        if b * R + i < n:
                            cute.copy(G_atom, out[i, None], self.lane_vec(mG, base + (b * R + i) * ld))
                            if cutlass.const_expr(self.qg_out):
                                cute.copy(q_atom, qv[i, None], self.lane_vec(mqg, base + (b * R + i) * ld))

    @cute.jit
    def rate_bias(self, mA: cute.Tensor, mB: cute.Tensor, hv, lane):
        """(exp(A_log[hv]) or 1, dt_bias[hv, 4 lane .. 4 lane + 3] or 0) in fp32."""
        rate = self.rate_of(mA, hv)
        bias = cute.make_rmem_tensor((self.VEC,), cutlass.Float32)
        for j in cutlass.range_constexpr(self.VEC):
            bias[j] = self.bias_of(mB, hv, lane * self.VEC + j)
        return rate, bias

    @cute.jit
    def rate_of(self, mA: cute.Tensor, hv):
        """exp(A_log[hv]) (1 without A_log), fp32: the gate's rate for value head hv. chunk_intra_wu_gate.py
        computes the gate with this and bias_of / gate_of, so its G is bitwise this kernel's."""
        rate = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_A_log):
            rate = cute.math.exp(mA[hv].to(cutlass.Float32))
        return rate

    @cute.jit
    def bias_of(self, mB: cute.Tensor, hv, ch):
        """dt_bias[hv, ch] (0 without dt_bias), fp32."""
        bias = cutlass.Float32(0.0)
        if cutlass.const_expr(self.has_dt_bias):
            bias = mB[hv, ch].to(cutlass.Float32)
        return bias

    @cute.jit
    def gate_of(self, v: cutlass.Float32, rate: cutlass.Float32, bias: cutlass.Float32):
        """The log decay x_t of one raw g_t (the module docstring's formulas). A running sum adds it in the same
        expression (`acc += gate_of(...)`): ptxas contracts the softplus / safe gate's last multiply with that add
        into one FFMA (seen in the SASS), so a sum of stored gate values would round differently."""
        if cutlass.const_expr(self.gate == "softplus"):
            z = v + bias
            sp = z
            if z <= 20.0:
                e = cute.math.exp2(z * LOG2E, fastmath=True)
                sp = cute.math.log2(1.0 + e, fastmath=True) * LN2
                if e < self.SERIES_BELOW:
                    sp = e * (1.0 + e * (-0.5 + e * (1.0 / 3.0 + e * -0.25)))
            v = -rate * sp
        elif cutlass.const_expr(self.gate == "safe"):
            z = rate * (v + bias)
            # rcp.approx (~1 ulp) rather than an IEEE division (a ~10-instruction sequence per element)
            v = self.lower_bound * cute.arch.rcp_approx(1.0 + cute.math.exp2(-z * LOG2E, fastmath=True))
        return v
