"""Recurrent KDA decode over a state pool: T tokens per (request, value head), the state in registers.

Serves `kda_decode` (T = 1), `kda_decode_mtp` (the state after all T tokens into the pool, or the T per-token
states into a new tensor), `kda_decode_mtp_kvbuffer` (the verify step: outputs and the KVBuffer
[k_t, G_t, delta_t] per token, no state written) and fused_recurrent_kda's speculative pool mode (MODE_SLOTS: a slot
per token, below), chosen by the compile-time `mode`.

Tiling. One CTA = one (request n, value head hv, block of BV value columns); 32*NW threads. Warp w owns BV/NW
columns; inside a warp, lane = kr * VL + vc: VL lanes along V (CW columns each), KL = 32 / VL lanes along K
(RK = K / KL consecutive rows each). A lane holds its RK x CW piece of the fp32 state in registers. The
reductions over K (S^T k, S^T q) are an in-lane sum over RK rows and a butterfly over the KL lanes of the
warp (log2 KL shuffles per column): warps never talk to each other after the prologue.

Pipeline. Prologue: the lane loads its state piece (the long-latency traffic), its v columns and beta for
all T tokens (beta activated: runtime `beta_sigmoid`), while the warps share out the per-token vectors of the head
(q, k L2-normalised and q scaled, the log decay: g itself when the runtime `precomputed_gate` is set, else the gate
computed from raw g; its exp) into shared memory; one barrier. Then the T tokens run back to back
on registers and shared memory only: decay, then one pass over the decayed state for both u = (D S)^T k and
w = (D S)^T q (two independent butterflies), delta = beta (v - u), o = w + delta (k.q), rank-1 update, stores.
With `warp_local`, each warp prepares all the per-token vectors itself in its own slice of shared memory and syncs
only itself (no CTA barrier).

Assumptions (checked on the host in launch.py): inputs contiguous, q/k/g/v/o/pool/states/buffer pointers
16-byte aligned, K % 32 == 0, V % BV == 0; N, HV, HQK, P, scale, lower_bound and null_slot are runtime values
(one compilation serves every batch), and so are precomputed_gate (1: g is the log decay; A_log, dt_bias and
lower_bound are then never read; 0: the compiled gate code) and beta_sigmoid (configs.BETA_SIGMOID: 0 = beta as
given, m > 0 = m * sigmoid(beta)): both are the same for every thread of the grid, so their branches never diverge;
cache_idx < 0, >= P or == null_slot marks a slot that is skipped (outputs zero, nothing of the pool read or
written).

MODE_SLOTS (launched through `launch_slots`, which adds three runtime arguments): cache_idx is an int32 table
[N, idx_cols] (row stride idx_cols >= T), `accepted` an int32 [N] read only when has_accepted != 0. Request n reads
its state from slot cache_idx[n, c] with c = clamp(accepted[n] - 1, 0, idx_cols - 1) (c = 0 without accepted
counts); that slot decides padding as above. After token t the lane stores its state piece into slot cache_idx[n, t]
unless that slot is skipped by the same rule. Each thread stores its own piece, in token order, after its prologue
read: a slot named twice in a row keeps the later state, and a row may write the slot it read. Two rows must not
share a slot (cula_core checks that where it can read the indices).

The pool is fp32 or bf16 (the pointer's type; the state stays fp32 in registers) in [K, V] or,
compile-time `state_v_first`, [V, K] per state (a lane then loads its piece by columns, RK consecutive rows each,
and transposes it in registers).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cula_sm90.decode._dsl import (activate_beta, gate_from_raw, l2_normalize, load_state_piece, load_vec,
                                   slot_in_use, state_piece_offset, store_state_piece, store_vec, store_zeros,
                                   thread_coords, xor_sum)

from cula_sm90.decode.configs import MODE_FINAL, MODE_KVBUFFER, MODE_SLOTS, MODE_STATES


class RecurrentDecode:
    """Compile-time configuration of one recurrent decode kernel.

    T: tokens per request; K, V: head dims; mode: MODE_FINAL (state after T tokens into the pool),
    MODE_STATES (the T per-token states into `states`, pool untouched), MODE_KVBUFFER (the KVBuffer into
    `kvbuf`, pool untouched) or MODE_SLOTS (the state after each token into the pool slot of that token);
    safe_gate / has_A_log / has_dt_bias / l2norm select the gate code (the in-kernel gate,
    skipped at run time for a precomputed log decay);
    block_v (BV), lanes_v (VL), num_warps (NW): the tiling above."""

    def __init__(self, *, T: int, K: int, V: int, mode: str, safe_gate: bool, has_A_log: bool, has_dt_bias: bool,
                 l2norm: bool, block_v: int = 32, lanes_v: int = 4, num_warps: int = 4, warp_local: bool = False,
                 state_v_first: bool = False):
        if K % 32 or 32 % lanes_v or V % block_v or block_v % (num_warps * lanes_v):
            raise ValueError(f"bad tiling: K={K} V={V} BV={block_v} VL={lanes_v} NW={num_warps}")
        self.T, self.K, self.V, self.mode = T, K, V, mode
        self.safe_gate, self.has_A_log, self.has_dt_bias, self.l2norm = safe_gate, has_A_log, has_dt_bias, l2norm
        self.BV, self.VL, self.NW = block_v, lanes_v, num_warps
        # the pool's (and MODE_STATES output's) layout: [K, V] per state, or [V, K]; their element type is the
        # pointer's (fp32 or bf16: the state is held in fp32 registers either way)
        self.v_first = state_v_first
        # warp_local: every warp prepares all per-token vectors itself, in its own slice of shared memory, and
        # syncs only itself (no CTA barrier: each warp starts its token loop when its own loads land)
        self.warp_local = warp_local
        self.KL = 32 // lanes_v                      # lanes along K
        self.RK = K // self.KL                       # state rows per lane
        self.CW = block_v // (num_warps * lanes_v)   # state columns per lane
        self.NVB = V // block_v                      # CTAs per (request, head)
        self.EPL = K // 32                           # elements per lane of a per-token K-vector
        self.n_vec = 4 if mode == MODE_KVBUFFER else 3   # q, k, exp(g) [, g] per token in shared memory
        self.slice = self.n_vec * T * K              # floats of one copy of the per-token vectors
        self.smem_bytes = (num_warps if warp_local else 1) * self.slice * 4

    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
                 A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
                 o: cute.Pointer, out: cute.Pointer, N: Int32, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
                 lower_bound: Float32, null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32, stream):
        # the slot-table arguments of MODE_SLOTS are never read in the other modes: stand-ins
        self.kernel(q, k, v, g, beta, A_log, dt_bias, pool, cache_idx, o, out, HQK, HV, P, scale, lower_bound,
                    null_slot, precomputed_gate, beta_sigmoid, cache_idx, Int32(1), Int32(0)).launch(
            grid=[N * HV * self.NVB, 1, 1], block=[32 * self.NW, 1, 1], smem=self.smem_bytes, stream=stream)

    @cute.jit
    def launch_slots(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
                     A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
                     o: cute.Pointer, out: cute.Pointer, N: Int32, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
                     lower_bound: Float32, null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32,
                     accepted: cute.Pointer, idx_cols: Int32, has_accepted: Int32, stream):
        """The host entry of MODE_SLOTS: __call__'s arguments (`out` never touched) and the slot table's: accepted
        counts, the table's row stride idx_cols, has_accepted (0: read column 0, `accepted` never read)."""
        self.kernel(q, k, v, g, beta, A_log, dt_bias, pool, cache_idx, o, out, HQK, HV, P, scale, lower_bound,
                    null_slot, precomputed_gate, beta_sigmoid, accepted, idx_cols, has_accepted).launch(
            grid=[N * HV * self.NVB, 1, 1], block=[32 * self.NW, 1, 1], smem=self.smem_bytes, stream=stream)

    def _store_gate(self, sv, wb, t: int, e0, gl):
        """Token t's decay exp(gl) (and, for the KVBuffer, the log decay gl) of this lane's elements into shared
        memory."""
        T, K, EPL = self.T, self.K, self.EPL
        store_vec(sv, wb + ((2 * T + t) * K) + e0, [cute.math.exp(x) for x in gl], EPL)
        if self.mode == MODE_KVBUFFER:
            store_vec(sv, wb + ((3 * T + t) * K) + e0, gl, EPL)

    @cute.kernel
    def kernel(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
               A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
               o: cute.Pointer, out: cute.Pointer, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
               lower_bound: Float32, null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32,
               accepted: cute.Pointer, idx_cols: Int32, has_accepted: Int32):
        T, K, V, RK, CW, EPL = self.T, self.K, self.V, self.RK, self.CW, self.EPL
        _, warp, lane, kr, vc = thread_coords(self.VL)
        bid = cute.arch.block_idx()[0]
        vb = bid % self.NVB
        head = bid // self.NVB          # n * HV + hv
        hv = head % HV
        n = head // HV
        h = hv // (HV // HQK)           # GVA: q/k head of this value head
        row0 = kr * RK
        col0 = vb * self.BV + warp * (self.VL * CW) + vc * CW
        if cutlass.const_expr(self.mode == MODE_SLOTS):
            slot_row = cache_idx + Int64(n) * idx_cols   # this request's row of the slot table
            read_col = Int32(0)
            if has_accepted != 0:   # the same for the whole grid: no divergence
                read_col = cute.make_tensor(accepted + Int64(n), cute.make_layout(1))[0] - 1
                read_col = cutlass.select_(read_col < 0, Int32(0), read_col)
                read_col = cutlass.select_(read_col >= idx_cols, idx_cols - 1, read_col)
            idx = cute.make_tensor(slot_row + Int64(read_col), cute.make_layout(1))[0]
        else:
            idx = cute.make_tensor(cache_idx + Int64(n), cute.make_layout(1))[0]
        live = slot_in_use(idx, P, null_slot)

        smem = cutlass.memory.SmemAllocator()
        nslices = self.NW if cutlass.const_expr(self.warp_local) else 1
        vecs = smem.allocate_tensor(Float32, cute.make_layout(nslices * self.slice), byte_alignment=16)
        sv = vecs.iterator
        # this warp's copy of the per-token vectors: [n_vec][T][K] floats from `wb`
        wb = Int32(0)
        if cutlass.const_expr(self.warp_local):
            wb = warp * self.slice
        tok0 = Int64(n) * T                 # first token row of this request
        if live:
            # --- prologue: state piece, v and beta into registers; per-token vectors into shared memory
            sbase = state_piece_offset(Int64(idx) * HV + hv, row0, col0, K, V, self.v_first)
            S = load_state_piece(pool, sbase, RK, CW, K, V, self.v_first)
            vr = [load_vec(v, ((tok0 + t) * HV + hv) * V + col0, CW) for t in range(T)]
            br = [activate_beta(cute.make_tensor(beta + ((tok0 + t) * HV + hv), cute.make_layout(1)).load()
                                .to(Float32)[0], beta_sigmoid) for t in range(T)]
            if cutlass.const_expr(self.mode == MODE_SLOTS):
                wslot = [cute.make_tensor(slot_row + t, cute.make_layout(1))[0] for t in range(T)]
            e0 = lane * EPL
            for job in cutlass.range_constexpr(3 * T):
                t, which = job // 3, job % 3
                if self.warp_local or warp == job % self.NW:
                    if cutlass.const_expr(which < 2):
                        src = q if cutlass.const_expr(which == 0) else k
                        x = load_vec(src, ((tok0 + t) * HQK + h) * K + e0, EPL)
                        if cutlass.const_expr(self.l2norm):
                            x = l2_normalize(x, EPL)
                        if cutlass.const_expr(which == 0):
                            x = [xi * scale for xi in x]
                        store_vec(sv, wb + ((which * T + t) * K) + e0, x, EPL)
                    else:
                        graw = load_vec(g, ((tok0 + t) * HV + hv) * K + e0, EPL)
                        if precomputed_gate != 0:   # g is the log decay: A_log and dt_bias are not read
                            self._store_gate(sv, wb, t, e0, graw)
                        else:
                            self._store_gate(sv, wb, t, e0, gate_from_raw(
                                graw, A_log, dt_bias, hv, e0, K, lower_bound, has_A_log=self.has_A_log,
                                has_dt_bias=self.has_dt_bias, safe=self.safe_gate))
            # live is the same for the whole CTA: every thread reaches this barrier
            if cutlass.const_expr(self.warp_local):
                cute.arch.sync_warp()
            else:
                cute.arch.sync_threads()
            G = [Float32(0.0) for _ in range(RK)]
            for t in cutlass.range_constexpr(T):
                qq = load_vec(sv, wb + ((0 * T + t) * K) + row0, RK)
                kk = load_vec(sv, wb + ((1 * T + t) * K) + row0, RK)
                dd = load_vec(sv, wb + ((2 * T + t) * K) + row0, RK)
                # k.q of this token (independent of the state: off the critical path)
                kq = Float32(0.0)
                for r in cutlass.range_constexpr(RK):
                    kq = kq + qq[r] * kk[r]
                kq = xor_sum(kq, self.VL)
                S = [[S[r][c] * dd[r] for c in range(CW)] for r in range(RK)]
                # one pass over the decayed state for both products: u = (D S)^T k and w = (D S)^T q; then
                # o = S_new^T q = w + delta (k.q). Both butterflies are independent: half the serial shuffle
                # depth of computing o after the update.
                us = []
                ws = []
                for c in cutlass.range_constexpr(CW):
                    u = Float32(0.0)
                    w = Float32(0.0)
                    for r in cutlass.range_constexpr(RK):
                        u = u + S[r][c] * kk[r]
                        w = w + S[r][c] * qq[r]
                    us.append(u)
                    ws.append(w)
                us = [xor_sum(u, self.VL) for u in us]
                ws = [xor_sum(w, self.VL) for w in ws]
                delta = [br[t] * (vr[t][c] - us[c]) for c in range(CW)]
                oc = [ws[c] + delta[c] * kq for c in range(CW)]
                if cutlass.const_expr(t + 1 < T or self.mode != MODE_KVBUFFER):  # the verify never stores S
                    S = [[S[r][c] + kk[r] * delta[c] for c in range(CW)] for r in range(RK)]
                row = (tok0 + t) * HV + hv
                if kr == 0:
                    store_vec(o, row * V + col0, oc, CW)
                if cutlass.const_expr(self.mode == MODE_STATES):
                    store_state_piece(out, state_piece_offset(row, row0, col0, K, V, self.v_first), S, RK, CW, K,
                                      V, self.v_first)
                if cutlass.const_expr(self.mode == MODE_SLOTS):
                    ws = wslot[t]
                    if slot_in_use(ws, P, null_slot):
                        store_state_piece(pool, state_piece_offset(Int64(ws) * HV + hv, row0, col0, K, V,
                                                                   self.v_first), S, RK, CW, K, V, self.v_first)
                if cutlass.const_expr(self.mode == MODE_KVBUFFER):
                    W = 2 * K + V
                    if kr == 0:
                        store_vec(out, row * W + (2 * K) + col0, delta, CW)
                    gt = load_vec(sv, wb + ((3 * T + t) * K) + row0, RK)
                    G = [G[r] + gt[r] for r in range(RK)]
                    if (vb == 0) & (warp == 0) & (vc == 0):
                        store_vec(out, row * W + row0, kk, RK)
                        store_vec(out, row * W + K + row0, G, RK)
            if cutlass.const_expr(self.mode == MODE_FINAL):
                store_state_piece(pool, state_piece_offset(Int64(idx) * HV + hv, row0, col0, K, V, self.v_first), S,
                                  RK, CW, K, V, self.v_first)
        else:
            # padded slot: zero outputs (and zero per-token states / buffer), the pool is not touched
            for t in cutlass.range_constexpr(T):
                row = (tok0 + t) * HV + hv
                if kr == 0:
                    store_zeros(o, row * V + col0, CW)
                if cutlass.const_expr(self.mode == MODE_STATES):
                    store_state_piece(out, state_piece_offset(row, row0, col0, K, V, self.v_first),
                                      [[Float32(0.0)] * CW for _ in range(RK)], RK, CW, K, V, self.v_first)
                if cutlass.const_expr(self.mode == MODE_KVBUFFER):
                    W = 2 * K + V
                    if kr == 0:
                        store_zeros(out, row * W + (2 * K) + col0, CW)
                    if (vb == 0) & (warp == 0) & (vc == 0):
                        store_zeros(out, row * W + row0, RK)
                        store_zeros(out, row * W + K + row0, RK)
