"""chunk_intra with the preprocessing folded in (opt-in, `launch.forward(..., fused_prep=True)`): one kernel that
reads raw g and raw q / k once and does what gate_cumsum.py, l2norm.py and chunk_intra.py do in three passes.

Per (chunk of 64, value head) CTA, 128 threads, the same 104 KiB of shared memory as chunk_intra (2 CTAs / SM):
  * q / k of head hv // (HV // HQK) by cp.async into sQ / sK (zero rows past the chunk end), as chunk_intra;
  * meanwhile the gate and its chunk-local cumsum, thread per channel (gate_cumsum.py's formulas and order, its
    `gate_of` shared): raw g in 4 batches of 16 independent loads, G written to sG and to global G (fp32, rows
    < n; recompute_w_u, fwd_o and the backward read it); rows past the end repeat the last valid G (the
    invariant chunk_intra needs: every exponent <= 0);
  * q / k L2 norm (use_qk_l2norm_in_kernel) in shared memory, l2norm.py's arithmetic (warp per row, lane = 4
    consecutive channels, fp32 sum of squares, butterfly, rsqrt(ss + eps), bf16), so the result is the staged
    path's; the CTA of the first value head of each q/k head group writes the normalised rows out (later
    kernels read them), the others only use them;
  * then chunk_intra's scores and solve unchanged (`ChunkIntra.scores_and_solve`).
HBM traffic against the staged path (l2norm reads q, k and writes them normalised; gate_cumsum reads g and writes
G; chunk_intra reads normalised q, k and G): raw g, raw q / k are read once and G, normalised q / k written once
as before (later kernels read them), but chunk_intra's re-reads go: per token, 128 x 4 bytes of G per value head
and 2 x 256 bytes of q / k per q/k head, and 3 of 4 launches.
Assumptions as chunk_intra's (bf16 q / k, K = 128, chunks of <= 64 tokens from the chunk table, g <= 0 decays).
Status: compiled for sm_90a and sm_100a on the CPU; not yet run on a GPU (docs/sm100.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_core.reference.gates import L2NORM_EPS
from cula_sm100.forward.chunk_intra import ChunkIntra
from cula_sm100.forward.cute_utils import head_rows, load_beta, store_rows_s2g, token_layout
from cula_sm100.forward.gate_cumsum import GateCumsum


class ChunkIntraPrep(ChunkIntra):
    G_BATCH = 16  # raw g rows loaded per batch (independent loads in flight, bounded registers)

    def __init__(self, beta_activation: str, gate: str, has_A_log: bool, has_dt_bias: bool,
                 lower_bound: float | None, l2norm: bool):
        super().__init__(beta_activation)
        self.gate_op = GateCumsum(gate, has_A_log, has_dt_bias, lower_bound)
        self.l2norm = l2norm

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, g_ptr: cute.Pointer, a_ptr: cute.Pointer,
                 b_ptr: cute.Pointer, beta_ptr: cute.Pointer, qn_ptr: cute.Pointer, kn_ptr: cute.Pointer,
                 G_ptr: cute.Pointer, Aqk_ptr: cute.Pointer, Akk_ptr: cute.Pointer, table_ptr: cute.Pointer,
                 TT: cutlass.Int32, NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        K, BT = self.K, self.BT
        qk = token_layout(TT, HQK, K)
        mQ, mK = cute.make_tensor(q_ptr, qk), cute.make_tensor(k_ptr, qk)
        mQn, mKn = cute.make_tensor(qn_ptr, qk), cute.make_tensor(kn_ptr, qk)
        mg = cute.make_tensor(g_ptr, token_layout(TT, HV, K))
        mG = cute.make_tensor(G_ptr, token_layout(TT, HV, K))
        mA = cute.make_tensor(a_ptr, cute.make_layout((HV,)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((HV, K), stride=(K, 1)))
        mBeta = cute.make_tensor(beta_ptr, token_layout(TT, HV, 1))
        mAqk = cute.make_tensor(Aqk_ptr, token_layout(TT, HV, BT))
        mAkk = cute.make_tensor(Akk_ptr, token_layout(TT, HV, BT))
        mT = cute.make_tensor(table_ptr, cute.make_layout((NC, 2), stride=(2, 1)))
        self.kernel(mQ, mK, mg, mA, mB, mBeta, mQn, mKn, mG, mAqk, mAkk, mT, HV // HQK, scale).launch(
            grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mg: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor,
               mBeta: cute.Tensor, mQn: cute.Tensor, mKn: cute.Tensor, mG: cute.Tensor, mAqk: cute.Tensor,
               mAkk: cute.Tensor, mT: cute.Tensor, group: cutlass.Int32, scale: cutlass.Float32):
        BT = self.BT
        # ---- q / k in flight (begin issues their cp.async) while the gate is computed
        tidx, hv, t0, n, w, lane, sQ, sK, sG, r_raw, sBeta = self.begin(mQ, mK, mT, group)
        hq = hv // group
        cute.arch.cp_async_commit_group()
        load_beta(sBeta, mBeta, t0, hv, n, tidx, self.beta_activation)

        # ---- gate and chunk-local cumsum, thread per channel (K = 128 threads). Rows past the end keep the
        #      last valid G (acc is not advanced there), which is what chunk_intra's exponents need.
        tg = head_rows(mg, t0, hv, BT)
        tG = head_rows(mG, t0, hv, BT)
        rate, bias = self.gate_op.rate_bias(mA, mB, hv, tidx)
        x = cute.make_rmem_tensor((self.G_BATCH,), cutlass.Float32)
        acc = cutlass.Float32(0.0)
        for b in cutlass.range_constexpr(BT // self.G_BATCH):
            for i in cutlass.range_constexpr(self.G_BATCH):
                x[i] = cutlass.Float32(0.0)
                if b * self.G_BATCH + i < n:
                    x[i] = tg[b * self.G_BATCH + i, tidx].to(cutlass.Float32)
            for i in cutlass.range_constexpr(self.G_BATCH):
                r = b * self.G_BATCH + i
                if r < n:
                    acc += self.gate_op.gate_of(x[i], rate, bias)
                    tG[r, tidx] = acc
                sG[r, tidx] = acc
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        # ---- q / k L2 norm in place: warp w normalises q and k rows 16 w .. 16 w + 15 (zero rows stay zero)
        if cutlass.const_expr(self.l2norm):
            self.normalise_rows(sQ, w, lane)
            self.normalise_rows(sK, w, lane)
            cute.arch.sync_threads()
            # one writer per q/k head: the CTA of the group's first value head (the rows are the same for all)
            if hv % group == 0:
                store_rows_s2g(sQ, head_rows(mQn, t0, hq, BT), n, tidx, self.threads)
                store_rows_s2g(sK, head_rows(mKn, t0, hq, BT), n, tidx, self.threads)

        self.scores_and_solve(sQ, sK, sG, r_raw, sBeta, mAqk, mAkk, tidx, w, lane, hv, t0, n, scale)

    @cute.jit
    def normalise_rows(self, s: cute.Tensor, w, lane):
        """Rows 16 w .. 16 w + 15 of the bf16 tile s times rsqrt(sum of squares + eps), l2norm.py's arithmetic."""
        v4 = cute.make_rmem_tensor((4,), cutlass.BFloat16)
        f4 = cute.make_rmem_tensor((4,), cutlass.Float32)
        for i in cutlass.range_constexpr(self.BC):
            row = w * self.BC + i
            self.load4(s, row, lane, v4)
            ss = cutlass.Float32(0.0)
            for e in cutlass.range_constexpr(4):
                f4[e] = v4[e].to(cutlass.Float32)
                ss += f4[e] * f4[e]
            for sh in cutlass.range_constexpr(5):
                ss += cute.arch.shuffle_sync_bfly(ss, 1 << sh)
            rs = cute.math.rsqrt(ss + L2NORM_EPS)
            for e in cutlass.range_constexpr(4):
                v4[e] = (f4[e] * rs).to(cutlass.BFloat16)
            self.store4(v4, s, row, lane)
