"""Preprocessing of the log decay: the gate (precomputed, softplus or safe) and its chunk-local cumsum.

    x_t = g_t                                                   (gate="precomputed")
    x_t = -exp(A_log[hv]) * softplus(g_t + dt_bias[hv])         (gate="softplus", softplus(x) = x for x > 20)
    x_t = lower_bound * sigmoid(exp(A_log[hv]) * (g_t + dt_bias[hv]))   (gate="safe"; no A_log: factor 1)
    G_t = x_{t0} + ... + x_t   within each 64-token chunk (natural log; FLA stores G / ln 2)

Tiling: one CTA per (chunk, value head), one thread per channel (K = 128 threads): the chunk's 64 tokens are
loaded into registers first (independent, coalesced loads), then summed in order and stored as fp32
`[T_total, HV, K]`. The chunk table gives each chunk's first token and length (1..64): chunks never cross
a sequence boundary, so varlen needs nothing more.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.cute_utils import chunk_block, head_rows, token_layout


class GateCumsum:
    BT = 64
    K = 128

    def __init__(self, gate: str, has_A_log: bool, has_dt_bias: bool, lower_bound: float | None):
        self.gate = gate
        self.has_A_log = has_A_log
        self.has_dt_bias = has_dt_bias
        self.lower_bound = float(lower_bound) if lower_bound is not None else 0.0

    @cute.jit
    def __call__(self, g_ptr: cute.Pointer, a_ptr: cute.Pointer, b_ptr: cute.Pointer, G_ptr: cute.Pointer,
                 table_ptr: cute.Pointer, TT: cutlass.Int32, NC: cutlass.Int32, HV: cutlass.Int32,
                 stream: cuda.CUstream):
        lay = token_layout(TT, HV, self.K)
        mg = cute.make_tensor(g_ptr, lay)
        mG = cute.make_tensor(G_ptr, lay)
        mA = cute.make_tensor(a_ptr, cute.make_layout((HV,)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((HV, self.K), stride=(self.K, 1)))
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(mg, mA, mB, mG, mT).launch(grid=[NC, HV, 1], block=[self.K, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mg: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mG: cute.Tensor, mT: cute.Tensor):
        d, _, hv, t0, n = chunk_block(mT)
        tg = head_rows(mg, t0, hv, self.BT)
        tG = head_rows(mG, t0, hv, self.BT)
        x = cute.make_rmem_tensor((self.BT,), cutlass.Float32)
        for r in cutlass.range_constexpr(self.BT):
            x[r] = cutlass.Float32(0.0)
            if r < n:
                x[r] = tg[r, d].to(cutlass.Float32)
        rate, bias = self.rate_bias(mA, mB, hv, d)
        acc = cutlass.Float32(0.0)
        for r in cutlass.range_constexpr(self.BT):
            acc += self.gate_of(x[r], rate, bias)
            if r < n:
                tG[r, d] = acc

    @cute.jit
    def rate_bias(self, mA: cute.Tensor, mB: cute.Tensor, hv, d):
        """(exp(A_log[hv]) or 1, dt_bias[hv, d] or 0) in fp32."""
        rate = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_A_log):
            rate = cute.math.exp(mA[hv].to(cutlass.Float32))
        bias = cutlass.Float32(0.0)
        if cutlass.const_expr(self.has_dt_bias):
            bias = mB[hv, d].to(cutlass.Float32)
        return rate, bias

    @cute.jit
    def gate_of(self, v: cutlass.Float32, rate: cutlass.Float32, bias: cutlass.Float32):
        """The log decay x_t of one raw g_t (the module docstring's formulas)."""
        if cutlass.const_expr(self.gate == "softplus"):
            z = v + bias
            sp = z
            if z <= 20.0:
                sp = cute.math.log1p(cute.math.exp(z))
            v = -rate * sp
        elif cutlass.const_expr(self.gate == "safe"):
            z = rate * (v + bias)
            v = self.lower_bound / (1.0 + cute.math.exp(-z))
        return v
