"""chunk_intra_wu_gate: chunk_intra_wu fed the RAW gate g; it computes the gate and its chunk-local cumsum G itself
and writes G out, one (chunk of 64, value head) per CTA.

    G          = gate_cumsum.py's output, bitwise (same per-element gate code, same summation order)
    Aqk, Akk, w, u, kg   exactly as chunk_intra_wu.py (everything after G is its code, unchanged)

Why: gate_cumsum (reads g, writes G, fp32 [TT, HV, 128]) followed by chunk_intra_wu reads G back from HBM: at
B = 2, T = 8192, HV = 128 that read is ~1.07 GB. Here G is
produced where chunk_intra_wu keeps it anyway (sG) and only written: one HBM pass of G and one launch less.
fwd_o, chunk_delta_h and the backward read the G this kernel writes.

Tiling, threads and shared memory: chunk_intra_wu's (8 warps, 2 CTAs per SM, 128 registers per thread by the
launch bound, 107.25 KiB: sQ, sK, sG fp32 rows of 136, region R 41 KiB, beta). What changed, all before the score
GEMMs (the hooks load_G / fill_G / store_G of ChunkIntraWU.run):
  * load_G: the raw g rows < n (fp32 / bf16 / fp16) go by cp.async into region R as a plain row-major [64, 128]
    tile (32 KiB in fp32 <= R's 41 KiB; R is free until the decayed keys are built), not G into sG; issued before
    q and k in a cp.async group of its own (G_FIRST), so fill_G starts once g has landed, with q / k in flight;
  * fill_G: warps 0-3, thread = channel c (0..127): rate = exp(A_log[hv]) and dt_bias[hv, c] once, then for rows
    0..63 in order `acc += gate_of(raw[r, c])` and sG[r, c] = acc, rows >= n keeping the last valid sum (the
    "rows past a chunk's end repeat the last valid G" that chunk_intra assumes, which chunk_intra_wu's fill_G
    does by copying row n - 1). gate_of / rate_of / bias_of are GateCumsum's own methods (a GateCumsum instance
    is held), and each channel is summed sequentially in row order, from 0.0, exactly as gate_cumsum's warp lanes
    do: the same additions in the same order, in the same expression (ptxas contracts the softplus / safe gate's
    last multiply with the running add into one FFMA in both kernels). A sum over all 256 threads would need
    stored gate values (no FFMA contraction) or a different order: not bitwise, so the 128 other threads wait.
    The work is MUFU-bound (ex2 + lg2 per element for softplus: 16 per clock per SM), which 4 or 8 warps share
    alike;
  * store_G: after the barrier, every thread stores G rows < n from sG in 16-byte vectors (store_rows_s2g), rows
    past the chunk end never written.
Rows past a chunk's end are never read from global memory (cp.async predicated, the tile's rows zero-filled).

Host side: launch.intra_wu_gate_kernel (compiled per gate mode, g / A_log / dt_bias dtypes, their presence,
lower_bound, beta dtype and activation, qg_out) and launch.chunk_intra_wu_gate, the forward's first stage after
l2norm (the backward's recompute runs launch.gate_cumsum + launch.chunk_intra_wu instead: same outputs, bitwise).

qg_out (compile-time flag; launch.forward(intermediates=False), i.e. chunk_kda's forward):
instead of all of G the kernel writes
  * qg [TT, HV, K] bf16 = bf16(float(q[t, hq, c]) e^G[t, hv, c]), fwd_o's first GEMM operand, with fwd_o's very
    expression (cute_utils.scale_by_exp: fastmath exp of the fp32 G times the L2-normalised bf16 q), so the same
    bits; rows < n only, 16-byte stores;
  * G at the chunk's last valid row n - 1 only (token t0 + n - 1: ChunkDeltaH.last_g reads head_rows(G, t0, hv)
    [min(eos - t0, 64) - 1], and a chunk's n is min(eos - t0, 64)), so chunk_delta_h runs unchanged; the other rows
    of the G buffer are never written.
fwd_o then reads qg (FwdO(qg_in=True)) instead of q and G. Why: G in fp32 is the forward's largest avoidable traffic
(at B = 2, T = 8192, HV = 128: 1.07 GB written here, 1.07 GB read back by fwd_o plus 0.27 GB of q); qg is 0.54 GB
written and read once. Where: store_G, after the barrier that follows fill_G, when q is complete in sQ and G in sG
and neither has been overwritten yet (sG turns into the per-step decays, sQ into Akk's staging, both later in
fused_body): all 256 threads, each 8 channels of a row per step (a 16-byte vector of q, two of G, one store), 4
steps of 16 rows; G's last row by warps 0-3, one channel per thread. No shared memory added. The flag-off kernel is
the same code (kernel, not kernel_qg); its host function takes the qg pointer too (the last one) and ignores it.
Static resources of both variants: docs/kernel_report.md; measurements: docs/benchmarks/intra_wu.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from cula_sm100.forward.chunk_intra_wu import ChunkIntraWU
from cula_core.cute_kernels.copies import copy_rows_g2s, g2s_tiled_copy, head_rows, store_rows_s2g, vec_copy
from cula_sm100.forward.cute_utils import scale_by_exp, token_layout
from cula_sm100.forward.gate_cumsum import GateCumsum


class ChunkIntraWUGate(ChunkIntraWU):
    """ChunkIntraWU with G computed from the raw gate (load_G / fill_G / store_G replaced)."""
    G_FIRST = True  # the gate's ~64 serial rows per thread overlap q / k's loads

    def __init__(self, beta_activation: str, gate: str, has_A_log: bool, has_dt_bias: bool,
                 lower_bound: float | None, qg_out: bool = False):
        super().__init__(beta_activation)
        self.gates = GateCumsum(gate, has_A_log, has_dt_bias, lower_bound)
        # True: qg = bf16(q e^G) out (qg_ptr) and G only at each chunk's last row (see the module docstring);
        # False: all of G, qg_ptr not read (the kernel is the same as before the flag: PTX unchanged)
        self.qg_out = qg_out

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 a_ptr: cute.Pointer, b_ptr: cute.Pointer, G_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 Aqk_ptr: cute.Pointer, Akk_ptr: cute.Pointer, w_ptr: cute.Pointer, u_ptr: cute.Pointer,
                 kg_ptr: cute.Pointer, table_ptr: cute.Pointer, qg_ptr: cute.Pointer, TT: cutlass.Int32,
                 NC: cutlass.Int32, HQK: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        mQ, mK, mV, mBeta, mAqk, mAkk, mW, mU, mKg, mT = self.io_tensors(
            q_ptr, k_ptr, v_ptr, beta_ptr, Aqk_ptr, Akk_ptr, w_ptr, u_ptr, kg_ptr, table_ptr, TT, NC, HQK, HV)
        hv_k = token_layout(TT, HV, self.K)
        mg = cute.make_tensor(g_ptr, hv_k)
        mG = cute.make_tensor(G_ptr, hv_k)
        mA = cute.make_tensor(a_ptr, cute.make_layout((HV,)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((HV, self.K), stride=(self.K, 1)))
        args = (mQ, mK, mV, mg, mA, mB, mG, mBeta, mAqk, mAkk, mW, mU, mKg, mT)
        launch = dict(grid=[NC, HV, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=self.MIN_CTAS,
                      preferred_smem_carveout=100)
        if cutlass.const_expr(self.qg_out):
            self.kernel_qg(*args, cute.make_tensor(qg_ptr, hv_k), HV // HQK, scale).launch(**launch)
        else:
            self.kernel(*args, HV // HQK, scale).launch(**launch)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mg: cute.Tensor, mA: cute.Tensor,
               mB: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor,
               mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mT: cute.Tensor, group: cutlass.Int32,
               scale: cutlass.Float32):
        self.run((mg, mA, mB, mG), mQ, mK, mV, mBeta, mAqk, mAkk, mW, mU, mKg, mT, group, scale)

    @cute.kernel
    def kernel_qg(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mg: cute.Tensor, mA: cute.Tensor,
                  mB: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor,
                  mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mT: cute.Tensor, mQg: cute.Tensor,
                  group: cutlass.Int32, scale: cutlass.Float32):
        """kernel with qg_out: gate_in carries qg [TT, HV, K] bf16 as well."""
        self.run((mg, mA, mB, mG, mQg), mQ, mK, mV, mBeta, mAqk, mAkk, mW, mU, mKg, mT, group, scale)

    def raw_tile(self, r_raw: cute.Pointer, dtype):
        """The raw g rows of the chunk, [64, 128] row-major at the start of region R."""
        return cute.make_tensor(cute.recast_ptr(r_raw, dtype=dtype),
                                cute.make_layout((self.BT, self.K), stride=(self.K, 1)))

    @cute.jit
    def load_G(self, gate_in, sG: cute.Tensor, r_raw: cute.Pointer, tidx, hv, t0, n):
        """Issue the cp.async of the raw g rows < n into region R (16-byte vectors; rows past the end zeroed)."""
        mg = gate_in[0]
        dt = mg.element_type
        copy_rows_g2s(g2s_tiled_copy(self.K, self.threads, dt), head_rows(mg, t0, hv, self.BT),
                      self.raw_tile(r_raw, dt), n, tidx)

    @cute.jit
    def fill_G(self, gate_in, sG: cute.Tensor, r_raw: cute.Pointer, tidx, hv, n):
        """sG = the chunk-local cumsum of the gate (gate_cumsum's arithmetic and order), rows >= n repeating row
        n - 1: warps 0-3, one channel per thread, rows in order."""
        mg, mA, mB = gate_in[:3]
        if tidx < self.K:  # warp-uniform
            raw = self.raw_tile(r_raw, mg.element_type)
            rate = self.gates.rate_of(mA, hv)
            bias = self.gates.bias_of(mB, hv, tidx)
            acc = cutlass.Float32(0.0)
            for r in cutlass.range_constexpr(self.BT):
                nxt = acc + self.gates.gate_of(raw[r, tidx].to(cutlass.Float32), rate, bias)
                if r < n:
                    acc = nxt
                sG[r, tidx] = acc

    @cute.jit
    def store_G(self, gate_in, sQ: cute.Tensor, sG: cute.Tensor, tidx, hv, t0, n):
        """After the barrier that follows fill_G: G rows < n to global memory in 16-byte vectors; with qg_out, qg
        rows < n and G's row n - 1 (the one chunk_delta_h's last_g reads) instead."""
        mG = head_rows(gate_in[3], t0, hv, self.BT)
        if cutlass.const_expr(self.qg_out):
            self.store_qg(head_rows(gate_in[4], t0, hv, self.BT), sQ, sG, tidx, n)
            if tidx < self.K:  # warps 0-3, one channel each: 512 contiguous bytes
                mG[n - 1, tidx] = sG[n - 1, tidx]
        else:
            store_rows_s2g(sG, mG, n, tidx, self.threads)

    @cute.jit
    def store_qg(self, gQg: cute.Tensor, sQ: cute.Tensor, sG: cute.Tensor, tidx, n):
        """gQg rows < n = bf16(q e^G) from sQ (bf16, swizzled) and sG (fp32, rows of 136), every thread 8 channels
        of a row per step in 16-byte vectors (one of q, two of G, one store), 4 steps of 16 rows; the arithmetic is
        fwd_o's (cute_utils.scale_by_exp)."""
        BT, K = self.BT, self.K
        vb = vec_copy(K, self.threads)
        vf = vec_copy(K, self.threads, cutlass.Float32)
        tb = vb.get_slice(tidx)
        pQ = tb.partition_S(sQ)
        pG = vf.get_slice(tidx).partition_S(sG)
        pO = tb.partition_D(gQg)
        coord = tb.partition_S(cute.make_identity_tensor((BT, K)))
        fq = cute.make_fragment_like(pQ[None, 0, None])
        fg = cute.make_fragment_like(pG[None, 0, None])
        for m in cutlass.range_constexpr(cute.size(pQ.shape[1])):
            if coord[0, m, 0][0] < n:
                cute.copy(vb, pQ[None, m, None], fq)
                cute.copy(vf, pG[None, m, None], fg)
                scale_by_exp(fq, fg)
                cute.copy(vb, fq, pO[None, m, None])
