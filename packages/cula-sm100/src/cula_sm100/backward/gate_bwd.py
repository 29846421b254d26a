"""gate_bwd: the backward of the log-decay gate and of beta's activation, from the gradient of the raw log decay
(dld: chunk_bwd_intra's dG after its reverse chunk cumsum) and of the activated beta (dbeta).

    gate="precomputed":  dg = dld
    gate="softplus":     ld = -a softplus(x), x = g + dt_bias[hv], a = exp(A_log[hv])
                         dg = -a sigmoid(x) dld   (softplus(x) = x past 20: derivative 1)
                         dA_log[hv] = sum_t,k dld ld          ddt_bias[hv, k] = sum_t dg
    gate="safe":         ld = lb sigmoid(u), u = a (g + dt_bias[hv])   (no A_log: a = 1)
                         dg = lb s (1 - s) a dld               dA_log[hv] = sum_t,k lb s (1 - s) u dld
    beta:                dbeta_raw = dbeta * act'(beta_raw)   (none: 1; sigmoid: s(1 - s); 2sigmoid: 2 s(1 - s))

Tiling: one CTA per (chunk, value head), one thread per channel (K = 128 threads), as the forward's gate_cumsum:
the chunk's rows are walked in order, each thread keeping its channel's two partial sums (of dg for ddt_bias, of
the dA_log term) in registers; they leave as one fp32 value per (chunk, head, channel) in [NC, HV, K] buffers
that the host sums over chunks (and channels for dA_log) with torch.sum: a fixed order, no atomics, bitwise
deterministic. Threads 0..n-1 also do beta's rows. Assumes K = 128, chunks that never cross a sequence.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.cute_kernels.copies import head_rows
from cula_sm100.forward.cute_utils import chunk_block, token_layout

_BT, _K = 64, 128


class GateBwd:
    """Compile-time: the gate mode, which gate parameters exist, the safe gate's lower bound, beta's activation."""
    threads = _K

    def __init__(self, gate: str, has_A_log: bool, has_dt_bias: bool, lower_bound: float | None,
                 beta_activation: str):
        self.gate = gate
        self.has_A_log = has_A_log
        self.has_dt_bias = has_dt_bias
        self.lower_bound = float(lower_bound) if lower_bound is not None else 0.0
        self.beta_activation = beta_activation

    @cute.jit
    def __call__(self, dld_ptr: cute.Pointer, g_ptr: cute.Pointer, a_ptr: cute.Pointer, b_ptr: cute.Pointer,
                 db_ptr: cute.Pointer, beta_ptr: cute.Pointer, dg_ptr: cute.Pointer, dbeta_ptr: cute.Pointer,
                 pa_ptr: cute.Pointer, pb_ptr: cute.Pointer, table_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HV: cutlass.Int32, stream: cuda.CUstream):
        lay = token_layout(TT, HV, _K)
        col = cute.make_layout((TT, HV, 1), stride=(HV, 1, 1))
        part = token_layout(NC, HV, _K)
        self.kernel(cute.make_tensor(dld_ptr, lay), cute.make_tensor(g_ptr, lay),
                    cute.make_tensor(a_ptr, cute.make_layout((HV,))),
                    cute.make_tensor(b_ptr, cute.make_layout((HV, _K), stride=(_K, 1))),
                    cute.make_tensor(db_ptr, col), cute.make_tensor(beta_ptr, col), cute.make_tensor(dg_ptr, lay),
                    cute.make_tensor(dbeta_ptr, col), cute.make_tensor(pa_ptr, part), cute.make_tensor(pb_ptr, part),
                    cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1))),
                    ).launch(grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mDld: cute.Tensor, mg: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mDb: cute.Tensor,
               mBeta: cute.Tensor, mDg: cute.Tensor, mDbeta: cute.Tensor, mPa: cute.Tensor, mPb: cute.Tensor,
               mT: cute.Tensor):
        f32 = cutlass.Float32
        d, c, hv, t0, n = chunk_block(mT)
        tDld = head_rows(mDld, t0, hv, _BT)
        tg = head_rows(mg, t0, hv, _BT)
        tDg = head_rows(mDg, t0, hv, _BT)
        rate = f32(1.0)
        if cutlass.const_expr(self.has_A_log):
            rate = cute.math.exp(mA[hv].to(f32))
        bias = f32(0.0)
        if cutlass.const_expr(self.has_dt_bias):
            bias = mB[hv, d].to(f32)
        sa = f32(0.0)  # this channel's part of dA_log
        sb = f32(0.0)  # and of ddt_bias
        for r in cutlass.range_constexpr(_BT):
            if r < n:
                dl = tDld[r, d]
                dg = dl
                if cutlass.const_expr(self.gate == "softplus"):
                    x = tg[r, d].to(f32) + bias
                    sp = x
                    sg = f32(1.0)
                    if x <= 20.0:
                        e = cute.math.exp(x)
                        sp = cute.math.log1p(e)
                        sg = e / (1.0 + e)
                    dg = -rate * sg * dl
                    sa += -rate * sp * dl
                elif cutlass.const_expr(self.gate == "safe"):
                    u = rate * (tg[r, d].to(f32) + bias)
                    s = 1.0 / (1.0 + cute.math.exp(-u))
                    t = self.lower_bound * s * (1.0 - s) * dl
                    dg = t * rate
                    sa += t * u
                sb += dg
                tDg[r, d] = dg.to(mDg.element_type)
        if cutlass.const_expr(self.has_A_log):
            head_rows(mPa, c, hv, 1)[0, d] = sa
        if cutlass.const_expr(self.has_dt_bias):
            head_rows(mPb, c, hv, 1)[0, d] = sb
        if d < n:  # beta's activation, one row per thread
            db = head_rows(mDb, t0, hv, _BT)[d, 0]
            if cutlass.const_expr(self.beta_activation != "none"):
                s = 1.0 / (1.0 + cute.math.exp(-head_rows(mBeta, t0, hv, _BT)[d, 0].to(f32)))
                db = db * s * (1.0 - s)
                if cutlass.const_expr(self.beta_activation == "2sigmoid"):
                    db = db * 2.0
            head_rows(mDbeta, t0, hv, _BT)[d, 0] = db.to(mDbeta.element_type)
